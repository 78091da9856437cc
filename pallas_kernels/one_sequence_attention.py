"""Paged attention of one sequence's query rows in plain jnp: the XLA path of one stream.

`paged_attention_reference` gathers every query row's pages on its own ([T, K, M*B, D]
per step), which keeps a many-sequence step's memory bounded but makes one sequence's
rows gather the same pages T times: a (k+1)-token speculative verify or a short chunk
on the CPU spends more in that gather than in its matmuls. With one sequence
(`block_tables` [1, M]) the pages are gathered once ([K, M*B, D]) and every row's
logits are one matmul against them. Same contract and numerics as
`paged_attention_reference` (float32 softmax, rows past `cu_q_lens[1]` come out as
zeros) for causal attention with `alibi_slopes`, `soft_cap`, fp8 scales and
`sliding_window`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.alibi import check_slopes
from pallas_kernels.common import check_window, masked_softmax
from pallas_kernels.paged_attention import token_positions


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap"))
def one_sequence_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    block_tables: jax.Array,  # [1, M] int32
    kv_lens: jax.Array,  # [1] int32
    cu_q_lens: jax.Array,  # [2] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    alibi_slopes: jax.Array | None = None,  # [H] float32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,  # int32 scalar >= 1
) -> jax.Array:
    """Causal attention of the rows `cu_q_lens[0]:cu_q_lens[1]` of one sequence against
    its `kv_lens[0]` cached keys (the rows sit at the last q_len positions)."""
    if block_tables.ndim != 2 or block_tables.shape[0] != 1:
        raise ValueError(f"block_tables {block_tables.shape}: one sequence ([1, M]) only")
    check_slopes(alibi_slopes, q.shape[1])
    check_window(sliding_window, True)
    t, h, d = q.shape
    k = k_cache.shape[1]
    m, b = block_tables.shape[1], k_cache.shape[3]
    _, pos, valid = token_positions(cu_q_lens, kv_lens, t)
    pages = block_tables[0]

    def gather(cache: jax.Array) -> jax.Array:  # [K, M*B, ...]: one gather of M pages
        rows = cache[layer, :, pages]  # [M, K, B, ...] (no copy of the layer first)
        return jnp.moveaxis(rows, 0, 1).reshape(k, m * b, *cache.shape[4:])

    keys, vals = gather(k_cache), gather(v_cache)  # [K, M*B, D]
    if k_scale is not None:  # one scale per cached row
        keys = keys.astype(jnp.float32) * gather(k_scale)[..., None]
        vals = vals.astype(jnp.float32) * gather(v_scale)[..., None]
    qg = q.reshape(t, k, h // k, d)
    s = jnp.einsum("tkgd,kjd->tkgj", qg, keys, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = jnp.arange(m * b, dtype=jnp.int32)
    if alibi_slopes is not None:  # slope_h * (k_pos - q_pos)
        rel = (key_pos[None, :] - pos[:, None]).astype(jnp.float32)
        s = s + alibi_slopes.reshape(1, k, h // k, 1) * rel[:, None, None, :]
    visible = (key_pos[None, :] <= pos[:, None]) & valid[:, None]  # [T, M*B]
    if sliding_window is not None:
        first = pos - jnp.asarray(sliding_window, jnp.int32) + 1
        visible = visible & (key_pos[None, :] >= first[:, None])
    p, *_ = masked_softmax(s, visible[:, None, None, :])
    out = jnp.einsum("tkgj,kjd->tkgd", p, vals.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(t, h, d).astype(q.dtype)
