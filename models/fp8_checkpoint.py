"""Which fp8 checkpoints load: a config.json `quantization_config` read as the quantisation
the safetensors loader dequantises (`models.config.ModelConfig.checkpoint_quantization`).
"""

from __future__ import annotations

from typing import Any

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
