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

import numpy as np

from jprefix.worker.pack import RowsCache, bucket, ragged_rows


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
    if any(sc.num_new_tokens != 1 for sc in scheduled):
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


def pack_cascade(scheduled: Seq, plan: CascadePlan, block_size: int, num_seqs_bucket: int,
                 min_blocks_bucket: int, cache: RowsCache | None = None
                 ) -> dict[str, np.ndarray]:
    """The cascade arrays for `scheduled`, already in `plan.order`: the groups' prefix
    block tables [G, Mp], lengths [G] and query-row ranges [G+1]; each sequence's suffix
    block table [S, Ms] (its blocks after the shared prefix) and suffix length [S].
    `cache` (kept between steps) lets the suffix tables reuse the last step's rows."""
    G = bucket(len(plan.group_sizes), 1)
    starts = np.cumsum([0] + plan.group_sizes)
    Mp = bucket(max(plan.prefix_blocks), min_blocks_bucket)
    prefix_tables = np.zeros((G, Mp), np.int32)
    prefix_lens = np.zeros(G, np.int32)
    prefix_cu = np.full(G + 1, starts[-1], np.int32)
    prefix_cu[: len(starts)] = starts
    for g, first in enumerate(starts[:-1]):
        p = plan.prefix_blocks[first]
        prefix_tables[g, :p] = scheduled[first].seq.block_table[:p]
        prefix_lens[g] = p * block_size
    rows = [(sc.seq.block_table_suffix(p), sc.start + 1 - p * block_size)
            for sc, p in zip(scheduled, plan.prefix_blocks, strict=True)]
    suffix_tables = ragged_rows([r[0] for r in rows], num_seqs_bucket, min_blocks_bucket,
                                cache)
    suffix_lens = np.zeros(num_seqs_bucket, np.int32)
    suffix_lens[: len(rows)] = [r[1] for r in rows]
    return dict(prefix_block_tables=prefix_tables, prefix_kv_lens=prefix_lens,
                prefix_cu_q_lens=prefix_cu, suffix_block_tables=suffix_tables,
                suffix_kv_lens=suffix_lens)
