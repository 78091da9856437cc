"""RMSNorm, and the per-head q/k norms some families apply before RoPE (Qwen3; Gemma 3 has
them too): each query and key head RMS-normalised over its D values with one weight [D]
for q and one for k, shared by all heads, and its own epsilon.

Shape letters as in models.llama.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back, then scaled (HF order)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def qk_norm(q: jax.Array, k: jax.Array, q_weight: jax.Array | None,
            k_weight: jax.Array | None, eps: float) -> tuple[jax.Array, jax.Array]:
    """q [..., H, D] and k [..., K, D], every head RMS-normalised over D (weights [D]);
    unchanged when the model has no q/k norms (`q_weight` None)."""
    if q_weight is None:
        return q, k
    return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)


def qk_norm_fused(qkv: jax.Array, q_weight: jax.Array | None, k_weight: jax.Array | None,
                  eps: float, num_heads: int, num_kv_heads: int, shards: int = 1
                  ) -> jax.Array:
    """`qk_norm` on a fused projection [..., (H+2K)*D], in place: its columns come in
    `shards` blocks (`Params.shards`), block s = [q_s | k_s | v_s] of H / shards and
    K / shards heads of D columns each; v is unchanged (and everything without q/k
    norms)."""
    if q_weight is None:
        return qkv
    h, kv, d = num_heads // shards, num_kv_heads // shards, q_weight.shape[-1]
    heads = qkv.reshape(*qkv.shape[:-1], shards, h + 2 * kv, d)
    q, k = qk_norm(heads[..., :h, :], heads[..., h:h + kv, :], q_weight, k_weight, eps)
    return jnp.concatenate([q, k, heads[..., h + kv:, :]], axis=-2).reshape(qkv.shape)
