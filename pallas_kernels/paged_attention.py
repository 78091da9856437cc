"""Paged attention over a ragged batch: decode, prefill, prefix-cached and chunked prefill.

Sequence s owns query rows `cu_q_lens[s]:cu_q_lens[s+1]` (q_len = their difference);
query row i of s sits at position `kv_lens[s] - q_len + i` and attends to the cache
positions `<=` it, found through `block_tables[s]`. Padding sequences have q_len 0 and
kv_len 0; rows at or beyond `cu_q_lens[S]` are padding and come out as zeros.

With `causal=False` every query row of s attends to all `kv_lens[s]` keys (no position
mask; cascade attention's shared-prefix part). With `return_lse=True` the op and its
reference also return each row's log-sum-exp of its logits over the keys it attends
(natural log, float32 [T, H]; -inf for rows that attend to no key), so that partial
attentions over disjoint key sets can be merged (`cascade_attention.merge_attention`).

With `alibi_slopes` ([H] float32, `alibi.py`) the logit of query head h at q_pos against
the key at k_pos gains `slope_h * (k_pos - q_pos)`, after the scale and the soft cap,
before the mask. q_pos is the row's position above; with `causal=False` every row of s
is taken to sit at q_pos = kv_lens[s], just after its keys (a per-row constant: the
output is the same for any q_pos, only the lse moves by `slope_h * (kv_len - q_pos)`,
which cascade attention adds back for the row's true position). None: no bias, and the
op is the same program as without the argument.

With `sliding_window` w (an int32 scalar >= 1, traced or a Python int: the same
program serves every window; None: no window, and no code for it) a row at q_pos sees
only the keys at positions k with q_pos - w < k <= q_pos: w keys, itself included
(transformers' `kv_idx > q_idx - sliding_window`, vLLM's flash-attention window
(w - 1, 0)). The kernel starts its key loop at the first step holding a key of the
window, so pages wholly older than it are never read (a block table may hold the null
block 0 there); the reference masks them. A window needs `causal=True` (ValueError).

With an fp8 cache (`fp8.py`) `k_scale` and `v_scale` ([L, K, N, B] float32, one scale
per cached row) come with it: every op here reads the cache as `cache * scale`; the
kernel dequantises inside (fp8 tiles and their scales loaded, converted in registers),
the reference after its gather. q is then any of bf16/f16/f32.

`paged_attention` runs the Pallas kernel (`paged_attention_kernel.py`) tuned by
`BlockSizes`; `paged_attention_reference` is the same function in plain jnp (the check,
and the XLA path). Cache layout: `common.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.alibi import check_slopes
from pallas_kernels.common import (
    INT32,
    check_caches,
    check_float_dtypes,
    check_window,
    is_pow2,
    masked_softmax,
)
from pallas_kernels.fp8 import check_fp8_cache
from pallas_kernels.paged_attention_kernel import run_kernel
from pallas_kernels.paged_attention_tiling import (
    BlockSizes,
    kernel_config,
    resolve_block_sizes,
    tile_metadata,
)


def _check_inputs(q, k_cache, v_cache, layer, block_tables, kv_lens, cu_q_lens,
                  k_scale=None, v_scale=None):
    """Raises ValueError naming the argument whose shape or dtype breaks the contract."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    check_caches(k_cache, v_cache, layer)
    t, h, d = q.shape
    _, k, _, b, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) != head_dim of k_cache ({dk})")
    if h % k:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k})")
    if not (is_pow2(d) and is_pow2(b)):
        raise ValueError(f"head_dim ({d}) and block_size ({b}) must be powers of 2")
    check_fp8_cache(k_cache, v_cache, k_scale, v_scale)
    if k_scale is None:
        check_float_dtypes(q=q, k_cache=k_cache, v_cache=v_cache)
    else:
        check_float_dtypes(q=q)
    if block_tables.ndim != 2 or jnp.dtype(block_tables.dtype) != INT32:
        raise ValueError(f"block_tables must be int32 [S, M], got {block_tables.dtype}"
                         f"{list(block_tables.shape)}")
    s = block_tables.shape[0]
    if kv_lens.shape != (s,) or jnp.dtype(kv_lens.dtype) != INT32:
        raise ValueError(f"kv_lens must be int32 [{s}], got {kv_lens.dtype}{list(kv_lens.shape)}")
    if cu_q_lens.shape != (s + 1,) or jnp.dtype(cu_q_lens.dtype) != INT32:
        raise ValueError(f"cu_q_lens must be int32 [{s + 1}], got "
                         f"{cu_q_lens.dtype}{list(cu_q_lens.shape)}")
    if t == 0 or s == 0:
        raise ValueError(f"need at least one token and one sequence, got T={t}, S={s}")


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "interpret", "max_q_len", "causal", "return_lse", "block_sizes"))
def paged_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    block_tables: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    interpret: bool = False,
    max_q_len: int | None = None,
    causal: bool = True,
    return_lse: bool = False,
    block_sizes: BlockSizes | None = None,
    alibi_slopes: jax.Array | None = None,  # [H] float32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,  # [L, K, N, B] float32
    sliding_window: jax.Array | int | None = None,  # int32 scalar >= 1
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of a ragged batch against the paged KV cache. Returns [T, H, D], or with
    `return_lse` `(out [T, H, D], lse [T, H] float32)` (module docstring).

    `max_q_len` is a static hint: 1 picks the decode tiling (one token per tile, the key
    range split over programs), any other value (or None) the prefill tiling (tiles of
    `block_q` rows = tokens x padded query group). Both compute the same function for
    any input; `block_sizes` (None: `BlockSizes()`) tunes the Triton lowering, its
    None fields chosen by `resolve_block_sizes`.
    """
    _check_inputs(q, k_cache, v_cache, layer, block_tables, kv_lens, cu_q_lens, k_scale,
                  v_scale)
    check_slopes(alibi_slopes, q.shape[1])
    check_window(sliding_window, causal)
    windowed = sliding_window is not None
    bs = resolve_block_sizes(block_sizes or BlockSizes(), q.shape, k_cache.shape, q.dtype,
                             max_q_len=max_q_len, causal=causal,
                             table_keys=block_tables.shape[1] * k_cache.shape[3],
                             kv_fp8=k_scale is not None, alibi=alibi_slopes is not None)
    cfg = kernel_config(bs, q.shape, k_cache.shape, decode=max_q_len == 1, scale=scale,
                        soft_cap=soft_cap, interpret=interpret, causal=causal,
                        return_lse=return_lse, alibi=alibi_slopes is not None,
                        kv_fp8=k_scale is not None, windowed=windowed)
    num_layers, k, n, b, d = k_cache.shape
    t, h, _ = q.shape
    pad = -block_tables.shape[1] % cfg.pages_per_step
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))  # pad -> null block 0
    meta = tile_metadata(cu_q_lens, kv_lens, t, cfg.tile_tokens)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    if windowed:
        layer = jnp.concatenate([layer, jnp.asarray(sliding_window, jnp.int32).reshape(1)])
    rows = (num_layers * k * n * b, d)  # one row per cached token and head
    kv_scales = None if k_scale is None else (k_scale.reshape(-1), v_scale.reshape(-1))
    out = run_kernel(q.reshape(t * h, d), k_cache.reshape(rows), v_cache.reshape(rows),
                     layer, block_tables, meta, cfg, alibi_slopes=alibi_slopes,
                     kv_scales=kv_scales,
                     num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret)
    if return_lse:
        return out[0].reshape(t, h, d), out[1].reshape(t, h)
    return out.reshape(t, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "interpret"))
def mixed_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    block_tables: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_decode: jax.Array,  # int32 scalar
    *,
    scale: float,
    soft_cap: float | None = None,
    interpret: bool = False,
    alibi_slopes: jax.Array | None = None,  # [H] float32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,  # [L, K, N, B] float32
    sliding_window: jax.Array | int | None = None,  # int32 scalar >= 1
) -> jax.Array:
    """`paged_attention` of a batch whose first `num_decode` sequences have one query
    row each (rows `0:num_decode`), as a step mixing decodes with prefill chunks does:
    those rows run with the decode tiling, the other sequences with the prefill tiling.
    With one tiling for all, each decode row would take a prefill tile of its own per
    KV head (block_q rows for one real row) that still steps through all its keys.
    Returns [T, H, D]; the same function as `paged_attention` on the same inputs."""
    t = q.shape[0]
    num_seqs = kv_lens.shape[0]
    scales = dict(k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window)
    decoding = jnp.arange(num_seqs) < num_decode
    rows = min(t, num_seqs)  # the decode rows come first: 0:num_decode within 0:S
    out_decode = paged_attention(  # later sequences: no rows, no keys
        q[:rows], k_cache, v_cache, layer, block_tables, jnp.where(decoding, kv_lens, 0),
        jnp.minimum(cu_q_lens, num_decode), scale=scale, soft_cap=soft_cap,
        interpret=interpret, max_q_len=1, alibi_slopes=alibi_slopes, **scales)
    out = paged_attention(  # the decode sequences: no rows (0:num_decode is left alone)
        q, k_cache, v_cache, layer, block_tables, jnp.where(decoding, 0, kv_lens),
        jnp.maximum(cu_q_lens, num_decode), scale=scale, soft_cap=soft_cap,
        interpret=interpret, alibi_slopes=alibi_slopes, **scales)
    decode_rows = (jnp.arange(rows) < num_decode)[:, None, None]
    return out.at[:rows].set(jnp.where(decode_rows, out_decode, out[:rows]))


def token_positions(cu_q_lens, kv_lens, num_tokens: int):
    """Per flat token: its sequence, its position, and whether it is a real query row."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = kv_lens.shape[0]
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, valid


def _reference_chunk(q, limit, valid, tables, bias_pos=None, start=None, *, k_cache, v_cache,
                     layer, scale, soft_cap, return_lse, alibi_slopes, k_scale=None,
                     v_scale=None):
    """Attention for C tokens, each against keys [start, limit) (start None: 0) of its
    sequence's pages;
    with `alibi_slopes` [H], the ALiBi bias of a token at position `bias_pos`; an fp8
    cache dequantised (float32) after the gather."""
    c, h, d = q.shape
    _, k, _, b, _ = k_cache.shape
    m = tables.shape[1]
    idx = (layer, jnp.arange(k)[None, None, :], tables[:, :, None])
    keys = k_cache[idx].transpose(0, 2, 1, 3, 4).reshape(c, k, m * b, d)  # [C, K, M*B, D]
    vals = v_cache[idx].transpose(0, 2, 1, 3, 4).reshape(c, k, m * b, d)
    if k_scale is not None:  # [C, M, K, B] scales of the gathered rows
        ks = k_scale[idx].transpose(0, 2, 1, 3).reshape(c, k, m * b, 1)
        vs = v_scale[idx].transpose(0, 2, 1, 3).reshape(c, k, m * b, 1)
        keys = keys.astype(jnp.float32) * ks
        vals = vals.astype(jnp.float32) * vs
    qg = q.reshape(c, k, h // k, d)
    s = jnp.einsum("ckgd,ckjd->ckgj", qg, keys, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    if alibi_slopes is not None:  # slope_h * (k_pos - q_pos), the difference exact in int32
        rel = (jnp.arange(m * b, dtype=jnp.int32)[None, :] - bias_pos[:, None])
        slopes = alibi_slopes.reshape(1, k, h // k, 1)
        s = s + slopes * rel.astype(jnp.float32)[:, None, None, :]
    visible = (jnp.arange(m * b)[None, :] < limit[:, None]) & valid[:, None]  # [C, M*B]
    if start is not None:  # a sliding window's first key
        visible = visible & (jnp.arange(m * b)[None, :] >= start[:, None])
    p, s_max, denom = masked_softmax(s, visible[:, None, None, :])
    out = jnp.einsum("ckgj,ckjd->ckgd", p, vals.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    out = out.reshape(c, h, d).astype(q.dtype)
    if not return_lse:
        return out
    return out, (s_max + jnp.log(denom)).reshape(c, h)  # log(0) = -inf: no visible key


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "token_chunk", "causal", "return_lse"))
def paged_attention_reference(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    block_tables: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    token_chunk: int | None = None,
    causal: bool = True,
    return_lse: bool = False,
    alibi_slopes: jax.Array | None = None,  # [H] float32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,  # [L, K, N, B] float32
    sliding_window: jax.Array | int | None = None,  # int32 scalar >= 1
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Plain-jnp paged attention with `paged_attention`'s semantics (also the CPU path).

    Each token gathers its sequence's pages straight from the multi-layer cache (no
    layer copy) and runs a masked float32 softmax. Tokens go `token_chunk` at a time
    (default: about 16M gathered elements per chunk) so memory stays bounded.
    `causal`, `return_lse`, `alibi_slopes`, the fp8 scales and `sliding_window` as in
    `paged_attention` (keys older than the window are gathered, then masked).
    """
    _check_inputs(q, k_cache, v_cache, layer, block_tables, kv_lens, cu_q_lens, k_scale,
                  v_scale)
    check_slopes(alibi_slopes, q.shape[1])
    check_window(sliding_window, causal)
    t, h, d = q.shape
    _, k, _, b, _ = k_cache.shape
    m = block_tables.shape[1]
    seq, pos, valid = token_positions(cu_q_lens, kv_lens, t)
    limit = pos + 1 if causal else kv_lens[seq]  # keys [0, limit) are visible
    if token_chunk is None:
        token_chunk = max(1, (1 << 24) // (m * b * k * d))
    c = min(t, token_chunk)
    chunk = functools.partial(_reference_chunk, k_cache=k_cache, v_cache=v_cache,
                              layer=layer, scale=scale, soft_cap=soft_cap,
                              return_lse=return_lse, alibi_slopes=alibi_slopes,
                              k_scale=k_scale, v_scale=v_scale)
    args = (q, limit, valid, block_tables[seq])
    if alibi_slopes is not None or sliding_window is not None:  # ALiBi's q_pos
        args += (pos if causal else kv_lens[seq],)
    if sliding_window is not None:  # keys [pos - window + 1, pos + 1)
        args += (pos - jnp.asarray(sliding_window, jnp.int32) + 1,)
    if c == t:
        return chunk(*args)
    pad = -t % c
    xs = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in args]
    xs = [x.reshape(-1, c, *x.shape[1:]) for x in xs]
    out = jax.lax.map(lambda a: chunk(*a), xs)
    if return_lse:
        return out[0].reshape(-1, h, d)[:t], out[1].reshape(-1, h)[:t]
    return out.reshape(-1, h, d)[:t]
