"""Gemma 3's pieces of the decoder that `models.llama.forward` runs (config:
`models.gemma3_config`): the embedding scaled by sqrt(hidden), the gated MLP activation
(GeGLU), and the norms of the attention's and the MLP's outputs. The RoPE bases per layer
are `models.rope.layer_inv_freqs`; Gemma's 1 + w norm weights are stored as 1 + w by the
loader, so `models.norms.rms_norm` applies them unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.norms import rms_norm

# the gate activations of a gated MLP, by `ModelConfig.hidden_act`
ACTS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
        "gelu": functools.partial(jax.nn.gelu, approximate=False)}


def gated(gate: jax.Array, up: jax.Array, act: str) -> jax.Array:
    """act(gate) * up (SwiGLU for "silu", GeGLU for the gelus)."""
    return ACTS[act](gate) * up


def embed_tokens(embed: jax.Array, cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """The embedding rows of token_ids [...] -> [..., E]; Gemma 3's times sqrt(E), the
    factor rounded to the embedding's dtype first (as transformers does)."""
    x = embed[token_ids]
    if cfg.arch != "gemma3":
        return x
    return x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)


def post_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm of a block's output before its residual add (Gemma 3); x itself without
    the weight (every other family)."""
    return x if weight is None else rms_norm(x, weight, eps)
