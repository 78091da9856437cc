"""The scheduler of a hybrid model: a block table per KV cache group (pure Python).

A model mixing full-attention and sliding-window layers keeps its K/V in pages of one
pool, a table per group (`core.kv_groups`). A sequence's token block j holds one page
per group: `seq.block_table[j]` (group 0, full) and `seq.group_tables[g - 1][j]`. Full
groups keep every block, as the single-table scheduler does. A window group's page is
freed once it is wholly older than the window of the sequence's next query (at each row's
schedule, and at admission after a prefix hit), its entry becoming the null block; the
attention ops never read there. Growing by one token block takes one page per group, so
the capacity a sequence can still get is `free pages // groups` blocks; preemption and
finishing release every group's pages. The prefix cache is `HybridPrefixPool`.

`sliding_window` is set to the smallest group window: the base scheduler calls
`release_window` only once a sequence is past it, and the engine turns cascade planning
off for a windowed scheduler (a member's freed window pages would be read through the
group's shared table).
"""

from __future__ import annotations

from jprefix.core.block_manager import NULL_BLOCK, BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.hybrid_cache import HybridPrefixPool
from jprefix.core.scheduler import Scheduler
from jprefix.core.sequence import Sequence


def release_group_windows(seq: Sequence, start: int, groups, block_manager: BlockManager
                          ) -> None:
    """Frees, per window group, seq's pages that hold no key of its query at `start`'s
    window; the table is replaced (the worker caches tables by identity)."""
    B = block_manager.block_size
    for g in groups.window_groups:
        table = seq.group_tables[g - 1]
        dead = groups.first_needed_block(g, start, B)
        if dead <= 0 or table[dead - 1] == NULL_BLOCK:
            continue
        first = dead - 1
        while first > 0 and table[first - 1] != NULL_BLOCK:
            first -= 1
        block_manager.free(table[first:dead])
        seq.group_tables[g - 1] = [NULL_BLOCK] * dead + table[dead:]


class HybridScheduler(Scheduler):
    """`Scheduler` over per-group block tables from one pool of pages."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 prefix_pool: HybridPrefixPool):
        self.groups = groups = prefix_pool.groups
        if groups.windows[0] is not None:
            raise ValueError(f"group 0 must be a full-attention group, got {groups.windows}")
        super().__init__(config, block_manager, prefix_pool, groups.min_window)

    def release_window(self, seq: Sequence, start: int, window: int,
                       block_manager: BlockManager) -> None:
        release_group_windows(seq, start, self.groups, block_manager)

    def _match(self, seq: Sequence) -> None:
        max_blocks = seq.num_matchable_blocks(self.block_size)
        if seq.num_prompt_logprobs is not None and seq.num_output_tokens == 0:
            max_blocks = 0  # every prompt position's logits are wanted (`Scheduler._match`)
        tables = self.prefix_pool.acquire_groups(seq.all_token_ids, max_blocks, seq.cache_salt)
        seq.block_table, seq.group_tables = tables[0], tables[1:]
        seq.num_registered_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def _allocate(self, seq: Sequence, end: int) -> None:
        """Extends every group's table to hold the first `end` tokens (they fit)."""
        G = self.groups.num_groups
        if not seq.group_tables:  # (admitted without a prefix match)
            seq.group_tables = [[NULL_BLOCK] * len(seq.block_table) for _ in range(G - 1)]
        new = self.block_manager.blocks_for(end) - len(seq.block_table)
        if new <= 0:
            return
        pages = self.block_manager.allocate(new * G)
        seq.block_table.extend(pages[0::G])
        for g, table in enumerate(seq.group_tables, 1):
            table.extend(pages[g::G])

    def _tokens_that_fit(self, seq: Sequence, n: int) -> int:
        blocks = len(seq.block_table) + self.block_manager.num_free_blocks // self.groups.num_groups
        return max(0, min(n, blocks * self.block_size - seq.num_computed_tokens))

    def _never_fits(self, seq: Sequence) -> bool:
        bm = self.block_manager
        if bm.blocks_for(seq.num_tokens) * self.groups.num_groups > bm.num_blocks - 1:
            return True
        return not self._can_chunk(seq) and seq.num_tokens > self.config.max_num_batched_tokens
