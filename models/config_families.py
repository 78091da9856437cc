"""The config.json fields of the families that add q/k norms or experts to a Llama (Qwen3,
Mixtral, Qwen3-MoE), as `models.config.ModelConfig` fields; what they use that jprefix does
not implement is refused by name."""

from __future__ import annotations

from typing import Any


def qk_norm_and_expert_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ModelConfig fields Qwen3 (q/k norms), Mixtral and Qwen3-MoE (experts) add to a
    Llama config; ValueError naming a config feature they use that jprefix does not
    implement (sliding-window layers, dense layers between sparse ones)."""
    if arch not in ("qwen3", "mixtral", "qwen3_moe"):
        return {}
    window = hf.get("sliding_window") or 0  # (Mixtral: a window as long as the context is none)
    if hf.get("use_sliding_window") or (
            arch == "mixtral" and window and window < hf.get("max_position_embeddings", 0)):
        key = "use_sliding_window" if arch != "mixtral" else "sliding_window"
        raise ValueError(f"unsupported {key}={hf[key]!r} ({arch}: sliding-window layers)")
    kinds = set(hf.get("layer_types") or ()) - {"full_attention"}
    if kinds:
        raise ValueError(f"unsupported layer_types {sorted(kinds)} ({arch}: only "
                         "full_attention layers)")
    out: dict[str, Any] = {"qk_norm": arch != "mixtral"}
    if arch == "mixtral":
        return {**out, "num_experts": hf["num_local_experts"],
                "num_experts_per_tok": hf["num_experts_per_tok"], "norm_topk_prob": True}
    if arch == "qwen3":
        return out
    if hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"unsupported decoder_sparse_step={hf['decoder_sparse_step']} "
                         "(qwen3_moe: dense MLP layers between sparse ones)")
    if hf.get("mlp_only_layers"):
        raise ValueError(f"unsupported mlp_only_layers={hf['mlp_only_layers']} "
                         "(qwen3_moe: dense MLP layers between sparse ones)")
    return {**out, "intermediate_size": hf["moe_intermediate_size"],
            "num_experts": hf.get("num_experts") or hf["num_local_experts"],
            "num_experts_per_tok": hf["num_experts_per_tok"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}
