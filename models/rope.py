"""Rotary position embeddings: the inverse frequencies of a config (default, llama3 or
linear scaling; Gemma 3's per-layer bases) and the rotation in HF's rotate_half layout.

Shape letters as in models.llama.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """[D/2] float32 inverse frequencies, with llama3 or linear scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    sc = cfg.rope_scaling_dict
    kind = sc.get("rope_type", "default")
    if kind == "linear":
        return inv / sc["factor"]
    if kind != "llama3":
        return inv
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [..., N, D] rotated at positions [...] in HF's rotate_half layout (fp32 math)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def layer_inv_freqs(cfg: ModelConfig) -> jax.Array:
    """`rope_inv_freq(cfg)` [D/2], or with a separate base for the sliding-window layers
    (`cfg.rope_local_theta`, Gemma 3: unscaled) one row per layer, [L, D/2] float32."""
    glob = rope_inv_freq(cfg)
    if cfg.rope_local_theta is None:
        return glob
    local = rope_inv_freq(dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta,
                                              rope_scaling=None))
    return jnp.stack([glob if w is None else local for w in cfg.layer_windows])
