"""Functional Llama-family decoder (Llama-2/3, Mistral, Qwen2, SmolLM2, Baichuan2, Qwen3,
Mixtral, Qwen3-MoE) over a params pytree. Baichuan2: RoPE (7B) or ALiBi (13B) and a NormHead
(`normalize_head`); Qwen3: q/k norms (models.norms); Mixtral, Qwen3-MoE: experts (models.moe).

Shape letters: T tokens, S sequences, L layers, H query heads, K kv heads, G = H // K,
D head dim, E hidden, F mlp hidden, V vocab. Query head h uses kv head h // G.

The weights' layout ("stacked", "per_layer" or "fused", see `Params`) is a static field of
the params; models.layout converts between layouts and models.reference holds the dense
reference the tests compare against.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.fp8_linear import Fp8Weight, fp8_matmul
from models.gemma3 import embed_tokens, gated, post_norm
from models.moe import ExpertsFn, moe_mlp
from models.norms import qk_norm, qk_norm_fused, rms_norm
from models.rope import apply_rope, layer_inv_freqs, rope_inv_freq  # noqa: F401 (re-export)

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


def dense_linear(x: jax.Array, w: jax.Array | Fp8Weight, act: str | None = None
                 ) -> jax.Array:
    """The model's matmuls as XLA runs them (the default `LinearFn`); an fp8 weight
    (`quantization="fp8"`) through `models.fp8_linear.fp8_matmul`."""
    return apply_act(fp8_matmul(x, w) if isinstance(w, Fp8Weight) else x @ w, act)


def apply_act(y: jax.Array, act: str | None) -> jax.Array:
    """A `LinearFn`'s activation on its matmul result y: None, y; "<act>_mul" ("silu_mul",
    Gemma's "gelu_tanh_mul"), y's [gate | up] halves as act(gate) * up."""
    if act is None:
        return y
    gate, up = jnp.split(y, 2, axis=-1)
    return gated(gate, up, act.removesuffix("_mul"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """Layer weights; linears stored [in, out]. The shapes below are those of the "stacked"
    layout; in the per-layer layouts each LayerParams holds one layer (no L axis).

    Fused form (layout "fused"): `wq` holds [wq | wk | wv] (and `bq` the three biases)
    with `wk`/`wv`/`bk`/`bv` None, and `w_gate` holds [w_gate | w_up] with `w_up` None:
    one matmul each instead of three and two.

    Optional (None without the feature): `q_norm` / `k_norm`, per-head q/k RMSNorm weights
    (`cfg.qk_norm`, before RoPE); `router` (`cfg.moe`), whose MLP fields hold one matrix
    per expert: w_gate / w_up [L, X, E, F], w_down [L, X, F, E] (X experts);
    `post_attn_norm` / `post_mlp_norm` (Gemma 3), norms of the attention's and the MLP's
    outputs before the residual add.
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
    q_norm: jax.Array | None = None  # [L, D]
    k_norm: jax.Array | None = None  # [L, D]
    router: jax.Array | None = None  # [L, E, X]
    post_attn_norm: jax.Array | None = None  # [L, E]
    post_mlp_norm: jax.Array | None = None  # [L, E]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    """The model's weights. `layout` is static pytree metadata (part of the treedef, not a
    leaf; one of LAYOUTS) naming the form of `layers`:

    - "stacked": one LayerParams, every field stacked on a leading L axis; the layers run
      under lax.scan. What the loaders and init_params produce.
    - "per_layer": a tuple of L LayerParams, unrolled in the forward.
    - "fused": as "per_layer", with Q/K/V and gate/up fused (see LayerParams).

    `shards` (static; "fused" only): the fused columns come in that many blocks, one per
    tensor-parallel shard, block s holding shard s's [q | k | v] heads ([gate | up]).
    """

    embed: jax.Array  # [V, E]
    layers: LayerParams | tuple[LayerParams, ...]
    final_norm: jax.Array  # [E]
    lm_head: jax.Array | None  # [E, V]; None when tied to embed
    layout: str = dataclasses.field(default="stacked", metadata={"static": True})
    shards: int = dataclasses.field(default=1, metadata={"static": True})

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown Params layout {self.layout!r}; expected one of {LAYOUTS}")
        if self.shards != 1 and self.layout != "fused":
            raise ValueError(f"Params shards={self.shards} with layout {self.layout!r}")


LAYOUTS = ("stacked", "per_layer", "fused")


def check_layout(params: Params) -> None:
    """ValueError, naming the combination, unless `params.layers` has the form that
    `params.layout` names (a tuple iff per-layer; fused fields iff "fused", or in any
    "stacked" layers whose `wk` is None: the CPU's scan over fused buffers)."""
    layout, layers = params.layout, params.layers
    if isinstance(layers, tuple) != (layout != "stacked"):
        form = "a tuple of per-layer LayerParams" if isinstance(layers, tuple) else "stacked layers"
        raise ValueError(f"Params layout {layout!r} with {form}")
    fused = layout == "fused" or (layout == "stacked" and layers.wk is None)
    for lp in layers if isinstance(layers, tuple) else (layers,):
        if (lp.wk is None, lp.w_up is None) != (fused, fused):
            form = "unfused" if fused else "fused (wk or w_up None)"
            raise ValueError(f"Params layout {layout!r} with {form} Q/K/V or gate/up weights")


def is_fused(params: Params) -> bool:
    """Whether Q/K/V and gate/up are each one matrix (see LayerParams)."""
    return params.layout == "fused" or (params.layout == "stacked" and params.layers.wk is None)


def param_shapes(cfg: ModelConfig) -> Params:
    """A stacked Params pytree of shape tuples (leading L axis on layer fields)."""
    e, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    hd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bias, qk, x = cfg.attention_bias, (n, cfg.head_dim) if cfg.qk_norm else None, cfg.num_experts
    per = (n, x) if cfg.moe else (n,)  # one MLP per layer, or one per expert
    layers = LayerParams(
        attn_norm=(n, e), wq=(n, e, hd), wk=(n, e, kd), wv=(n, e, kd),
        bq=(n, hd) if bias else None, bk=(n, kd) if bias else None,
        bv=(n, kd) if bias else None, wo=(n, hd, e), mlp_norm=(n, e),
        w_gate=(*per, e, f), w_up=(*per, e, f), w_down=(*per, f, e), q_norm=qk, k_norm=qk,
        router=(n, e, x) if cfg.moe else None, **dict.fromkeys(
            ("post_attn_norm", "post_mlp_norm"), (n, e) if cfg.arch == "gemma3" else None))
    lm_head = None if cfg.tie_word_embeddings else (e, v)
    return Params(embed=(v, e), layers=layers, final_norm=(e,), lm_head=lm_head)


def normalize_head(lm_head: jax.Array) -> jax.Array:
    """A NormHead's weight for inference: lm_head [E, V] with each vocabulary row (a
    column here) divided by its L2 norm over E (floored at 1e-12, as torch's normalize),
    computed in float32 and cast back.

    Baichuan2 normalises the weight on every call in training and once, on the first
    call, in inference. Normalising is a pure function of the weight, which inference
    never changes, so normalising once when the weights are loaded gives the same
    logits as normalising per call (and compute_logits stays a plain matmul).
    """
    w = lm_head.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(w * w, axis=0, keepdims=True))
    return (w / jnp.maximum(norm, 1e-12)).astype(lm_head.dtype)


def _fused_qkv(h: jax.Array, lp: LayerParams, linear: LinearFn) -> jax.Array:
    """[..., (H+2K)*D]: the fused projection (`lp.wq` holds [wq | wk | wv]) with its bias."""
    qkv = linear(h, lp.wq)
    return qkv if lp.bq is None else qkv + lp.bq


def _qkv(h: jax.Array, lp: LayerParams, cfg: ModelConfig, linear: LinearFn, fused: bool,
         shards: int = 1) -> tuple[jax.Array, ...]:
    """(q [..., H, D], k [..., K, D], v [..., K, D]) before RoPE."""
    lead, d = h.shape[:-1], cfg.head_dim
    if fused:  # [wq | wk | wv], or per shard s [wq_s | wk_s | wv_s] (Params.shards)
        qkv = _fused_qkv(h, lp, linear)
        if shards > 1:
            qkv = qkv.reshape(*lead, shards, -1)
        hd, kd = cfg.num_heads * d // shards, cfg.num_kv_heads * d // shards
        q, k, v = qkv[..., :hd], qkv[..., hd : hd + kd], qkv[..., hd + kd :]
    else:
        q, k, v = linear(h, lp.wq), linear(h, lp.wk), linear(h, lp.wv)
        if lp.bq is not None:
            q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    return (q.reshape(*lead, cfg.num_heads, d), k.reshape(*lead, cfg.num_kv_heads, d),
            v.reshape(*lead, cfg.num_kv_heads, d))


def _mlp(h: jax.Array, lp: LayerParams, linear: LinearFn, col_linear: LinearFn, fused: bool,
         cfg: ModelConfig, experts_fn: ExpertsFn | None) -> jax.Array:
    if lp.router is not None:  # mixture of experts (models.moe)
        return moe_mlp(h, lp.router, lp.w_gate, lp.w_up, lp.w_down, cfg, experts_fn)
    if fused:  # [w_gate | w_up] (per shard: see Params.shards)
        act = col_linear(h, lp.w_gate, f"{cfg.hidden_act}_mul")
    else:
        act = gated(col_linear(h, lp.w_gate), col_linear(h, lp.w_up), cfg.hidden_act)
    return linear(act, lp.w_down)


def forward(params: Params, cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array,
            cache: Any, attn_fn: AttnFn, linear: LinearFn = dense_linear,
            qkv_attn_fn: QKVAttnFn | None = None, col_linear: LinearFn | None = None,
            experts_fn: ExpertsFn | None = None) -> tuple[jax.Array, Any]:
    """Run the decoder on token_ids/positions [...]; returns (hidden [..., E] normed, cache).

    `params.layout` (checked by `check_layout`, at trace time) decides how the layers run:
    "stacked" under lax.scan with `cache` in the carry; "per_layer" and "fused" unrolled,
    which on GPU avoids slicing each layer's weights out of the stack (a copy per layer
    per step) and the while loop's per-iteration host round trip. Attention (and any KV
    cache write) is delegated to `attn_fn(q, k, v, cache, layer)`, the layers' matmuls to
    `linear` (default: XLA's). With layout "fused" and `qkv_attn_fn` given, attention goes
    to `qkv_attn_fn` instead: it takes the projection before RoPE and rotates Q and K
    itself (one kernel for the rotation and the KV write).

    `col_linear` (default `linear`) runs the column-parallel matmuls, Q/K/V and gate/up,
    `linear` the others (wo, w_down). Params fused over shards (`Params.shards` > 1) need
    a `col_linear` that applies "silu_mul" within each shard's block (a per-shard
    function, e.g. under shard_map): ValueError without one.

    A mixture of experts runs its experts through `experts_fn` (default models.moe's; one
    per device under tensor parallelism, required by params fused over shards).

    An ALiBi model (`cfg.alibi`) rotates nothing: its attention adds the bias, with the
    slopes of `models.alibi.model_slopes(cfg)`, which `attn_fn` must apply (the engine's
    step and models.reference's attention do). `qkv_attn_fn` (RoPE fused into the KV
    write) is RoPE-only: ValueError if given for an ALiBi model.
    """
    check_layout(params)
    if cfg.alibi and qkv_attn_fn is not None:
        raise ValueError("qkv_attn_fn applies RoPE; an ALiBi model takes attn_fn only")
    if params.shards > 1 and col_linear is None:
        raise ValueError(f"params fused over {params.shards} shards need a col_linear")
    if params.shards > 1 and cfg.moe and experts_fn is None:
        raise ValueError(f"experts fused over {params.shards} shards need an experts_fn")
    x = embed_tokens(params.embed, cfg, token_ids)
    body = functools.partial(_layer, cfg=cfg, positions=positions, inv_freq=layer_inv_freqs(cfg),
                             attn_fn=attn_fn, linear=linear, qkv_attn_fn=qkv_attn_fn,
                             fused=is_fused(params), shards=params.shards,
                             col_linear=col_linear or linear, experts_fn=experts_fn)
    if params.layout == "stacked":
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (params.layers, layer_ids))
    else:
        for i, lp in enumerate(params.layers):
            (x, cache), _ = body((x, cache), (lp, jnp.int32(i)))
    return rms_norm(x, params.final_norm, cfg.rms_norm_eps), cache


def _layer(carry: tuple[jax.Array, Any], xs: tuple[LayerParams, jax.Array], *, cfg: ModelConfig,
           positions: jax.Array, inv_freq: jax.Array, attn_fn: AttnFn, linear: LinearFn,
           qkv_attn_fn: QKVAttnFn | None, fused: bool, shards: int, col_linear: LinearFn,
           experts_fn: ExpertsFn | None):
    x, cache = carry
    lp, layer = xs
    inv_freq = inv_freq[layer] if inv_freq.ndim == 2 else inv_freq  # (per-layer bases)
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    if fused and qkv_attn_fn is not None:
        qkv = qk_norm_fused(_fused_qkv(h, lp, col_linear), lp.q_norm, lp.k_norm, cfg.eps_qk,
                            cfg.num_heads, cfg.num_kv_heads, shards)  # (before its RoPE)
        out, cache = qkv_attn_fn(qkv.reshape(-1, qkv.shape[-1]), positions.reshape(-1),
                                 inv_freq, cache, layer)  # (out [T, H, D], reshaped below)
    else:
        q, k, v = _qkv(h, lp, cfg, col_linear, fused, shards)
        q, k = qk_norm(q, k, lp.q_norm, lp.k_norm, cfg.eps_qk)
        if not cfg.alibi:
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out, cache = attn_fn(q, k, v, cache, layer)
    attn = linear(out.astype(x.dtype).reshape(*x.shape[:-1], -1), lp.wo)
    x = x + post_norm(attn, lp.post_attn_norm, cfg.rms_norm_eps)
    mlp = _mlp(rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps), lp, linear, col_linear, fused, cfg,
               experts_fn)
    x = x + post_norm(mlp, lp.post_mlp_norm, cfg.rms_norm_eps)
    return (x, cache), None


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> logits [..., V] in float32 (tied embeddings when lm_head is None;
    a NormHead's lm_head is stored normalised, see `normalize_head`)."""
    if params.lm_head is None:
        return jnp.einsum("...e,ve->...v", hidden, params.embed,
                          preferred_element_type=jnp.float32)
    return jnp.einsum("...e,ev->...v", hidden, params.lm_head,
                      preferred_element_type=jnp.float32)

