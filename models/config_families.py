"""The config.json fields of the families that add q/k norms or experts to a Llama (Qwen3,
Mixtral, Qwen3-MoE), and of Baichuan2, as `models.config.ModelConfig` fields; what they
use that jprefix does not implement is refused by name."""

from __future__ import annotations

from typing import Any

# Baichuan2's vocabulary; Baichuan2 (unlike Baichuan 1, vocabulary 64,000) has a NormHead
BAICHUAN2_VOCAB_SIZE = 125696


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


def baichuan_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of Baichuan2's config.json (remote-code `BaichuanConfig`),
    7B or 13B.

    Both sizes share `model_type` "baichuan" and the class `BaichuanForCausalLM`; the
    7B's config (a RoPE model) has `max_position_embeddings` (its rotary table), the
    13B's (ALiBi) only `model_max_length`, so that key's presence picks the position
    embedding (vLLM's rule, hidden_size 4096 -> RoPE, agrees on the published configs and
    also holds for smaller test models). NormHead iff the vocabulary is Baichuan2's
    (Baichuan 1 has none). Heads are all kv heads (multi-head attention, fused `W_pack`).
    """
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
    rope = "max_position_embeddings" in hf
    heads, eos = hf["num_attention_heads"], hf.get("eos_token_id", 2)
    return dict(
        arch="baichuan", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=heads, head_dim=hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=10000.0,
        max_position_embeddings=hf["max_position_embeddings"] if rope
        else hf.get("model_max_length", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id", 1),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        position_embedding="rope" if rope else "alibi",
        norm_head=hf["vocab_size"] == BAICHUAN2_VOCAB_SIZE)
