"""Paged attention of a many-sequence step in plain jnp, by query tiles: the XLA path of
steps that compute more rows than they have sequences (prefill and mixed steps).

`paged_attention_reference` gathers every query row's pages on its own, [T, K, M*B, D]
per step: a prefill chunk of T rows reads its sequence's keys T times and multiplies each
row by them separately (a batch of one-row matmuls). Here the rows go in tiles of
`tile` rows of one sequence each (`paged_attention_tiling.tile_metadata`, as the Pallas
kernel's prefill tiling): a tile gathers its sequence's pages once ([K, M*B, D]) and its
rows' logits are one matmul against them, so the gather shrinks `tile`-fold and the
matmuls are real ones. A one-token row still takes a tile of its own (its padding rows
compute and are dropped): decode steps keep the reference, one row per sequence.

`sequence_rows_attention` is the shared tile body (also `one_sequence_attention`'s):
causal attention of rows at known positions of one sequence against its pages, with the
references' numerics (float32 logits and softmax, `masked_softmax`), ALiBi, a soft cap,
fp8 scales and a sliding window.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.alibi import check_slopes
from pallas_kernels.common import check_window, masked_softmax
from pallas_kernels.paged_attention_tiling import tile_metadata

GATHER_ELEMENTS = 1 << 24  # K/V elements the tiles of one lax.map batch gather at most


def sequence_rows_attention(q, k_cache, v_cache, layer, pages, pos, valid, *, scale,
                            soft_cap=None, alibi_slopes=None, k_scale=None, v_scale=None,
                            sliding_window=None):
    """Rows q [R, H, D] of one sequence at positions `pos` [R] (int32; `valid` [R] bool:
    rows to compute, the others come out as zeros) against keys [0, pos] of its pages
    `pages` [M] (within `sliding_window` of pos, if given) of layer `layer` of the cache
    [L, K, N, B, D]. Returns [R, H, D] in q's dtype."""
    r, h, d = q.shape
    k, b = k_cache.shape[1], k_cache.shape[3]
    m = pages.shape[0]

    def gather(cache: jax.Array) -> jax.Array:  # [K, M*B, ...]: one gather of M pages
        rows = cache[layer, :, pages]  # [M, K, B, ...] (no copy of the layer first)
        return jnp.moveaxis(rows, 0, 1).reshape(k, m * b, *cache.shape[4:])

    keys, vals = gather(k_cache), gather(v_cache)  # [K, M*B, D]
    if k_scale is not None:  # one scale per cached row
        keys = keys.astype(jnp.float32) * gather(k_scale)[..., None]
        vals = vals.astype(jnp.float32) * gather(v_scale)[..., None]
    qg = q.reshape(r, k, h // k, d)
    s = jnp.einsum("tkgd,kjd->tkgj", qg, keys, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = jnp.arange(m * b, dtype=jnp.int32)
    if alibi_slopes is not None:  # slope_h * (k_pos - q_pos)
        rel = (key_pos[None, :] - pos[:, None]).astype(jnp.float32)
        s = s + alibi_slopes.reshape(1, k, h // k, 1) * rel[:, None, None, :]
    visible = (key_pos[None, :] <= pos[:, None]) & valid[:, None]  # [R, M*B]
    if sliding_window is not None:
        first = pos - jnp.asarray(sliding_window, jnp.int32) + 1
        visible = visible & (key_pos[None, :] >= first[:, None])
    p, *_ = masked_softmax(s, visible[:, None, None, :])
    out = jnp.einsum("tkgj,kjd->tkgd", p, vals.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(r, h, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "tile"))
def tiled_attention(
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
    tile: int = 32,
    alibi_slopes: jax.Array | None = None,  # [H] float32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,  # int32 scalar >= 1
) -> jax.Array:
    """`paged_attention_reference`'s contract and numerics for causal attention (rows past
    `cu_q_lens[S]` come out as zeros), computed `tile` rows of one sequence at a time."""
    check_slopes(alibi_slopes, q.shape[1])
    check_window(sliding_window, True)
    t, h, d = q.shape
    k, b, m = k_cache.shape[1], k_cache.shape[3], block_tables.shape[1]
    meta = tile_metadata(cu_q_lens, kv_lens, t, tile)  # [NT, 5]
    row = jnp.arange(tile, dtype=jnp.int32)
    attend = functools.partial(sequence_rows_attention, k_cache=k_cache, v_cache=v_cache,
                               layer=layer, scale=scale, soft_cap=soft_cap,
                               alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
                               sliding_window=sliding_window)

    def one_tile(tile_meta):
        seq, first, valid, first_pos, _ = (tile_meta[i] for i in range(5))
        rows = jnp.minimum(first + row, t - 1)
        return attend(q[rows], pages=block_tables[seq], pos=first_pos + row, valid=row < valid)

    batch = max(1, GATHER_ELEMENTS // (2 * k * m * b * d))
    tiles = jax.lax.map(one_tile, meta, batch_size=min(batch, meta.shape[0]))
    # each row written by its own tile; a tile's rows past its valid ones go nowhere
    rows = jnp.where(row[None, :] < meta[:, 2:3], meta[:, 1:2] + row[None, :], t)
    out = jnp.zeros((t, h, d), q.dtype)
    return out.at[rows.reshape(-1)].set(tiles.reshape(-1, h, d), mode="drop")
