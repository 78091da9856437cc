"""Shared cases and checks for the attention-op tests (paged, cascade, ALiBi, sliding
window, fp8 cache): random ragged batches over a paged cache, the dense float64
attention they are checked against, and the output check every kernel test makes.

Interpret mode (CPU) starts every output buffer as NaN, so "no NaN" in `check_output`
proves every row was written; padding rows must be exact zeros.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8 import FP8_DTYPES, dequantize_rows, quantize_rows

INTERPRET = jax.default_backend() == "cpu"
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}  # relative L2 error vs the reference
MIXED = [(1, 37), (7, 7), (0, 0), (12, 30), (1, 1), (5, 40)]


def make_batch(rng, seqs, *, heads=4, kv_heads=2, head_dim=64, block_size=8, layers=2,
               extra_rows=3, extra_blocks=3, dtype=jnp.float32):
    """Random ragged batch. seqs: (q_len, kv_len) per sequence ((0, 0) = padding seq)."""
    blocks_per_seq = [-(-kv // block_size) for _, kv in seqs]
    num_blocks = 1 + sum(blocks_per_seq) + extra_blocks
    max_blocks = max(blocks_per_seq) + 1
    physical = rng.permutation(np.arange(1, num_blocks))  # shuffled, block 0 = null
    tables = np.zeros((len(seqs), max_blocks), np.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = physical[used:used + n]
        used += n
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    t = int(cu[-1]) + extra_rows
    shape = (layers, kv_heads, num_blocks, block_size, head_dim)
    return dict(
        q=jnp.asarray(rng.standard_normal((t, heads, head_dim)), dtype),
        k_cache=jnp.asarray(rng.standard_normal(shape), dtype),
        v_cache=jnp.asarray(rng.standard_normal(shape), dtype),
        layer=jnp.int32(layers - 1),
        block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32),
        cu_q_lens=jnp.asarray(cu),
    )


def random_ragged_seqs(rng):
    """7 sequences of 1-59 keys, each with 1..kv_len query rows, and a padding sequence."""
    return [(int(rng.integers(1, k + 1)), int(k)) for k in rng.integers(1, 60, 7)] + [(0, 0)]


def mixed_step_seqs(rng, num_decode):
    """num_decode decodes (first), then 6 - num_decode prefill chunks, some cached."""
    seqs = [(1, int(k)) for k in rng.integers(1, 50, num_decode)]
    for _ in range(6 - num_decode):
        q = int(rng.integers(2, 20))
        seqs.append((q, q + int(rng.integers(0, 30))))
    return seqs


def dense_attention(batch, scale, *, causal=True, soft_cap=None, slopes=None, window=None):
    """Independent check (float64): out [T, H, D] and lse [T, H]. Causal: row i of
    sequence s sits at q_pos = kv_len - q_len + i and sees the keys in
    (q_pos - window, q_pos] (all of [0, q_pos] without a window); not causal: every row
    sits at kv_len and sees all kv_len keys. Scores are capped (soft_cap * tanh(x /
    soft_cap)), then biased by ALiBi's slope_h * (k_pos - q_pos). Rows seeing no key:
    0 and -inf."""
    q = np.asarray(batch["q"], np.float64)
    kc = np.asarray(batch["k_cache"], np.float64)[int(batch["layer"])]
    vc = np.asarray(batch["v_cache"], np.float64)[int(batch["layer"])]
    cu, kv_lens = np.asarray(batch["cu_q_lens"]), np.asarray(batch["kv_lens"])
    out, lse = np.zeros_like(q), np.full(q.shape[:2], -np.inf)
    group = q.shape[1] // kc.shape[0]
    for s, kv_len in enumerate(kv_lens):
        pages = np.asarray(batch["block_tables"])[s]
        keys = np.repeat(kc[:, pages].reshape(kc.shape[0], -1, kc.shape[-1]), group, 0)
        vals = np.repeat(vc[:, pages].reshape(vc.shape[0], -1, vc.shape[-1]), group, 0)
        q_len = cu[s + 1] - cu[s]
        for i, t in enumerate(range(cu[s], cu[s + 1])):
            q_pos = kv_len - q_len + i if causal else kv_len
            hi = q_pos + 1 if causal else kv_len
            lo = 0 if window is None else max(0, q_pos - window + 1)
            if hi <= lo:
                continue
            x = np.einsum("hd,hjd->hj", q[t], keys[:, lo:hi]) * scale
            if soft_cap is not None:
                x = soft_cap * np.tanh(x / soft_cap)
            if slopes is not None:
                x = x + np.asarray(slopes, np.float64)[:, None] * (np.arange(lo, hi) - q_pos)
            lse[t] = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
            out[t] = np.einsum("hj,hjd->hd", np.exp(x - lse[t][:, None]), vals[:, lo:hi])
    return out, lse


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def check_output(out, want, batch, *, unwritten="some output rows were never written"):
    """out == want on the real rows (within TOL of the batch's dtype), with the batch's
    shape and dtype; every row written (no NaN: `unwritten` says what a NaN means),
    padding rows zeros. Returns out as float32 numpy."""
    dtype = batch["q"].dtype
    assert out.shape == batch["q"].shape and out.dtype == dtype
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any(), unwritten
    n = int(batch["cu_q_lens"][-1])
    assert np.all(out[n:] == 0.0), "padding rows must be zeros"
    assert rel_err(out[:n], want[:n]) < TOL[dtype.type]
    return out


def quantize_batch(batch, fp8=FP8_DTYPES[0]):
    """The batch with its caches quantised (fp8, e4m3 by default, + scales), and the
    batch with those caches dequantised and q in float32 (the tight reference's input)."""
    k8, ks = quantize_rows(batch["k_cache"], fp8)
    v8, vs = quantize_rows(batch["v_cache"], fp8)
    fp8_batch = dict(batch, k_cache=k8, v_cache=v8, k_scale=ks, v_scale=vs)
    deq = dict(batch, q=batch["q"].astype(jnp.float32), k_cache=dequantize_rows(k8, ks),
               v_cache=dequantize_rows(v8, vs))
    return fp8_batch, deq


# Group sizes 1, 3, 8 with 1-3 prefix blocks; suffixes from 1 token to over one block
# (block size 8 here); a keyless group (prefix 0) makes a gap; loners before and after.
GROUPS = [(2, [1]), (1, [3, 8, 9]), (0, [5]), (3, [1, 2, 7, 8, 9, 16, 17, 20])]
LONERS = [12, 1, 30]


def make_cascade_batch(rng, groups, loners, *, lead=1, q_len=1, block_size=8, heads=4,
                       kv_heads=2, dtype=jnp.float32):
    """groups: (prefix blocks, [suffix kv_len per member]); loners: kv_lens in no group.

    Rows: `lead` loners, the groups' members, the other loners, a padding sequence, 3
    padding rows. Each sequence's last min(q_len, suffix) tokens are its queries.
    Returns (full-table batch for paged_attention, cascade keyword arguments).
    """
    seqs = ([(None, kv) for kv in loners[:lead]]
            + [(g, kv) for g, (_, kvs) in enumerate(groups) for kv in kvs]
            + [(None, kv) for kv in loners[lead:]] + [(None, 0)])
    prefix_lens = [0 if g is None else groups[g][0] * block_size for g, _ in seqs]
    batch = make_batch(rng, [(min(q_len, kv), p + kv) for p, (_, kv) in
                             zip(prefix_lens, seqs, strict=True)],
                       heads=heads, kv_heads=kv_heads, head_dim=32, block_size=block_size,
                       dtype=dtype)
    tables = np.asarray(batch["block_tables"]).copy()
    prefix_tables = np.zeros((len(groups), max(p for p, _ in groups) + 1), np.int32)
    for s, (g, _) in enumerate(seqs):  # members share their group's first member's prefix
        if g is not None:
            n = groups[g][0]
            if not prefix_tables[g].any():
                prefix_tables[g, :n] = tables[s, :n]
            tables[s, :n] = prefix_tables[g, :n]
    batch["block_tables"] = jnp.asarray(tables)
    suffix = np.zeros_like(tables)
    for s, p in enumerate(prefix_lens):
        suffix[s, :tables.shape[1] - p // block_size] = tables[s, p // block_size:]
    cu = np.asarray(batch["cu_q_lens"])
    rows = [sum(min(q_len, kv) for g2, kv in seqs if g2 == g) for g in range(len(groups))]
    cascade = dict(
        q=batch["q"], k_cache=batch["k_cache"], v_cache=batch["v_cache"],
        layer=batch["layer"], prefix_block_tables=jnp.asarray(prefix_tables),
        prefix_kv_lens=jnp.asarray([p * block_size for p, _ in groups], jnp.int32),
        prefix_cu_q_lens=jnp.asarray(cu[lead] + np.cumsum([0] + rows), jnp.int32),
        suffix_block_tables=jnp.asarray(suffix),
        suffix_kv_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32),
        cu_q_lens=batch["cu_q_lens"])
    return batch, cascade
