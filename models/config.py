"""Static model configuration: a frozen, hashable dataclass usable as a jit static argument."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.config_families import qk_norm_and_expert_fields

ARCHS = ("llama", "mistral", "qwen2", "baichuan", "qwen3", "mixtral", "qwen3_moe")
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "BaichuanForCausalLM": "baichuan",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
ROPE_TYPES = ("default", "llama3", "linear")
POSITION_EMBEDDINGS = ("rope", "alibi")
# Baichuan2's vocabulary; Baichuan2 (unlike Baichuan 1, vocabulary 64,000) has a NormHead
BAICHUAN2_VOCAB_SIZE = 125696


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (E hidden, F mlp, H/K heads, D head dim).

    `position_embedding` "rope" rotates Q and K; "alibi" (Baichuan2-13B) applies no rotation
    and biases attention logits by `slope_h * (k_pos - q_pos)` instead, with the slopes of
    `models.alibi.alibi_slopes(num_heads)`. `norm_head` (Baichuan2's NormHead): the logits
    use lm_head rows L2-normalised over E; `Params.lm_head` holds them normalised (the
    loaders and init_params normalise once). `checkpoint_quantization` "fp8": the
    checkpoint stores its linear weights in fp8 with scales (`fp8_checkpoint`); the
    loader dequantises them and the engine serves with `quantization="fp8"`.

    `qk_norm`: q and k RMS-normalised per head before RoPE (models.norms), epsilon
    `qk_norm_eps` (None: `rms_norm_eps`). `num_experts` > 0: every layer's MLP is that
    many experts of F = `intermediate_size`, `num_experts_per_tok` per token, weighted by
    the top-k of the router's softmax, renormalised if `norm_topk_prob` (models.moe).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or sorted (key, value) items of HF's rope_scaling dict, e.g. (("factor", 8.0),
    # ..., ("rope_type", "llama3")): a tuple so the config stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    position_embedding: str = "rope"
    norm_head: bool = False
    checkpoint_quantization: str | None = None
    qk_norm: bool = False
    qk_norm_eps: float | None = None
    num_experts: int = 0  # (0: a dense MLP)
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r}; supported: {ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}"
            )
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"unknown position_embedding {self.position_embedding!r}; "
                             f"supported: {POSITION_EMBEDDINGS}")
        if self.head_dim % 2 and not self.alibi:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.norm_head and self.tie_word_embeddings:
            raise ValueError("norm_head=True with tie_word_embeddings=True: a NormHead is "
                             "its own lm_head")
        _check_rope_type(self.rope_scaling_dict.get("rope_type", "default"))
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts={self.num_experts} with num_experts_per_tok="
                             f"{self.num_experts_per_tok}: need 1 <= top-k <= experts")

    @property
    def moe(self) -> bool:
        """True for mixture-of-experts models (every layer's MLP is routed)."""
        return self.num_experts > 0

    @property
    def eps_qk(self) -> float:
        """The q/k norms' epsilon (`qk_norm_eps`, else `rms_norm_eps`)."""
        return self.rms_norm_eps if self.qk_norm_eps is None else self.qk_norm_eps

    @property
    def alibi(self) -> bool:
        """True for ALiBi models (no RoPE; linear attention biases)."""
        return self.position_embedding == "alibi"

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build a config from a Hugging Face config.json dict (transformers 4 or 5 layout).
        A `quantization_config` must describe fp8 weights (`fp8_checkpoint`)."""
        quant = fp8_checkpoint(hf["quantization_config"]) if hf.get("quantization_config") \
            else None
        cfg = cls._from_hf(hf)
        return cfg if quant is None else dataclasses.replace(cfg, checkpoint_quantization=quant)

    @classmethod
    def _from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        arch = _hf_arch(hf)
        if arch == "baichuan":
            return _from_baichuan_config(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
        if hf.get("mlp_bias", False):
            raise ValueError("unsupported mlp_bias=True")
        heads = hf["num_attention_heads"]
        theta, scaling = _hf_rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return dataclasses.replace(cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        ), **qk_norm_and_expert_fields(hf, arch))


from_hf_config = ModelConfig.from_hf_config

_FLOAT_PROJECT = ("load its float (bf16/fp16/fp32) checkpoint and pass quantization='fp8' "
                  "to quantise it at load time")


def fp8_checkpoint(quant: Any) -> str:
    """"fp8" for a config.json `quantization_config` whose linear weights are float8 e4m3
    with float scales, which the safetensors loader dequantises (per tensor, per output
    channel, or per block: its `weight_scale` / `weight_scale_inv` tensors): llm-compressor's
    compressed-tensors "float-quantized" format with 8-bit float weights, and the "fp8"
    method (AutoFP8's per-tensor scales, or `weight_block_size` blocks). The engine then
    quantises activations per token at run time, also where the checkpoint carries static
    input scales, and picks its KV cache format by `kv_cache_dtype`, not by a
    `kv_cache_scheme`. Else ValueError naming what is not supported."""
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method == "fp8":
        return "fp8"
    if method != "compressed-tensors":
        raise ValueError(f"the checkpoint is quantised with quant_method={method!r}, which "
                         f"jprefix does not load (only fp8 weights: 'fp8' or "
                         f"'compressed-tensors' float-quantized): {_FLOAT_PROJECT}")
    if quant.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {quant.get('format')!r} is not "
                         f"supported (only 'float-quantized' fp8 weights): {_FLOAT_PROJECT}")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise ValueError(f"compressed-tensors quantization_config has no config_groups: "
                         f"{_FLOAT_PROJECT}")
    for name, group in groups.items():
        w = group.get("weights") or {}
        if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("strategy") not in (
                "tensor", "channel", "block"):
            raise ValueError(
                f"compressed-tensors group {name!r} has weights {w.get('type')!r} "
                f"{w.get('num_bits')}-bit by {w.get('strategy')!r}: only 8-bit float "
                f"weights per tensor, channel or block load; {_FLOAT_PROJECT}")
    return "fp8"


def _hf_arch(hf: dict[str, Any]) -> str:
    for name in hf.get("architectures") or ():
        if name not in _HF_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {name!r}; supported: {sorted(_HF_ARCHITECTURES)}"
            )
    model_type = hf.get("model_type")
    if model_type not in ARCHS:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {ARCHS}")
    return model_type


def _from_baichuan_config(hf: dict[str, Any]) -> ModelConfig:
    """Baichuan2's config.json (remote-code `BaichuanConfig`), 7B or 13B.

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
    return ModelConfig(
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


def _hf_rope(hf: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling items) from `rope_parameters` (v5) or `rope_scaling` (v4)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = _check_rope_type(params.pop("rope_type", params.pop("type", "default")))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, tuple(sorted(params.items()))


def _check_rope_type(rope_type: str) -> str:
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {ROPE_TYPES}")
    return rope_type


def _llama3_scaling(factor: float, original: int) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted({
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": original,
    }.items()))


def _tiny(arch: str, **kw: Any) -> ModelConfig:
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    return ModelConfig(arch=arch, **{**shape, **kw})


PRESETS: dict[str, ModelConfig] = {
    "llama-2-7b": ModelConfig("llama", 32000, 4096, 11008, 32, 32, 32, 128),
    "llama-2-13b": ModelConfig("llama", 32000, 5120, 13824, 40, 40, 40, 128),
    "llama-2-70b": ModelConfig("llama", 32000, 8192, 28672, 80, 64, 8, 128),
    "llama-3-8b": ModelConfig(
        "llama", 128256, 4096, 14336, 32, 32, 8, 128, rope_theta=500000.0,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "llama-3.1-8b": ModelConfig(
        "llama", 128256, 4096, 14336, 32, 32, 8, 128, rope_theta=500000.0,
        rope_scaling=_llama3_scaling(8.0, 8192), max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "mistral-7b": ModelConfig("mistral", 32000, 4096, 14336, 32, 32, 8, 128,
                              max_position_embeddings=32768),
    "qwen2-7b": ModelConfig(
        "qwen2", 152064, 3584, 18944, 28, 28, 4, 128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=32768, attention_bias=True, bos_token_id=151643,
        eos_token_ids=(151643, 151645)),
    "smollm2-135m": ModelConfig(
        "llama", 49152, 576, 1536, 30, 9, 3, 64, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny-llama": _tiny("llama"),
    # long context, for CPU runs of the benchmarks' token layouts (e.g. 1024-token prefixes)
    "tiny-llama-4k": _tiny("llama", max_position_embeddings=4096),
    "tiny-llama3": _tiny("llama", rope_theta=500000.0, rope_scaling=_llama3_scaling(8.0, 64)),
    "tiny-mistral": _tiny("mistral", rope_theta=1e6),
    "tiny-qwen2": _tiny("qwen2", rms_norm_eps=1e-6, attention_bias=True),
    "baichuan2-7b": ModelConfig(
        "baichuan", BAICHUAN2_VOCAB_SIZE, 4096, 11008, 32, 32, 32, 128, rms_norm_eps=1e-6,
        norm_head=True),
    "baichuan2-13b": ModelConfig(
        "baichuan", BAICHUAN2_VOCAB_SIZE, 5120, 13696, 40, 40, 40, 128, rms_norm_eps=1e-6,
        position_embedding="alibi", norm_head=True),
    # Baichuan2's vocabulary (so a checkpoint of these shapes is detected as Baichuan2);
    # 6 heads: ALiBi slopes of a head count that is not a power of 2, as the 13B's 40
    "tiny-baichuan2-alibi": _tiny("baichuan", vocab_size=BAICHUAN2_VOCAB_SIZE, hidden_size=48,
                                  num_heads=6, num_kv_heads=6, head_dim=8, rms_norm_eps=1e-6,
                                  position_embedding="alibi", norm_head=True),
    "tiny-baichuan2-rope": _tiny("baichuan", vocab_size=BAICHUAN2_VOCAB_SIZE, num_kv_heads=4,
                                 rms_norm_eps=1e-6, norm_head=True),
    "qwen3-8b": ModelConfig(
        "qwen3", 151936, 4096, 12288, 36, 32, 8, 128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
        qk_norm=True),
    # intermediate_size is each expert's (moe_intermediate_size); every layer is sparse
    "qwen3-30b-a3b": ModelConfig(
        "qwen3_moe", 151936, 2048, 768, 48, 32, 4, 128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
        qk_norm=True, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
    "mixtral-8x7b": ModelConfig(
        "mixtral", 32000, 4096, 14336, 32, 32, 8, 128, rope_theta=1e6,
        max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2),
    "tiny-qwen3": _tiny("qwen3", rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True),
    "tiny-mixtral": _tiny("mixtral", intermediate_size=48, num_experts=4, num_experts_per_tok=2),
    "tiny-qwen3-moe": _tiny("qwen3_moe", intermediate_size=32, rms_norm_eps=1e-6, qk_norm=True,
                            num_experts=8, num_experts_per_tok=3),
    "tiny-smollm2": _tiny("llama", hidden_size=96, num_heads=6, num_kv_heads=2,
                          tie_word_embeddings=True, rope_theta=100000.0),
}
