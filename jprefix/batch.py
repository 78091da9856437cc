"""Packs one scheduled step into padded NumPy arrays (host side, no jax).

Shapes are rounded up to power-of-two buckets so the jitted step compiles once per
(T, S, M) bucket: T tokens, S sequences, M block-table width. Padding tokens write to
the reserved null block 0 and padding sequences have q_len = kv_len = 0.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np


def bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class BucketConfig:
    """Lower bounds of the shape buckets."""

    min_tokens: int = 16
    min_seqs: int = 8
    min_blocks: int = 4


def pack_step(scheduled: Seq, block_size: int, buckets: BucketConfig) -> dict[str, np.ndarray]:
    """Builds the step's input arrays from a list of ScheduledSeq.

    Returns token_ids/positions/slot_mapping/token_src [T], block_tables [S, M],
    kv_lens [S], cu_q_lens [S+1], logits_idx [S] and the sampling arrays [S]. A token
    still pending on the host (sampled by the step before, async scheduling) has
    `token_src` = its row in that step's device output (-1 for every known token).
    """
    n = len(scheduled)
    # One Python pass over the rows (their known token ids and scalars); the rest is
    # whole-array numpy.
    ids: list[int] = []
    pending: list[tuple[int, int]] = []  # (flat token index, source row)
    tables, scalars = [], []
    for sc in scheduled:
        seq, q, start = sc.seq, sc.num_new_tokens, sc.start
        known = seq.all_token_ids[start : start + q]
        ids += known
        if len(known) < q:  # only the newest token can be pending
            if len(known) != q - 1:
                raise RuntimeError(f"{seq!r}: more than one pending token scheduled")
            pending.append((len(ids), seq.pending_row))
            ids.append(0)
        tables.append(seq.block_table_array())
        sp = seq.sampling_params
        scalars.append((q, start, len(seq.prompt_token_ids), sp.temperature, sp.top_k,
                        sp.top_p, seq.seed))
    cols = np.array(scalars, np.float64).reshape(n, 7).T  # exact for int32/uint32 values
    q_lens, starts = cols[0].astype(np.int32), cols[1].astype(np.int32)
    num_tokens = len(ids)
    T = bucket(num_tokens, buckets.min_tokens)
    S = bucket(n, buckets.min_seqs)
    block_tables = ragged_rows(tables, S, buckets.min_blocks)

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
        temperature=column(cols[3], 0, np.float32),
        top_k=column(cols[4], -1, np.int32),
        top_p=column(cols[5], 1, np.float32),
        seeds=column(cols[6], 0, np.uint32),
        # index of the output token sampled from each row
        counters=column(cols[1] + cols[0] - cols[2], 0, np.int32),
    )


def ragged_rows(rows: Seq[np.ndarray], num_rows: int, min_width: int) -> np.ndarray:
    """int32 [num_rows, bucket(longest, min_width)] holding `rows` left-aligned, zeros
    (the null block) elsewhere: one concatenate and one scatter, no per-row copies."""
    lens = np.fromiter(map(len, rows), np.int64, len(rows))
    width = bucket(int(lens.max()) if len(rows) else 0, min_width)
    out = np.zeros((num_rows, width), np.int32)
    if len(rows):
        r = np.repeat(np.arange(len(rows)), lens)
        c = np.arange(len(r)) - np.repeat(np.cumsum(lens) - lens, lens)
        out[r, c] = np.concatenate(rows)
    return out


Layout = tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) per array


def flatten_batch(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, Layout]:
    """Packs the step's arrays into one int32 and one float32 buffer (two host-to-device
    transfers instead of one per array); `layout` (static, hashable) splits them again."""
    layout = tuple((k, v.shape, v.dtype.name) for k, v in batch.items())
    ints = [v.view(np.int32).ravel() for v in batch.values() if v.dtype != np.float32]
    floats = [v.ravel() for v in batch.values() if v.dtype == np.float32]
    return np.concatenate(ints), np.concatenate(floats), layout

