"""Packs one scheduled step into padded NumPy arrays (host side, no jax).

Shapes are rounded up to power-of-two buckets so the jitted step compiles once per
(T, S, M) bucket: T tokens, S sequences, M block-table width. Padding tokens write to
the reserved null block 0 and padding sequences have q_len = kv_len = 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from jprefix.worker.repack import DecodeStep


def bucket(n: int, minimum: int, step: int | None = None) -> int:
    """Smallest power of two >= max(n, minimum); past `step` (a power of two), the
    smallest multiple of `step` instead."""
    n = max(n, minimum)
    if step is not None and n > step:
        return -(-n // step) * step
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class BucketConfig:
    """Lower bounds of the shape buckets, and the token count past which token buckets
    grow linearly: a step of 4,099 prefill tokens computes 4,608 rows, not 8,192 (such a
    step is compute-bound, so the padding costs its full share of time; a new bucket
    costs one compilation)."""

    min_tokens: int = 16
    min_seqs: int = 8
    min_blocks: int = 4
    token_step: int | None = 512


def pack_step(scheduled: Seq, block_size: int, buckets: BucketConfig,
              cache: PackCache | None = None) -> dict[str, np.ndarray]:
    """Builds the step's input arrays from a list of ScheduledSeq.

    Returns token_ids/positions/slot_mapping/token_src [T], block_tables [S, M],
    kv_lens [S], cu_q_lens [S+1], logits_idx [S] and the sampling arrays [S]. A token
    still pending on the host (sampled by the step before, async scheduling) has
    `token_src` = its row in that step's device output (-1 for every known token).
    `cache` (kept by the caller between steps) lets a step like the last one (the same
    sequences in the same order, as in steady decoding) reuse its tables and constants.
    """
    n = len(scheduled)
    # The rows' columns by C-level transposition (ScheduledSeq is a tuple), one Python pass
    # for the known token ids; the rest is whole-array numpy.
    seqs, start_list, q_list, _ = (map(list, zip(*scheduled, strict=True)) if n
                                   else tuple([] for _ in range(4)))
    tables = [seq.block_table_array() for seq in seqs]
    ids: list[int] = []
    pending: list[tuple[int, int]] = []  # (flat token index, source row)
    for seq, start, q in zip(seqs, start_list, q_list, strict=True):
        tokens = seq.all_token_ids
        if q == 1 and start < len(tokens):  # (a decode of a known token)
            ids.append(tokens[start])
            continue
        known = tokens[start : start + q]
        ids += known
        if len(known) < q:  # only the newest token can be pending
            if len(known) != q - 1:
                raise RuntimeError(f"{seq!r}: more than one pending token scheduled")
            pending.append((len(ids), seq.pending_row))
            ids.append(0)
    q_lens = np.array(q_list, np.int32).reshape(n)
    starts = np.array(start_list, np.int32).reshape(n)
    consts = _sampling_constants(seqs, cache)
    num_tokens = len(ids)
    T = bucket(num_tokens, buckets.min_tokens, buckets.token_step)
    S = bucket(n, buckets.min_seqs)
    block_tables = ragged_rows(tables, S, buckets.min_blocks,
                               None if cache is None else cache.tables)

    cu_q_lens = np.full(S + 1, num_tokens, np.int32)
    cu_q_lens[0] = 0
    cu_q_lens[1 : n + 1] = np.cumsum(q_lens)
    token_ids = np.zeros(T, np.int32)
    token_ids[:num_tokens] = ids
    token_src = np.full(T, -1, np.int32)
    if pending:
        at, rows = zip(*pending, strict=True)
        token_src[list(at)] = rows
    positions = np.zeros(T, np.int32)
    positions[:num_tokens] = (np.arange(num_tokens, dtype=np.int32)
                              + np.repeat(starts - cu_q_lens[:n], q_lens))
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:n] = starts + q_lens

    seq_of_token = np.repeat(np.arange(n), q_lens)
    slot_mapping = np.zeros(T, np.int32)  # padding -> slot 0 of the null block
    slot_mapping[:num_tokens] = (
        block_tables[seq_of_token, positions[:num_tokens] // block_size] * block_size
        + positions[:num_tokens] % block_size
    )
    logits_idx = np.maximum(cu_q_lens[1:] - 1, 0).astype(np.int32)

    def column(values, fill, dtype) -> np.ndarray:
        out = np.full(S, fill, dtype)
        out[:n] = values.astype(dtype)
        return out

    return dict(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        token_src=token_src,
        block_tables=block_tables,
        kv_lens=kv_lens,
        cu_q_lens=cu_q_lens,
        logits_idx=logits_idx,
        temperature=column(consts[1], 0, np.float32),
        top_k=column(consts[2], -1, np.int32),
        top_p=column(consts[3], 1, np.float32),
        seeds=column(consts[4], 0, np.uint32),
        # index of the output token sampled from each row
        counters=column(starts + q_lens - consts[0], 0, np.int32),
    )


def _sampling_constants(seqs: list, cache: PackCache | None) -> np.ndarray:
    """float64 [5, n]: prompt length, temperature, top_k, top_p, seed of each row's
    sequence (exact for int32/uint32 values); the last step's when its sequences match."""
    if cache is not None and cache.constants is not None and cache.seqs == seqs:
        return cache.constants  # (list == compares the sequences by identity)
    rows = [(len(s.prompt_token_ids), s.sampling_params.temperature, s.sampling_params.top_k,
             s.sampling_params.top_p, s.seed) for s in seqs]
    consts = np.array(rows, np.float64).reshape(len(seqs), 5).T
    if cache is not None:
        cache.seqs, cache.constants = seqs, consts
    return consts


class RowsCache:
    """The last `[S, M]` table `ragged_rows` built and the arrays of its rows: the next
    table with the same shape updates only the rows whose array changed (an int32 block
    table array is replaced, never modified, when its list grows). A row is None after
    `repack_decode` rewrote it from its list."""

    def __init__(self):
        self.rows: list[np.ndarray | None] = []
        self.table: np.ndarray | None = None


def ragged_rows(rows: Seq[np.ndarray], num_rows: int, min_width: int,
                cache: RowsCache | None = None) -> np.ndarray:
    """int32 [num_rows, bucket(longest, min_width)] holding `rows` left-aligned, zeros
    (the null block) elsewhere: one concatenate and one scatter, no per-row copies; with
    `cache`, a copy of the last table with only the changed rows rewritten."""
    lens = np.fromiter(map(len, rows), np.int64, len(rows))
    width = bucket(int(lens.max()) if len(rows) else 0, min_width)
    last = None if cache is None else cache.table
    if (last is not None and last.shape == (num_rows, width)
            and len(cache.rows) == len(rows)):
        out = last.copy()
        for i, (row, old) in enumerate(zip(rows, cache.rows, strict=True)):
            if row is not old:
                out[i] = 0
                out[i, : len(row)] = row
    else:
        out = np.zeros((num_rows, width), np.int32)
        if len(rows):
            scatter_runs(out, np.arange(len(rows)), 0, lens, np.concatenate(rows))
    if cache is not None:
        cache.rows, cache.table = list(rows), out
    return out


def scatter_runs(out: np.ndarray, rows: np.ndarray, cols: Any, lens: np.ndarray,
                 values: Any) -> None:
    """out[rows[k], cols[k] : cols[k] + lens[k]] = the next lens[k] of `values`, for
    every k, in one scatter (`cols` an array, or one int for all)."""
    r = np.repeat(rows, lens)
    c = np.arange(len(r)) - np.repeat(np.cumsum(lens) - lens - cols, lens)
    out[r, c] = values


class PackCache:
    """What consecutive steps' packing can reuse (a runner keeps one): the block-table
    matrices (`RowsCache`, the step's and the cascade's suffix tables), the per-row
    sampling constants of the last step's sequence list, and the last step's packed
    buffers when it decoded one token per row (`repack_decode` advances them)."""

    def __init__(self):
        self.tables, self.suffix_tables = RowsCache(), RowsCache()
        self.seqs: list = []
        self.constants: np.ndarray | None = None
        self.decode: DecodeStep | None = None


Layout = tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) per array
# dtype.name costs ~2.4 us per call on the dev CPU (numpy builds the string), 13 times per
# packed step; a dict lookup 0.06 us
_DTYPE_NAMES = {np.dtype(t): np.dtype(t).name for t in (np.int32, np.uint32, np.float32)}


def flatten_batch(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, Layout]:
    """Packs the step's arrays into one int32 buffer (one host-to-device transfer, not one
    per array: each costs ~50 us of host time on the H200 machine), float32 arrays as
    their bit patterns after the integer ones; `layout` (static, hashable) splits it
    again (`layout_spans`)."""
    layout = tuple((k, v.shape, _DTYPE_NAMES.get(v.dtype) or _four_byte_name(k, v))
                   for k, v in batch.items())
    ints = [v.view(np.int32).ravel() for v in batch.values() if v.dtype != np.float32]
    floats = [v.view(np.int32).ravel() for v in batch.values() if v.dtype == np.float32]
    return np.concatenate(ints + floats), layout


def _four_byte_name(name: str, value: np.ndarray) -> str:
    """The dtype name of an array the int32 buffer can carry (its offsets count 4-byte
    elements)."""
    if value.dtype.itemsize != 4:
        raise TypeError(f"step array {name!r} is {value.dtype}: the flat buffer takes "
                        f"4-byte dtypes only")
    return value.dtype.name


class PackedStep(NamedTuple):
    """A packed step: the flat buffer the device receives, its layout, and the step's
    arrays by name (views into the buffer, or the arrays it was built from)."""

    flat: np.ndarray
    layout: Layout
    arrays: dict[str, np.ndarray]


def pack_flat(batch: dict[str, np.ndarray]) -> PackedStep:
    return PackedStep(*flatten_batch(batch), batch)


@functools.lru_cache(maxsize=256)  # (a steady decode step asks for the same layout)
def layout_spans(layout: Layout) -> tuple[tuple[str, tuple[int, ...], str, int, int], ...]:
    """Where `flatten_batch` put each array: (name, shape, dtype, start, size), in layout
    order; the float32 arrays start after all the others."""
    sizes = [(name, shape, dtype, math.prod(shape)) for name, shape, dtype in layout]
    offsets = {False: 0,
               True: sum(size for _, _, dtype, size in sizes if dtype != "float32")}
    spans = []
    for name, shape, dtype, size in sizes:
        is_float = dtype == "float32"
        spans.append((name, shape, dtype, offsets[is_float], size))
        offsets[is_float] += size
    return tuple(spans)


def flat_views(flat: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """The arrays of a `flatten_batch` result as views into its buffer."""
    views = {}
    for name, shape, dtype, start, stop in _view_spans(layout):
        view = flat[start:stop] if dtype is None else flat[start:stop].view(dtype)
        views[name] = view if shape is None else view.reshape(shape)
    return views


@functools.lru_cache(maxsize=256)
def _view_spans(layout: Layout) -> tuple[tuple[str, Any, Any, int, int], ...]:
    """`layout_spans` for `flat_views`: (name, shape or None for 1-D, np.dtype or None
    for int32, start, stop). A view by dtype name costs ~1 us (numpy parses the name),
    a reshape ~0.3 us, and a steady decode step takes ~18 views."""
    return tuple((name, shape if len(shape) != 1 else None,
                  None if dtype == "int32" else np.dtype(dtype), start, start + size)
                 for name, shape, dtype, start, size in layout_spans(layout))
