"""Functional Llama-family decoder (Llama-2/3, Mistral, Qwen2, SmolLM2) over a params pytree.

Shape letters: T tokens, S sequences, L layers, H query heads, K kv heads, G = H // K,
D head dim, E hidden, F mlp hidden, V vocab. Query head h uses kv head h // G.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig

# attn_fn(q [...,H,D], k [...,K,D], v [...,K,D], cache, layer: int32 scalar)
#   -> (out [...,H,D], cache)
AttnFn = Callable[[jax.Array, jax.Array, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]
# qkv_attn_fn(qkv [T, (H+2K)*D] before RoPE, positions [T], inv_freq [D/2], cache, layer)
#   -> (out [T,H,D], cache): attention that applies the rotary embedding itself (a fused
# kernel), given the fused projection's output (columns [q heads | k heads | v heads])
# with the tokens flattened
QKVAttnFn = Callable[[jax.Array, jax.Array, jax.Array, Any, jax.Array],
                     tuple[jax.Array, Any]]


class LinearFn(Protocol):
    """linear(x [..., in], w [in, out], act) -> [..., out]; with act "silu_mul", w holds
    [gate | up] and the result is silu(x @ gate) * (x @ up) [..., out / 2]."""

    def __call__(self, x: jax.Array, w: jax.Array, act: str | None = None) -> jax.Array: ...


def dense_linear(x: jax.Array, w: jax.Array, act: str | None = None) -> jax.Array:
    """The model's matmuls as XLA runs them (the default `LinearFn`)."""
    y = x @ w
    if act != "silu_mul":
        return y
    gate, up = jnp.split(y, 2, axis=-1)
    return jax.nn.silu(gate) * up


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """Per-layer weights, each stacked on a leading L axis; linears stored [in, out].

    Fused form (`fuse_projections`, per-layer weights only): `wq` holds [wq | wk | wv]
    (and `bq` the three biases) with `wk`/`wv`/`bk`/`bv` None, and `w_gate` holds
    [w_gate | w_up] with `w_up` None: one matmul each instead of three and two.
    """

    attn_norm: jax.Array  # [L, E]
    wq: jax.Array  # [L, E, H*D]
    wk: jax.Array  # [L, E, K*D]
    wv: jax.Array  # [L, E, K*D]
    bq: jax.Array | None  # [L, H*D]
    bk: jax.Array | None  # [L, K*D]
    bv: jax.Array | None  # [L, K*D]
    wo: jax.Array  # [L, H*D, E]
    mlp_norm: jax.Array  # [L, E]
    w_gate: jax.Array  # [L, E, F]
    w_up: jax.Array  # [L, E, F]
    w_down: jax.Array  # [L, F, E]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: jax.Array  # [V, E]
    layers: LayerParams
    final_norm: jax.Array  # [E]
    lm_head: jax.Array | None  # [E, V]; None when tied to embed


def param_shapes(cfg: ModelConfig) -> Params:
    """A Params pytree of shape tuples (leading L axis on layer fields)."""
    e, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    hd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bias = cfg.attention_bias
    layers = LayerParams(
        attn_norm=(n, e), wq=(n, e, hd), wk=(n, e, kd), wv=(n, e, kd),
        bq=(n, hd) if bias else None, bk=(n, kd) if bias else None,
        bv=(n, kd) if bias else None, wo=(n, hd, e), mlp_norm=(n, e),
        w_gate=(n, e, f), w_up=(n, e, f), w_down=(n, f, e))
    lm_head = None if cfg.tie_word_embeddings else (e, v)
    return Params(embed=(v, e), layers=layers, final_norm=(e,), lm_head=lm_head)


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def param_partition_specs(cfg: ModelConfig, axis: str = "tp") -> Params:
    """PartitionSpecs for tensor parallelism over mesh axis `axis` (Megatron-style).

    Q/K/V and gate/up are split by output (heads / F), wo and w_down by input; norms are
    replicated; embed and lm_head are split on the hidden / vocab axis.
    """
    col, row, rep = P(None, None, axis), P(None, axis, None), P()
    bias = P(None, axis) if cfg.attention_bias else None
    layers = LayerParams(
        attn_norm=rep, wq=col, wk=col, wv=col, bq=bias, bk=bias, bv=bias, wo=row,
        mlp_norm=rep, w_gate=col, w_up=col, w_down=row)
    lm_head = None if cfg.tie_word_embeddings else P(None, axis)
    return Params(embed=P(None, axis), layers=layers, final_norm=rep, lm_head=lm_head)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.bfloat16) -> Params:
    """Random weights (normal, std 0.02; norms 1).

    jit it with cfg and dtype static (and out_shardings) to create the weights on device.
    """
    shapes, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=_is_shape)
    keys = jax.random.split(key, len(shapes))

    def make(path: Any, shape: tuple[int, ...], k: jax.Array) -> jax.Array:
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    leaves = [make(path, shape, k) for (path, shape), k in zip(shapes, keys, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back, then scaled (HF order)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


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


def _fused_qkv(h: jax.Array, lp: LayerParams, linear: LinearFn) -> jax.Array:
    """[..., (H+2K)*D]: the fused projection (`lp.wq` holds [wq | wk | wv]) with its bias."""
    qkv = linear(h, lp.wq)
    return qkv if lp.bq is None else qkv + lp.bq


def _qkv(h: jax.Array, lp: LayerParams, cfg: ModelConfig, linear: LinearFn
         ) -> tuple[jax.Array, ...]:
    lead, d = h.shape[:-1], cfg.head_dim
    if lp.wk is None:  # fused [wq | wk | wv]
        qkv = _fused_qkv(h, lp, linear)
        hd, kd = cfg.num_heads * d, cfg.num_kv_heads * d
        q, k, v = qkv[..., :hd], qkv[..., hd : hd + kd], qkv[..., hd + kd :]
    else:
        q, k, v = linear(h, lp.wq), linear(h, lp.wk), linear(h, lp.wv)
        if lp.bq is not None:
            q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    return (q.reshape(*lead, cfg.num_heads, d), k.reshape(*lead, cfg.num_kv_heads, d),
            v.reshape(*lead, cfg.num_kv_heads, d))


def _mlp(h: jax.Array, lp: LayerParams, linear: LinearFn) -> jax.Array:
    if lp.w_up is None:  # fused [w_gate | w_up]
        act = linear(h, lp.w_gate, "silu_mul")
    else:
        act = jax.nn.silu(linear(h, lp.w_gate)) * linear(h, lp.w_up)
    return linear(act, lp.w_down)


def forward(params: Params, cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array,
            cache: Any, attn_fn: AttnFn, linear: LinearFn = dense_linear,
            qkv_attn_fn: QKVAttnFn | None = None) -> tuple[jax.Array, Any]:
    """Run the decoder on token_ids/positions [...]; returns (hidden [..., E] normed, cache).

    With stacked layers (`params.layers` a LayerParams) the layers run under lax.scan with
    `cache` in the carry; with a tuple of per-layer LayerParams (see `unstack_layers`) they
    are unrolled, which on GPU avoids slicing each layer's weights out of the stack (a copy
    per layer per step) and the while loop's per-iteration host round trip. Attention (and
    any KV cache write) is delegated to `attn_fn(q, k, v, cache, layer)`, the layers'
    matmuls to `linear` (default: XLA's). Layers with fused Q/K/V weights go to
    `qkv_attn_fn` instead, where given: it takes the projection before RoPE and rotates Q
    and K itself (one kernel for the rotation and the KV write).
    """
    x = params.embed[token_ids]
    body = functools.partial(_layer, cfg=cfg, positions=positions, inv_freq=rope_inv_freq(cfg),
                             attn_fn=attn_fn, linear=linear, qkv_attn_fn=qkv_attn_fn)
    if isinstance(params.layers, tuple):
        for i, lp in enumerate(params.layers):
            (x, cache), _ = body((x, cache), (lp, jnp.int32(i)))
    else:
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (params.layers, layer_ids))
    return rms_norm(x, params.final_norm, cfg.rms_norm_eps), cache


def _layer(carry: tuple[jax.Array, Any], xs: tuple[LayerParams, jax.Array], *, cfg: ModelConfig,
           positions: jax.Array, inv_freq: jax.Array, attn_fn: AttnFn, linear: LinearFn,
           qkv_attn_fn: QKVAttnFn | None = None):
    x, cache = carry
    lp, layer = xs
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    if qkv_attn_fn is not None and lp.wk is None:
        qkv = _fused_qkv(h, lp, linear)
        out, cache = qkv_attn_fn(qkv.reshape(-1, qkv.shape[-1]), positions.reshape(-1),
                                 inv_freq, cache, layer)  # (out [T, H, D], reshaped below)
    else:
        q, k, v = _qkv(h, lp, cfg, linear)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out, cache = attn_fn(q, k, v, cache, layer)
    x = x + linear(out.astype(x.dtype).reshape(*x.shape[:-1], -1), lp.wo)
    x = x + _mlp(rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps), lp, linear)
    return (x, cache), None


def unstack_layers(params: Params, fuse: bool = False) -> Params:
    """Params whose `layers` is a tuple of per-layer LayerParams (for the unrolled forward);
    with `fuse`, in the fused form (see LayerParams; single device only).

    The split copies the layer weights once, field by field (fused fields straight from
    the stacks, so the weights never exist three times); a field sharded over a mesh
    stays sharded the same way (its spec without the layer axis), so a tensor-parallel
    model is never gathered onto one device. The stacked arrays are freed when the caller
    drops them.
    """
    stacked = params.layers
    num_layers = stacked.attn_norm.shape[0]
    groups = {"wq": ("wq", "wk", "wv"), "bq": ("bq", "bk", "bv"),
              "w_gate": ("w_gate", "w_up")} if fuse else {}
    fused_away = {name for names in groups.values() for name in names[1:]}
    fields = {}
    for f in dataclasses.fields(LayerParams):
        value = getattr(stacked, f.name)
        if value is None or f.name in fused_away:
            fields[f.name] = [None] * num_layers
        elif f.name in groups:
            fields[f.name] = _split_concat([getattr(stacked, n) for n in groups[f.name]])
        else:
            fields[f.name] = _split_layers(value)
    layers = tuple(LayerParams(**{k: v[i] for k, v in fields.items()})
                   for i in range(num_layers))
    return dataclasses.replace(params, layers=layers)


def _split_concat(stacks: list[jax.Array]) -> list[jax.Array]:
    """Per-layer concatenations of same-depth stacks along the output axis."""
    split = jax.jit(lambda *xs: tuple(jnp.concatenate([x[i] for x in xs], axis=-1)
                                      for i in range(xs[0].shape[0])))
    return list(split(*stacks))


def fuse_projections(params: Params) -> Params:
    """Per-layer params (`unstack_layers`) with Q/K/V and gate/up each concatenated into
    one matrix (see LayerParams); the unfused arrays stay alive while the caller holds
    them (from stacked params, `unstack_layers(params, fuse=True)` skips that copy).
    Single-device only: a tensor-parallel split of the concatenation would mix heads."""
    if not isinstance(params.layers, tuple):
        raise ValueError("fuse_projections needs per-layer params (unstack_layers first)")
    cat = jax.jit(lambda *xs: jnp.concatenate(xs, axis=-1))
    layers = []
    for lp in params.layers:
        if lp.wk is None:  # already fused
            layers.append(lp)
            continue
        bias = None if lp.bq is None else cat(lp.bq, lp.bk, lp.bv)
        layers.append(dataclasses.replace(
            lp, wq=cat(lp.wq, lp.wk, lp.wv), wk=None, wv=None, bq=bias, bk=None, bv=None,
            w_gate=cat(lp.w_gate, lp.w_up), w_up=None))
    return dataclasses.replace(params, layers=tuple(layers))


def _split_layers(x: jax.Array) -> list[jax.Array]:
    sharding = x.sharding
    out = None
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        out = NamedSharding(sharding.mesh, P(*spec[1:]))
    split = jax.jit(lambda a: tuple(a[i] for i in range(a.shape[0])),
                    out_shardings=None if out is None else (out,) * x.shape[0])
    return list(split(x))


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> logits [..., V] in float32 (tied embeddings when lm_head is None)."""
    if params.lm_head is None:
        return jnp.einsum("...e,ve->...v", hidden, params.embed,
                          preferred_element_type=jnp.float32)
    return jnp.einsum("...e,ev->...v", hidden, params.lm_head,
                      preferred_element_type=jnp.float32)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                     kv_pos: jax.Array, kv_valid: jax.Array | None = None) -> jax.Array:
    """Plain attention: q [S,T,H,D], k/v [S,U,K,D]; row t sees keys with kv_pos <= q_pos[t].

    q_pos [T], kv_pos [U], kv_valid optional [U] bool; returns [S,T,H,D] in q.dtype.
    """
    s, t, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(s, t, kh, h // kh, d)
    scores = jnp.einsum("stkgd,sukd->skgtu", qg, k, preferred_element_type=jnp.float32)
    mask = kv_pos[None, :] <= q_pos[:, None]  # [T, U]
    if kv_valid is not None:
        mask = mask & kv_valid[None, :]
    scores = jnp.where(mask, scores / math.sqrt(d), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("skgtu,sukd->stkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(s, t, h, d).astype(q.dtype)


def dense_forward(params: Params, cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """Reference forward without a cache: token_ids [S, T] -> float32 logits [S, T, V]."""
    pos = jnp.arange(token_ids.shape[1], dtype=jnp.int32)

    def attn(q, k, v, cache, layer):
        return causal_attention(q, k, v, pos, pos), cache

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
    shape = (cfg.num_layers, num_seqs, max_len, cfg.num_kv_heads, cfg.head_dim)
    return DenseKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.int32(0))


def dense_cache_attn(q: jax.Array, k: jax.Array, v: jax.Array, cache: DenseKVCache,
                     layer: jax.Array) -> tuple[jax.Array, DenseKVCache]:
    """attn_fn over a DenseKVCache: writes k/v [S,T,K,D] at cache.length, attends causally.

    The caller advances `cache.length` by T after the forward (all layers write the same slots).
    """
    start = cache.length
    idx = (layer, 0, start, 0, 0)
    kc = jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), idx)
    vc = jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), idx)
    max_len = kc.shape[2]
    kv_pos = jnp.arange(max_len, dtype=jnp.int32)
    q_pos = start + jnp.arange(q.shape[1], dtype=jnp.int32)
    out = causal_attention(q, kc[layer], vc[layer], q_pos, kv_pos)
    return out, DenseKVCache(kc, vc, cache.length)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _dense_step(params: Params, cfg: ModelConfig, token_ids: jax.Array,
                cache: DenseKVCache) -> tuple[jax.Array, DenseKVCache]:
    """token_ids [S, T] appended after cache.length -> (greedy next ids [S], cache)."""
    t = token_ids.shape[1]
    positions = cache.length + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), token_ids.shape)
    hidden, cache = forward(params, cfg, token_ids, positions, cache, dense_cache_attn)
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
