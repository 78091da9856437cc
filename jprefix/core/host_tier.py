"""The prefix cache's host tier, on PrefixPool's side (pure Python): what an eviction
keeps on the host, what a lookup brings back, and the copies the worker runs for them.

Write on eviction: a cached block that leaves HBM (its block reused, `PrefixPool._evict`)
is stored in the host pool with its subtree; blocks that never leave HBM cost no copy,
and a block on the host already is not written again (the tier is inclusive). A prompt
whose HBM match stops where the host pool continues gets fresh HBM blocks for that run;
their copies start with the step (`take_moves`: one batch a step) and land after some
later step, in order (`land_oldest`: the worker found the batch's host copy done and
queued its scatter after that step), so the sequence waits in the scheduler meanwhile
(`Scheduler._admit` returns -1 while `is_loading`) and the blocks join the trie at the
next schedule (`finish_loads`). With in-stream loads (`loads_land_in_step`: the worker
copies a step's loads before the step) the batch lands at once and the sequence runs in
that step. A sequence aborted or preempted in flight keeps its blocks out of the free
list until its batch lands (the scatter would write into their next owner). The
copied-back tokens count as cached and as host hits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from jprefix.core.host_pool import HostNode, HostPool
from jprefix.core.prefix_trie import PrefixNode


@dataclass
class KVMoves:
    """Copies between the tiers the scheduler decided this step (the worker runs them):
    saves (HBM block, host slot), loads (host slot, HBM block), the sequences whose loads
    start this step with the host nodes they read; then the batches in flight (a step's
    `loading`, oldest first), the landed ones not yet registered, and per sequence id in
    either the sequence (`is_loading`)."""

    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    loading: list[tuple[Any, list[HostNode]]] = field(default_factory=list)
    in_flight: deque = field(default_factory=deque)
    landed: list[tuple[Any, list[HostNode]]] = field(default_factory=list)
    busy: dict[int, Any] = field(default_factory=dict)
    orphans: dict[int, list[int]] = field(default_factory=dict)  # aborted: id -> blocks


class HostTierMixin:
    """PrefixPool's host-tier methods (it owns `host`, `moves`, `trie`, `block_manager`,
    `_prefixes` and `num_host_hit_tokens`)."""

    host: HostPool | None
    moves: KVMoves

    def _save(self, node: PrefixNode) -> None:
        """Keeps an evicted node's subtree on the host, deepest first (so parents are the
        more recently used there). Their K/V is final: full blocks never change, and the
        step that computed them was dispatched before any step that reuses them."""
        path, n = [], node
        while n.parent is not None:
            path.append(n.tokens)
            n = n.parent
        salt, path = self.trie.salt_of(n), path[::-1]
        stack, order = [(node, path)], []
        while stack:
            n, p = stack.pop()
            order.append((n, p))
            stack.extend((c, p + [c.tokens]) for c in n.children.values())
        for n, p in reversed(order):
            slot = self.host.store(salt, p)
            if slot is not None:
                self.moves.saves.append((n.block, slot))

    def acquire_from_host(self, seq: Any, max_blocks: int) -> int:
        """Continues seq's HBM match (its block_table) from the host tier: allocates HBM
        blocks for the host run, queues their copies (`moves.loads`) and holds the host
        slots until `finish_loads`; returns the blocks (0: none, or no room; -1: they
        would take the loads started this step past `host.step_load_tokens`, so the
        sequence should start next step). The blocks join the trie when their copy is
        done (`finish_loads`): until then the sequence waits in the scheduler (in-stream
        loads land in the step). The tokens count as host hits."""
        if self.host is None or (seq.num_prompt_logprobs is not None
                                 and seq.num_output_tokens == 0):  # (computes every position)
            return 0
        start = len(seq.block_table)
        nodes = self.host.match(seq.all_token_ids, start, max_blocks, seq.cache_salt)
        if not nodes or not self.block_manager.can_allocate(len(nodes)):
            return 0
        bound = self.host.step_load_tokens  # (the step's first load always starts)
        if bound and self.moves.loading and (self._tokens_of([self.moves.loading])
                                             + len(nodes) * self.block_size > bound):
            return -1
        self.host.incref(nodes)  # (the allocation may evict into the host tier)
        blocks = self.block_manager.allocate(len(nodes))
        seq.block_table.extend(blocks)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.moves.loads.extend((n.slot, b) for n, b in zip(nodes, blocks, strict=True))
        self.moves.loading.append((seq, nodes))
        self.moves.busy[id(seq)] = seq
        if seq.num_preemptions == 0:  # (a hit is counted once per request)
            self.num_host_hit_tokens += len(nodes) * self.block_size
        return len(nodes)

    def finish_loads(self) -> None:
        """Registers the blocks of the landed batches in the trie (their scatters are
        queued before the step about to be scheduled) and releases their host slots."""
        landed, self.moves.landed = self.moves.landed, []
        for seq, nodes in landed:
            self.host.decref(nodes)
            del self.moves.busy[id(seq)]
            if seq.block_table:  # (not aborted meanwhile)
                self.register_blocks(seq, seq.num_computed_tokens,
                                     seq.num_shareable_blocks(self.block_size))

    def take_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (block, slot) saves and (slot, block) loads, for the worker; saves
        must run before the step (it may overwrite their blocks), loads after it. A step
        with loads puts one batch in flight: the worker lands it (`land_oldest`)."""
        saves, loads = self.moves.saves, self.moves.loads
        self.moves.saves, self.moves.loads = [], []
        if loads:
            self.moves.in_flight.append(self.moves.loading)
            self.moves.loading = []
        return saves, loads

    def land_oldest(self) -> None:
        """The oldest batch in flight is copied and its scatter queued (after the step
        just dispatched): its sequences may run from the next schedule; blocks of
        sequences aborted meanwhile go back to the free list now."""
        batch = self.moves.in_flight.popleft()
        self.moves.landed.extend(batch)
        for seq, _ in batch:
            self.block_manager.free(self.moves.orphans.pop(id(seq), []))

    def loads_land_in_step(self) -> bool:
        """Whether a sequence may run in the step that copies its blocks back."""
        return self.host is not None and self.host.loads_in_step

    def is_loading(self, seq: Any) -> bool:
        """Whether seq's host-tier blocks are still being copied back."""
        return id(seq) in self.moves.busy

    def loads_pending(self) -> bool:
        return bool(self.moves.busy)

    def loading_tokens(self) -> int:
        """Tokens of the copies started this round or still in flight."""
        return self._tokens_of([self.moves.loading, *self.moves.in_flight])

    def _tokens_of(self, batches: list) -> int:
        """Tokens the batches of loads ((sequence, host nodes) pairs) bring back."""
        return sum(len(nodes) for b in batches for _, nodes in b) * self.block_size

    def release_finished(self, seq: Any, blocks: list[int]) -> list[int]:
        """The blocks of a finished (aborted) or preempted sequence to free now: none
        while its copy is in flight (they are freed when its batch lands)."""
        if id(seq) in self.moves.busy and not any(s is seq for s, _ in self.moves.landed):
            self.moves.orphans.setdefault(id(seq), []).extend(blocks)
            return []
        return blocks

    def release_loaded(self, waiting: Any) -> bool:
        """Frees the blocks waiting sequences hold after their host-tier copies (they are
        cached, so they match again); False if none does. Blocks of copies still in flight
        are kept: they are written after a later step."""
        busy = self.moves.busy
        held = [s for s in waiting if s.block_table and id(s) not in busy]
        for s in held:
            self.block_manager.free(s.reset_blocks())
        return bool(held)

    def _drop_host(self, prefix: Any, path: list[PrefixNode], needed: set) -> None:
        """delete_prefix on the host tier: the prefix's host path, from its first block no
        other registered prefix uses (the HBM rule), is dropped with its subtree."""
        if prefix is not None:
            salt, blocks = prefix.salt, [prefix.token_ids[i:i + self.block_size] for i in
                                         range(0, len(prefix.token_ids), self.block_size)]
        else:
            salt, blocks = self.trie.salt_of(path[0]), [n.tokens for n in path]
        keep = {tuple(p.token_ids[:(i + 1) * self.block_size]) for p in self._prefixes.values()
                if p.salt == salt for i in range(len(p.token_ids) // self.block_size)}
        for i in range(len(blocks)):
            if tuple(t for b in blocks[:i + 1] for t in b) not in keep:
                node = self.host.find(salt, blocks[:i + 1])
                if node is not None:
                    self.host.drop(node)
                return
