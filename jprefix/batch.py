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
    q_lens = np.fromiter((sc.num_new_tokens for sc in scheduled), np.int32, len(scheduled))
    num_tokens = int(q_lens.sum())
    T = bucket(num_tokens, buckets.min_tokens)
    S = bucket(len(scheduled), buckets.min_seqs)
    M = bucket(max(len(sc.seq.block_table) for sc in scheduled), buckets.min_blocks)

    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    block_tables = np.zeros((S, M), np.int32)
    kv_lens = np.zeros(S, np.int32)
    cu_q_lens = np.full(S + 1, num_tokens, np.int32)
    cu_q_lens[0] = 0
    cu_q_lens[1 : len(scheduled) + 1] = np.cumsum(q_lens)
    token_src = np.full(T, -1, np.int32)
    for i, sc in enumerate(scheduled):
        lo, hi = cu_q_lens[i], cu_q_lens[i + 1]
        end = sc.start + sc.num_new_tokens
        known = sc.seq.all_token_ids[sc.start : end]
        token_ids[lo : lo + len(known)] = known
        if len(known) < hi - lo:  # only the newest token can be pending
            if len(known) != hi - lo - 1:
                raise RuntimeError(f"{sc.seq!r}: more than one pending token scheduled")
            token_src[hi - 1] = sc.seq.pending_row
        positions[lo:hi] = np.arange(sc.start, end, dtype=np.int32)
        block_tables[i, : len(sc.seq.block_table)] = sc.seq.block_table
        kv_lens[i] = end

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
    temperature = np.zeros(S, np.float32)
    top_k = np.full(S, -1, np.int32)
    top_p = np.ones(S, np.float32)
    seeds = np.zeros(S, np.uint32)
    counters = np.zeros(S, np.int32)
    for i, sc in enumerate(scheduled):
        sp = sc.seq.sampling_params
        temperature[i] = sp.temperature
        top_k[i] = sp.top_k
        top_p[i] = sp.top_p
        seeds[i] = sc.seq.seed
        # index of the output token sampled from this row
        counters[i] = sc.start + sc.num_new_tokens - len(sc.seq.prompt_token_ids)
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, counters=counters)


Layout = tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) per array


def flatten_batch(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, Layout]:
    """Packs the step's arrays into one int32 and one float32 buffer (two host-to-device
    transfers instead of one per array); `layout` (static, hashable) splits them again."""
    layout = tuple((k, v.shape, v.dtype.name) for k, v in batch.items())
    ints = [v.view(np.int32).ravel() for v in batch.values() if v.dtype != np.float32]
    floats = [v.ravel() for v in batch.values() if v.dtype == np.float32]
    return np.concatenate(ints), np.concatenate(floats), layout

