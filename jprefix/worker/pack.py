"""Packs one scheduled step into padded NumPy arrays (no jax): the step's arrays and a
cascade plan's arrays. `jprefix.worker.input_batch.StepPacker` is the one caller.

Shapes are rounded up to power-of-two buckets so the jitted step compiles once per
(T, S, M) bucket: T tokens, S sequences, M block-table width. Padding tokens write to
the reserved null block 0 and padding sequences have q_len = kv_len = 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np

from jprefix.core.cascade import CascadePlan
from jprefix.worker.request_rows import RequestRows


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
    # A step of one sequence and one token (one stream decoding) packs into T = 2, S = 1
    # instead of the minimums: on the CPU a matmul of 2 rows takes about 0.55x the time
    # of 16 (XLA:CPU's matmuls of one row run a little faster still, but compile as
    # separate kernels: seconds more per compiled step). Costs one more compiled shape.
    # One sequence of up to `single_stream_tokens` tokens (a speculative verify row, a
    # short prefill chunk) packs into S = 1 and the power of two >= its tokens: a verify
    # of 4 proposals is not padded to 16 tokens and 8 rows of logits.
    single_stream: bool = False
    single_stream_tokens: int = 8


def pack_step(scheduled: Seq, block_size: int, buckets: BucketConfig,
              cache: PackCache | None = None, pending_rows: Mapping[Any, int] | None = None
              ) -> dict[str, np.ndarray]:
    """Builds the step's input arrays from a list of ScheduledSeq.

    Returns token_ids/positions/slot_mapping/token_src [T], block_tables [S, M],
    kv_lens [S], cu_q_lens [S+1], logits_idx [S] and the sampling arrays [S]. A token
    still pending on the host (sampled by the step before, async scheduling) has
    `token_src` = its sequence's row in that step's device output, `pending_rows[seq]`
    (-1 for every known token).
    `cache` (kept by the caller between steps) lets a step like the last one (the same
    sequences in the same order, as in steady decoding) reuse its tables and constants.
    """
    n = len(scheduled)
    rows = cache.rows if cache is not None else RequestRows()
    # The rows' columns by C-level transposition (ScheduledSeq is a tuple), one Python pass
    # for the known token ids; the rest is whole-array numpy.
    seqs, start_list, q_list, _ = (map(list, zip(*scheduled, strict=True)) if n
                                   else tuple([] for _ in range(4)))
    tables = [rows.table(seq) for seq in seqs]
    ids: list[int] = []
    pending: list[tuple[int, int]] = []  # (flat token index, source row)
    for seq, start, q in zip(seqs, start_list, q_list, strict=True):
        tokens = seq.all_token_ids
        if q == 1 and start < len(tokens):  # (a decode of a known token)
            ids.append(tokens[start])
            continue
        if seq.spec_token_ids:  # a verify row: its newest token, then its proposals
            ids += tokens[start : start + 1] + seq.spec_token_ids
            continue
        known = tokens[start : start + q]
        ids += known
        if len(known) < q:  # only the newest token can be pending
            if len(known) != q - 1:
                raise RuntimeError(f"{seq!r}: more than one pending token scheduled")
            if pending_rows is None or seq not in pending_rows:
                raise RuntimeError(f"{seq!r}: no output row holds its pending token")
            pending.append((len(ids), pending_rows[seq]))
            ids.append(0)
    q_lens = np.array(q_list, np.int32).reshape(n)
    starts = np.array(start_list, np.int32).reshape(n)
    consts = _sampling_constants(seqs, cache)
    num_tokens = len(ids)
    T = bucket(num_tokens, buckets.min_tokens, buckets.token_step)
    S = bucket(n, buckets.min_seqs)
    if buckets.single_stream and n == 1 and num_tokens <= buckets.single_stream_tokens:
        T, S = bucket(num_tokens, 2), 1
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
    """What consecutive steps' packing can reuse (the packer keeps one): the block-table
    matrices (`RowsCache`, the step's and the cascade's suffix tables), the per-request
    arrays (`RequestRows`) and the per-row sampling constants of the last step's
    sequence list."""

    def __init__(self):
        self.tables, self.suffix_tables = RowsCache(), RowsCache()
        self.rows = RequestRows()  # per request: its table's array, penalty arrays
        self.seqs: list = []
        self.constants: np.ndarray | None = None


def pack_cascade(scheduled: Seq, plan: CascadePlan, block_size: int, num_seqs_bucket: int,
                 min_blocks_bucket: int, cache: PackCache | None = None
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
    arrays = cache.rows if cache is not None else RequestRows()
    rows = [(arrays.suffix(sc.seq, p), sc.start + 1 - p * block_size)
            for sc, p in zip(scheduled, plan.prefix_blocks, strict=True)]
    suffix_tables = ragged_rows([r[0] for r in rows], num_seqs_bucket, min_blocks_bucket,
                                None if cache is None else cache.suffix_tables)
    suffix_lens = np.zeros(num_seqs_bucket, np.int32)
    suffix_lens[: len(rows)] = [r[1] for r in rows]
    return dict(prefix_block_tables=prefix_tables, prefix_kv_lens=prefix_lens,
                prefix_cu_q_lens=prefix_cu, suffix_block_tables=suffix_tables,
                suffix_kv_lens=suffix_lens)
