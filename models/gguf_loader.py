"""GGUF files (llama.cpp): config from metadata, tensors dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of Q/K projections of the `llama` architecture for
its interleaved RoPE; we undo it so the weights use Hugging Face's rotate_half layout.
Qwen3 (`qwen3`) adds q/k norms; a mixture of experts (`qwen3moe`, and Mixtral, which
llama.cpp files as `llama` with `llama.expert_count`) stores each layer's experts merged,
`ffn_{gate,up,down}_exps` ([X, out, in] once the dimensions are reversed), and its router
`ffn_gate_inp`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from models.config import ModelConfig
from models.llama import Params
from models.weights import build_params

_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
_TOP_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
              "lm_head": "output.weight"}
_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
    "wv": "attn_v.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight", "w_down": "ffn_down.weight", "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight", "router": "ffn_gate_inp.weight",
}
_EXPERT_NAMES = {"w_gate": "ffn_gate_exps.weight", "w_up": "ffn_up_exps.weight",
                 "w_down": "ffn_down_exps.weight"}


def gguf_tensor_name(field: str, layer: int | None, moe: bool = False) -> str:
    if layer is None:
        return _TOP_NAMES[field]
    names = _EXPERT_NAMES if moe and field in _EXPERT_NAMES else _LAYER_NAMES
    return f"blk.{layer}.{names[field]}"


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader, with library errors on truncated/corrupt files re-raised as ValueError."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({e})") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path}: truncated GGUF file: tensor {t.name} ends past the "
                             f"end of the file ({size} bytes)")
    return reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata (`<arch>.block_count`, ... and tokenizer ids)."""
    gguf_arch = _field(reader, "general.architecture")
    if gguf_arch not in _ARCHS:
        raise ValueError(f"{path}: unknown GGUF architecture {gguf_arch!r}; "
                         f"supported: {sorted(_ARCHS)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: GGUF rope frequency factors (llama3 rope scaling) "
                         "are not supported; load the Hugging Face checkpoint instead")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{gguf_arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {gguf_arch}.{key}")
        return value

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    scaling = None
    if _field(reader, f"{gguf_arch}.rope.scaling.type") == "linear":
        scaling = (("factor", float(meta("rope.scaling.factor"))), ("rope_type", "linear"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    experts = _field(reader, f"{gguf_arch}.expert_count", 0) or 0
    arch = "mixtral" if gguf_arch == "llama" and experts else _ARCHS[gguf_arch]
    cfg = ModelConfig(
        arch=arch,
        vocab_size=meta("vocab_size", len(tokens) if tokens is not None else None),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv", heads),
        head_dim=meta("attention.key_length", hidden // heads),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=meta("context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )
    if arch == "qwen3_moe":
        cfg = dataclasses.replace(cfg, intermediate_size=meta("expert_feed_forward_length"))
    return dataclasses.replace(
        cfg, qk_norm=arch in ("qwen3", "qwen3_moe"), num_experts=experts,
        num_experts_per_tok=meta("expert_used_count") if experts else 0,
        norm_topk_prob=True)  # (llama.cpp renormalises these architectures' top-k always)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation: per head, interleaved pairs -> two halves."""
    rows = w.shape[0] // n_head // 2
    return w.reshape(n_head, rows, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, dtype: Any, shardings: Params | None = None,
              ) -> tuple[Params, ModelConfig]:
    """Dequantize a GGUF file into device Params of `dtype`, one tensor at a time."""
    import gguf

    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    unpermute = {"wq": cfg.num_heads, "wk": cfg.num_kv_heads, "bq": cfg.num_heads,
                 "bk": cfg.num_kv_heads} if cfg.arch in ("llama", "mixtral") else {}

    def get(field: str, layer: int | None) -> tuple[np.ndarray, str]:
        name = gguf_tensor_name(field, layer, cfg.moe)
        if name not in tensors:
            raise ValueError(f"{path}: missing tensor {name}")
        t = tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except (ValueError, NotImplementedError) as e:
            raise ValueError(f"{path}: cannot dequantize {name} ({t.tensor_type.name}): {e}") from e
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
        if field in unpermute:
            w = unpermute_rope_rows(w, unpermute[field])
        return w, f"{path}: tensor {name}"

    return build_params(cfg, get, dtype, shardings), cfg
