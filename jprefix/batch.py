"""Packs one scheduled step into padded NumPy arrays (host side, no jax).

Shapes are rounded up to power-of-two buckets so the jitted step compiles once per
(T, S, M) bucket: T tokens, S sequences, M block-table width. Padding tokens write to
the reserved null block 0 and padding sequences have q_len = kv_len = 0.
"""

from __future__ import annotations

import itertools
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
    q_lens = np.fromiter((sc.num_new_tokens for sc in scheduled), np.int32, n)
    starts = np.fromiter((sc.start for sc in scheduled), np.int32, n)
    tables = [sc.seq.block_table for sc in scheduled]
    table_lens = np.fromiter(map(len, tables), np.int64, n)
    num_tokens = int(q_lens.sum())
    T = bucket(num_tokens, buckets.min_tokens)
    S = bucket(n, buckets.min_seqs)
    M = bucket(int(table_lens.max()), buckets.min_blocks)

    cu_q_lens = np.full(S + 1, num_tokens, np.int32)
    cu_q_lens[0] = 0
    cu_q_lens[1 : n + 1] = np.cumsum(q_lens)
    # Python touches each row once (its known token ids); the rest is whole-array numpy.
    ids: list[int] = []
    token_src = np.full(T, -1, np.int32)
    for sc in scheduled:
        end = sc.start + sc.num_new_tokens
        known = sc.seq.all_token_ids[sc.start : end]
        ids += known
        if len(known) < sc.num_new_tokens:  # only the newest token can be pending
            if len(known) != sc.num_new_tokens - 1:
                raise RuntimeError(f"{sc.seq!r}: more than one pending token scheduled")
            token_src[len(ids)] = sc.seq.pending_row
            ids.append(0)
    token_ids = np.zeros(T, np.int32)
    token_ids[:num_tokens] = ids
    positions = np.zeros(T, np.int32)
    positions[:num_tokens] = (np.arange(num_tokens, dtype=np.int32)
                              + np.repeat(starts - cu_q_lens[:n], q_lens))
    block_tables = np.zeros((S, M), np.int32)
    rows = np.repeat(np.arange(n), table_lens)
    cols = np.arange(len(rows)) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)
    block_tables[rows, cols] = np.fromiter(itertools.chain.from_iterable(tables), np.int32,
                                           len(rows))
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:n] = starts + q_lens

    seq_of_token = np.repeat(np.arange(len(scheduled)), q_lens)
    slot_mapping = np.zeros(T, np.int32)  # padding -> slot 0 of the null block
    slot_mapping[:num_tokens] = (
        block_tables[seq_of_token, positions[:num_tokens] // block_size] * block_size
        + positions[:num_tokens] % block_size
    )
    logits_idx = np.maximum(cu_q_lens[1:] - 1, 0).astype(np.int32)
    return dict(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        token_src=token_src,
        block_tables=block_tables,
        kv_lens=kv_lens,
        cu_q_lens=cu_q_lens,
        logits_idx=logits_idx,
        **_sampling_arrays(scheduled, S),
    )


def _sampling_arrays(scheduled: Seq, S: int) -> dict[str, np.ndarray]:
    n = len(scheduled)
    params = [sc.seq.sampling_params for sc in scheduled]

    def column(values, fill, dtype) -> np.ndarray:
        out = np.full(S, fill, dtype)
        out[:n] = np.fromiter(values, dtype, n)
        return out

    return dict(
        temperature=column((sp.temperature for sp in params), 0, np.float32),
        top_k=column((sp.top_k for sp in params), -1, np.int32),
        top_p=column((sp.top_p for sp in params), 1, np.float32),
        seeds=column((sc.seq.seed for sc in scheduled), 0, np.uint32),
        # index of the output token sampled from each row
        counters=column((sc.start + sc.num_new_tokens - len(sc.seq.prompt_token_ids)
                         for sc in scheduled), 0, np.int32),
    )


Layout = tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) per array


def flatten_batch(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, Layout]:
    """Packs the step's arrays into one int32 and one float32 buffer (two host-to-device
    transfers instead of one per array); `layout` (static, hashable) splits them again."""
    layout = tuple((k, v.shape, v.dtype.name) for k, v in batch.items())
    ints = [v.view(np.int32).ravel() for v in batch.values() if v.dtype != np.float32]
    floats = [v.ravel() for v in batch.values() if v.dtype == np.float32]
    return np.concatenate(ints), np.concatenate(floats), layout

