"""Freeing the blocks a sliding window no longer reaches (pure Python).

In a model whose every layer attends through a window of w tokens, a query at position
p reads only the keys p - w < k <= p, and positions only grow: a block wholly older than
the window of a sequence's next query is never read by that sequence again. The
scheduler frees such blocks as the sequence advances (and at once after a prefix hit
longer than the window), so a sequence holds about w / B + its chunk's blocks, not its
whole context. The freed entries of its block table become the null block 0, which the
attention ops never read there (their key loops start inside the window). A model
mixing window and full layers frees per layer group instead (`hybrid_scheduler.py`).

Freed blocks that are prefix-trie nodes stay cached and matchable until evicted, like
any released block. A window sequence frees a path's parent before its children, so
the trie is no longer held prefix-closed (`PrefixPool.check_invariants(prefix_closed=
False)`): evicting a parent removes its subtree (held children merely leave the trie),
and cascade planning is off for such models (`LLMEngine._cascade_plan`).
"""

from __future__ import annotations

from jprefix.core.block_manager import NULL_BLOCK, BlockManager
from jprefix.core.sequence import Sequence


def release_outside_window(seq: Sequence, start: int, window: int,
                           block_manager: BlockManager) -> None:
    """Frees seq's blocks that hold no key of the window of its query at `start` and
    points their table entries at the null block. The table is replaced, not edited in
    place (the worker's `RequestRows.table` caches it by identity); its freed entries are
    always a leading run."""
    dead = (start - window + 1) // block_manager.block_size
    table = seq.block_table
    if dead <= 0 or table[dead - 1] == NULL_BLOCK:  # (nothing new out of the window)
        return
    first = dead - 1
    while first > 0 and table[first - 1] != NULL_BLOCK:
        first -= 1
    block_manager.free(table[first:dead])
    seq.block_table = [NULL_BLOCK] * dead + table[dead:]
