"""Gemma 3 (text, `Gemma3ForCausalLM`) config.json -> `ModelConfig` fields (pure Python).

Gemma 3 is a Llama-shaped decoder with: sliding-window ("local") layers and full
("global") layers, every `sliding_window_pattern`-th layer global unless `layer_types`
says otherwise; two RoPE bases (local `rope_local_base_freq`, 10k; global `rope_theta`,
1M, with the config's rope scaling, e.g. linear x8); q/k norms; a norm after attention
and after the MLP besides the ones before (sandwich norms); RMSNorms that scale by
1 + w (the loader stores 1 + w, so the model's `rms_norm` applies them unchanged); the
embedding scaled by sqrt(hidden); GeGLU (`hidden_activation`, gelu with the tanh
approximation); tied embeddings; the softmax scale `query_pre_attn_scalar ** -0.5`.
Transformers 5 writes the two RoPEs as `rope_parameters[layer type]`, transformers 4
as `rope_theta`, `rope_local_base_freq` and `rope_scaling` (global only): both are read.
Logit soft-capping (attention or final) and bidirectional attention are refused by name.
"""

from __future__ import annotations

from typing import Any

from models.layer_types import FULL, SLIDING

# transformers' activation names -> the model's (`models.llama.apply_act`)
GEMMA_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
_REFUSED = ("attn_logit_softcapping", "final_logit_softcapping")


def gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Every `ModelConfig` field of a Gemma 3 text config.json; ValueError naming a
    feature we do not implement."""
    _refuse(hf)
    n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    local, (theta, scaling) = _ropes(hf)
    eos = hf.get("eos_token_id", 1)
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL
                                      for i in range(n)]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return dict(
        arch="gemma3", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=n, num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        bos_token_id=hf.get("bos_token_id", 2),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        sliding_window=hf.get("sliding_window", 4096), layer_types=tuple(types),
        rope_local_theta=local, qk_norm=True,
        hidden_act=GEMMA_ACTS[hf.get("hidden_activation", "gelu_pytorch_tanh")],
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)))


def _refuse(hf: dict[str, Any]) -> None:
    for name in _REFUSED:
        if hf.get(name) is not None:
            raise ValueError(f"Gemma 3 with {name}={hf[name]} is not supported (no logit "
                             f"soft-capping in jprefix's Gemma 3)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention=True is not supported "
                         "(causal decoding only)")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in GEMMA_ACTS:
        raise ValueError(f"unsupported hidden_activation {act!r} for Gemma 3; supported: "
                         f"{sorted(GEMMA_ACTS)}")


def _ropes(hf: dict[str, Any]) -> tuple[float, tuple[float, tuple | None]]:
    """(the local base, (the global base, the global scaling items or None)); a scaled
    local RoPE is refused."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and SLIDING in params:  # transformers 5
        glob, loc = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:  # transformers 4
        glob = dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 1e6))
        loc = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    if loc.get("rope_type", loc.get("type", "default")) != "default":
        raise ValueError(f"Gemma 3's local rope_type {loc.get('rope_type')!r} is not "
                         f"supported (only 'default')")
    theta = float(glob.pop("rope_theta", 1e6))
    kind = glob.pop("rope_type", glob.pop("type", "default"))
    scaling = None if kind == "default" else tuple(sorted({**glob, "rope_type": kind}.items()))
    return float(loc.get("rope_theta", 10000.0)), (theta, scaling)
