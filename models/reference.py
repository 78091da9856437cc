"""The dense reference: the model run without paged KV, the ground truth of the tests.

`dense_forward` attends over the whole sequence at once; `dense_generate` decodes greedily
through a contiguous per-sequence KV cache (`DenseKVCache`). Both run `models.llama.forward`
on any Params layout, so they check the engine's paged attention, packing and sampling, not
the decoder's arithmetic (tested against transformers in the loader tests, and against an
independent torch Baichuan2 in tests/test_baichuan.py). ALiBi models get their bias here,
sliding-window layers their window (`models.window`).
Shape letters as in models.llama; U kv positions, M cache slots per sequence.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from models.alibi import check_slopes, model_slopes
from models.config import ModelConfig
from models.llama import Params, compute_logits, forward
from models.window import layer_window


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                     kv_pos: jax.Array, kv_valid: jax.Array | None = None,
                     alibi_slopes: Any = None, window: Any = None,
                     scale: float | None = None) -> jax.Array:
    """Plain attention: q [S,T,H,D], k/v [S,U,K,D]; row t sees keys with kv_pos <= q_pos[t].

    q_pos [T], kv_pos [U], kv_valid optional [U] bool; alibi_slopes optional [H] (ALiBi:
    `slope_h * (kv_pos - q_pos)` added to the scaled scores; ValueError for another
    length); `window` (an int or int32 scalar; None: none) also hides the keys with
    kv_pos <= q_pos[t] - window (transformers' sliding window); returns [S,T,H,D] in
    q.dtype. `scale`: the softmax scale (None: 1 / sqrt(D)).
    """
    s, t, h, d = q.shape
    kh = k.shape[2]
    check_slopes(alibi_slopes, h)
    qg = q.reshape(s, t, kh, h // kh, d)
    scores = jnp.einsum("stkgd,sukd->skgtu", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5 if scale is None else scale)
    if alibi_slopes is not None:  # head h = kv head * G + g
        dist = (kv_pos[None, :] - q_pos[:, None]).astype(jnp.float32)  # [T, U]
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(kh, h // kh, 1, 1)
        scores = scores + slopes * dist
    mask = kv_pos[None, :] <= q_pos[:, None]  # [T, U]
    if window is not None:
        mask = mask & (kv_pos[None, :] > q_pos[:, None] - window)
    if kv_valid is not None:
        mask = mask & kv_valid[None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("skgtu,sukd->stkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(s, t, h, d).astype(q.dtype)


def dense_forward(params: Params, cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """Reference forward without a cache: token_ids [S, T] -> float32 logits [S, T, V]."""
    pos = jnp.arange(token_ids.shape[1], dtype=jnp.int32)
    slopes = model_slopes(cfg)

    def attn(q, k, v, cache, layer):
        window = layer_window(cfg.layer_windows, layer)
        return causal_attention(q, k, v, pos, pos, alibi_slopes=slopes, window=window,
                                scale=cfg.attn_scale), cache

    positions = jnp.broadcast_to(pos, token_ids.shape)
    hidden, _ = forward(params, cfg, token_ids, positions, None, attn)
    return compute_logits(params, cfg, hidden)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseKVCache:
    """Contiguous per-sequence KV cache; every sequence holds `length` tokens."""

    k: jax.Array  # [L, S, M, K, D]
    v: jax.Array  # [L, S, M, K, D]
    length: jax.Array  # int32 scalar: tokens already cached


def init_dense_cache(cfg: ModelConfig, num_seqs: int, max_len: int, dtype: Any) -> DenseKVCache:
    """An empty cache: k and v zeros [L, S, M=max_len, K, D], length 0."""
    shape = (cfg.num_layers, num_seqs, max_len, cfg.num_kv_heads, cfg.head_dim)
    return DenseKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.int32(0))


def dense_cache_attn(q: jax.Array, k: jax.Array, v: jax.Array, cache: DenseKVCache,
                     layer: jax.Array, alibi_slopes: Any = None,
                     windows: tuple[int | None, ...] | None = None,
                     scale: float | None = None) -> tuple[jax.Array, DenseKVCache]:
    """attn_fn over a DenseKVCache: writes k/v [S,T,K,D] at cache.length, attends causally
    (with ALiBi given `alibi_slopes` [H], each layer's sliding window given `windows`, the
    softmax `scale`; `dense_cache_attn_fn(cfg)` binds a model's).

    The caller advances `cache.length` by T after the forward (all layers write the same slots).
    """
    start = cache.length
    idx = (layer, 0, start, 0, 0)
    kc = jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), idx)
    vc = jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), idx)
    max_len = kc.shape[2]
    kv_pos = jnp.arange(max_len, dtype=jnp.int32)
    q_pos = start + jnp.arange(q.shape[1], dtype=jnp.int32)
    window = None if windows is None else layer_window(windows, layer)
    out = causal_attention(q, kc[layer], vc[layer], q_pos, kv_pos, alibi_slopes=alibi_slopes,
                           window=window, scale=scale)
    return out, DenseKVCache(kc, vc, cache.length)


def dense_cache_attn_fn(cfg: ModelConfig):
    """`dense_cache_attn` with `cfg`'s ALiBi slopes (None for a RoPE model) and sliding
    windows bound."""
    return functools.partial(dense_cache_attn, alibi_slopes=model_slopes(cfg),
                             windows=cfg.layer_windows, scale=cfg.attn_scale)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _dense_step(params: Params, cfg: ModelConfig, token_ids: jax.Array,
                cache: DenseKVCache) -> tuple[jax.Array, DenseKVCache]:
    """token_ids [S, T] appended after cache.length -> (greedy next ids [S], cache)."""
    t = token_ids.shape[1]
    positions = cache.length + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), token_ids.shape)
    hidden, cache = forward(params, cfg, token_ids, positions, cache, dense_cache_attn_fn(cfg))
    logits = compute_logits(params, cfg, hidden[:, -1])
    cache = DenseKVCache(cache.k, cache.v, cache.length + t)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def dense_generate(params: Params, cfg: ModelConfig, prompt_ids: list[int],
                   max_new_tokens: int, eos_token_ids: tuple[int, ...] | None = None,
                   ) -> list[int]:
    """Greedy generation with a contiguous KV cache (the model reference).

    Stops after an id in `eos_token_ids` (default cfg.eos_token_ids; pass () to never stop),
    which is included in the output.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must be non-empty")
    eos = set(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    max_len = -(-(len(prompt_ids) + max_new_tokens) // 64) * 64
    cache = init_dense_cache(cfg, 1, max_len, params.embed.dtype)
    tokens = jnp.asarray([prompt_ids], dtype=jnp.int32)
    out: list[int] = []
    for _ in range(max_new_tokens):
        next_ids, cache = _dense_step(params, cfg, tokens, cache)
        out.append(int(next_ids[0]))
        if out[-1] in eos:
            break
        tokens = next_ids[:, None]
    return out
