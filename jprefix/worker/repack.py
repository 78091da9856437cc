"""Steady decode packing (host side, no jax): a step of the same sequences as the last,
each decoding one token, advances the last step's packed buffers in place of packing
afresh (positions, lengths and slots move by one token; only grown block tables are
rewritten, by their new entries).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from operator import attrgetter, is_not
from typing import Any

import numpy as np

from jprefix.core.scheduler import is_decode_step
from jprefix.worker.flat_batch import PackedStep, flat_views
from jprefix.worker.pack import PackCache, RowsCache, bucket, scatter_runs


@dataclass
class DecodeStep:
    """A packed step whose rows each decoded one token: its sequences (in row order),
    cascade plan, their token lists, their block-table lists and those lists' lengths
    when packed (what the step's table rows hold), and its packed buffers."""

    seqs: tuple
    plan: Any
    token_lists: list[list[int]]
    table_lists: list[list[int]]
    table_lens: np.ndarray
    packed: PackedStep


def remember_decode(cache: PackCache, scheduled: Seq, plan: Any, packed: PackedStep
                    ) -> DecodeStep | None:
    """A freshly packed step, kept for `repack_decode` if it is a decode step."""
    n = len(scheduled)
    if not n or not is_decode_step([sc.num_new_tokens for sc in scheduled]):
        return None
    seqs = tuple(sc.seq for sc in scheduled)
    lens = np.fromiter(map(len, cache.tables.rows), np.int64, n)
    return DecodeStep(seqs, plan, [s.all_token_ids for s in seqs],
                      [s.block_table for s in seqs], lens, packed)


def _changed_tables(seqs: tuple, last: DecodeStep) -> tuple[list[int], list, np.ndarray]:
    """The rows whose block table changed since `last` was packed, every row's table
    list and its length, by C-level passes: a table list only grows until it is replaced
    (see `RequestRows.table`), so a row changed iff its list is another object
    or has another length (another object with the same blocks counts as unchanged:
    its row is the same)."""
    lists = list(map(attrgetter("block_table"), seqs))
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    changed = lens != last.table_lens
    if lists != last.table_lists:  # (== compares identities first: cheap when all are the same)
        changed |= np.fromiter(map(is_not, lists, last.table_lists), bool, len(lists))
    return np.flatnonzero(changed).tolist(), lists, lens


def repack_decode(scheduled: Seq, plan: Any, block_size: int, min_blocks: int,
                  cache: PackCache, last: DecodeStep | None,
                  pending_rows: Mapping[Any, int]) -> PackedStep | None:
    """The steady state of a decode batch, packed without a pass per row over the batch:
    when this step decodes one token of each of the same sequences, in the same order and
    under the same cascade plan (`plan.prefix_blocks`, or None), as the last packed step
    (`last`, which did the same), its buffers are the last step's advanced to the new
    positions, with only the block-table entries that changed rewritten. Equals `pack_step` (+
    `pack_cascade`) array for array (`min_blocks` is the tables' bucket floor); None when
    the step is not such a step, a changed table moves a table's width bucket, or a
    group's first member no longer holds the group's prefix (pack afresh then). A
    pending token's source row is `pending_rows[seq]`; `last` is updated in place."""
    n = len(scheduled)
    if (last is None or last.plan is not plan or n != len(last.seqs)
            or n != len(cache.tables.rows)):
        return None
    seqs, start_list, q_list, _ = zip(*scheduled, strict=True)
    if seqs != last.seqs or not is_decode_step(q_list):  # (tuple == compares identities)
        return None
    starts = np.array(start_list, np.int32)
    num_known = np.fromiter(map(len, last.token_lists), np.int64, n)
    if not (starts <= num_known).all():  # more than one pending token: pack_step raises
        return None
    flat = last.packed.flat.copy()
    a = flat_views(flat, last.packed.layout)
    if not _advance_tables(a, seqs, plan, min_blocks, cache, last):
        return None
    bt, pos = a["block_tables"], a["positions"]
    delta = starts - pos[:n]
    pos[:n] = starts
    a["kv_lens"][:n] = starts + 1
    a["counters"][:n] += delta
    a["slot_mapping"][:n] = (bt[np.arange(n), starts // block_size] * block_size
                             + starts % block_size)
    if plan is not None:
        a["suffix_kv_lens"][:n] += delta
    known = starts < num_known
    ids, src = a["token_ids"], a["token_src"]
    ids[:n] = 0
    known_rows = np.flatnonzero(known).tolist()
    if known_rows:  # (synchronous scheduling: the newest tokens are known)
        ids[known_rows] = [last.token_lists[i][start_list[i]] for i in known_rows]
    if len(known_rows) < n:  # (a known row's pending row, if any, is stale: masked)
        rows = np.fromiter(map(pending_rows.get, seqs, itertools.repeat(-1)), np.int32, n)
        src[:n] = np.where(known, -1, rows)
    else:
        src[:n] = -1
    packed = PackedStep(flat, last.packed.layout, a)
    last.packed = packed
    return packed


def _advance_tables(a: dict[str, np.ndarray], seqs: tuple, plan: Any, min_blocks: int,
                    cache: PackCache, last: DecodeStep) -> bool:
    """Brings the last step's block tables in `a` (and, under a cascade plan, its suffix
    tables) up to the rows' tables now, writing only their new entries; False (nothing
    written) when a width bucket moves or a group's first row lost the group's prefix.
    The rewritten rows' arrays in the `RowsCache`s become None (rewritten on the next
    fresh pack)."""
    changed, lists, lens = _changed_tables(seqs, last)
    if not changed:
        return True
    bt = a["block_tables"]
    if bucket(int(lens.max()), min_blocks) != bt.shape[1]:
        return False
    # entries of each changed row that are still right: all it had, if its list only grew
    old_lens = last.table_lens[changed]
    same = np.fromiter((lists[i] is last.table_lists[i] for i in changed), bool, len(changed))
    kept = np.where(same & (lens[changed] > old_lens), old_lens, 0).tolist()
    if plan is not None:
        skip = [plan.prefix_blocks[i] for i in changed]
        st = a["suffix_block_tables"]
        longest = int((lens - np.asarray(plan.prefix_blocks, np.int64)).max())
        if (bucket(longest, min_blocks) != st.shape[1]
                or not _groups_keep_prefixes(a["prefix_block_tables"], plan, lists, changed)):
            return False
        _extend_rows(st, changed, [lists[i] for i in changed], skip,
                     [max(k - p, 0) for k, p in zip(kept, skip, strict=True)])
        _forget_rows(cache.suffix_tables, changed, st)
    _extend_rows(bt, changed, [lists[i] for i in changed], [0] * len(changed), kept)
    _forget_rows(cache.tables, changed, bt)
    last.table_lists, last.table_lens = lists, lens
    return True


def _groups_keep_prefixes(prefix_tables: np.ndarray, plan: Any, lists: list,
                          changed: list[int]) -> bool:
    """Whether each group's first row (`pack_cascade`'s source of the group's prefix
    table), if its table changed, still starts with the group's prefix blocks."""
    firsts = itertools.accumulate(plan.group_sizes[:-1], initial=0)
    changed_rows = set(changed)
    for g, i in enumerate(firsts):
        p = plan.prefix_blocks[i]
        if i in changed_rows and lists[i][:p] != prefix_tables[g, :p].tolist():
            return False
    return True


def _extend_rows(table: np.ndarray, rows: list[int], lists: list, skip: list[int],
                 kept: list[int]) -> None:
    """Makes row rows[k] of `table` hold lists[k][skip[k]:] (left-aligned, zeros after)
    when its first kept[k] entries already do and the rest is zero if kept[k] > 0: the
    rows that keep nothing are zeroed, then the new entries go in by one scatter."""
    renewed = [r for r, k in zip(rows, kept, strict=True) if k == 0]
    if renewed:
        table[renewed] = 0
    tails = [lst[s + k :] for lst, s, k in zip(lists, skip, kept, strict=True)]
    lens = np.fromiter(map(len, tails), np.int64, len(tails))
    scatter_runs(table, np.asarray(rows), np.asarray(kept), lens,
                 list(itertools.chain.from_iterable(tails)))


def _forget_rows(cache: RowsCache, rows: list[int], table: np.ndarray) -> None:
    """`table` is the cache's table now, with `rows` rewritten from lists (no arrays)."""
    cached = list(cache.rows)
    for i in rows:
        cached[i] = None
    cache.rows, cache.table = cached, table
