"""Cascade (shared-prefix) decode planning, host side (no jax).

In a decode step, sequences that hold the same cached prefix blocks form a group: the
step attends the group's queries to the prefix once (one pass over its K/V for the whole
group) and each sequence to its own suffix, then merges the two by log-sum-exp.

Sharing is prefix-closed (a block is shared only through the prefix trie, and a held trie
node implies its parent is held), so a sequence's shared blocks are a leading run of its
block table: the blocks whose ref count is >= 2. The last shared block identifies the
group, since a physical block sits at one depth of one trie path.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from jprefix.core.scheduler import ScheduledSeq, is_decode_step


@dataclass(frozen=True)
class CascadePlan:
    """A decode step's grouping: `order` lists scheduled indices with each group's members
    contiguous and first; `prefix_blocks[k]` is the shared block count of `order[k]`."""

    order: list[int]
    prefix_blocks: list[int]
    group_sizes: list[int]


def shared_blocks(block_table: list[int], limit: int, ref_count: Callable[[int], int]) -> int:
    """Length of the leading run of blocks with ref count >= 2, at most `limit`
    (binary search: the run is prefix-closed). Only prefix-trie blocks are ever shared,
    so callers pass `limit` <= the sequence's registered blocks; the common answer, all
    of them, costs one lookup."""
    lo, hi = 0, min(limit, len(block_table))
    if hi and ref_count(block_table[hi - 1]) >= 2:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ref_count(block_table[mid - 1]) >= 2:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_cascade(
    scheduled: Seq,
    block_size: int,
    ref_count: Callable[[int], int],
    min_group: int = 8,
    min_blocks: int = 4,
) -> CascadePlan | None:
    """Groups a decode step's sequences by shared prefix; None when no group of at least
    `min_group` sequences shares at least `min_blocks` blocks (the plain kernel then)."""
    if not is_decode_step([sc.num_new_tokens for sc in scheduled]):
        return None
    by_last: dict[int, list[tuple[int, int]]] = {}
    for i, sc in enumerate(scheduled):
        # registered blocks wholly before the query's own position sc.start
        seq = sc.seq
        p = shared_blocks(seq.block_table, min(sc.start // block_size,
                                               seq.num_registered_blocks), ref_count)
        if p >= min_blocks:
            by_last.setdefault(sc.seq.block_table[p - 1], []).append((i, p))
    groups = [members for members in by_last.values() if len(members) >= min_group]
    if not groups:
        return None
    order, prefix_blocks = [], []
    for members in groups:
        order += [i for i, _ in members]
        prefix_blocks += [p for _, p in members]
    grouped = set(order)
    rest = [i for i in range(len(scheduled)) if i not in grouped]
    return CascadePlan(order + rest, prefix_blocks + [0] * len(rest),
                       [len(m) for m in groups])


class CascadePlanner:
    """Plans each step's cascade grouping (`plan_cascade`), reusing the last plan for a
    decode step of the same sequences in the same order.

    Reuse is sound: a sequence's block table is replaced only when it is preempted or
    finishes, which takes it out of the running list; otherwise the table only grows, so
    each member still holds its group's prefix blocks. Sharing changes only when sequences
    join or leave, which changes the list, so a reused plan is as good as a new one.
    """

    def __init__(self, block_size: int, ref_count: Callable[[int], int], min_group: int = 8,
                 min_blocks: int = 4):
        self.block_size, self.ref_count = block_size, ref_count
        self.min_group, self.min_blocks = min_group, min_blocks
        # (the planned step's sequences in scheduled order, its plan) or None
        self.last: tuple[tuple, CascadePlan] | None = None

    def plan(self, scheduled: Seq[ScheduledSeq]) -> CascadePlan | None:
        """The step's plan; None when no group pays off (or the step does not decode)."""
        seqs, _, num_new, _ = zip(*scheduled, strict=True)  # (C-level columns)
        last = self.last
        if (last is not None and last[0] == seqs  # (Sequence has identity equality)
                and is_decode_step(num_new)):
            return last[1]
        plan = plan_cascade(scheduled, self.block_size, self.ref_count, self.min_group,
                            self.min_blocks)
        self.last = None if plan is None else (seqs, plan)
        return plan

    def forget(self) -> None:
        """Drops the last plan, so that it holds no finished sequence."""
        self.last = None
