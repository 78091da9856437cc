"""Hugging Face checkpoint directories: config.json + *.safetensors (single or sharded).

Llama, Mistral, Qwen2 and Baichuan2 name their tensors alike, except that Baichuan2 packs
Q/K/V into one `self_attn.W_pack.weight` [3E, E] (rows: q, then k, then v) and its
`lm_head.weight` is a NormHead's, whose rows are normalised here once (see
`models.llama.normalize_head`). Qwen3's q/k norms are `self_attn.q_norm` / `k_norm`; a
mixture of experts saves one tensor per expert (Mixtral: `block_sparse_moe.experts.{j}.w1`
(gate), `w3` (up), `w2` (down) and the router `block_sparse_moe.gate`; Qwen3-MoE:
`mlp.experts.{j}.gate_proj` / `up_proj` / `down_proj` and `mlp.gate`), which are read
and stacked on the expert axis. PyTorch `.bin` checkpoints (what the Baichuan2 repositories
ship) are not read: convert them to safetensors first.

An fp8 checkpoint (`models.config.fp8_checkpoint`) stores linear weights as F8_E4M3
beside a float `<name>_scale` (or DeepSeek-style `<name>_scale_inv`) of one value, one
per output row, or one per [b0, b1] block; each is read dequantised (float32, value times
its scale) and the engine quantises it again per output channel (`quantization="fp8"`),
which gives back a per-channel checkpoint's fp8 values.

The safetensors format is read directly (8-byte header length, JSON header, raw data) through a
read-only memory map, so tensors are paged in one at a time and truncation is detected from
the header's offsets before any tensor is touched.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
from jax import numpy as jnp

from models.config import ModelConfig
from models.fp8_linear import FP8
from models.llama import Params
from models.weights import build_params

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": FP8,
}

_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
              "lm_head": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
# mixture of experts: arch -> (router name, expert j's name per MLP field)
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", {
        "w_gate": "block_sparse_moe.experts.{j}.w1.weight",
        "w_up": "block_sparse_moe.experts.{j}.w3.weight",
        "w_down": "block_sparse_moe.experts.{j}.w2.weight"}),
    "qwen3_moe": ("mlp.gate.weight", {
        "w_gate": "mlp.experts.{j}.gate_proj.weight", "w_up": "mlp.experts.{j}.up_proj.weight",
        "w_down": "mlp.experts.{j}.down_proj.weight"}),
}


_W_PACK = "self_attn.W_pack.weight"
_PACKED = ("wq", "wk", "wv")  # W_pack's row blocks, in order


def hf_tensor_name(field: str, layer: int | None, arch: str = "llama",
                   expert: int | None = None) -> str:
    """The HF state-dict name of a Params field (at `layer` for per-layer fields); for
    Baichuan2's wq/wk/wv, the `W_pack` tensor that holds them; for a mixture of experts'
    router and MLP fields, its router's or `expert`'s tensor."""
    if layer is None:
        return _TOP_NAMES[field]
    if arch == "baichuan" and field in _PACKED:
        return f"model.layers.{layer}.{_W_PACK}"
    if arch in _MOE_NAMES and (field == "router" or field in _MOE_NAMES[arch][1]):
        router, experts = _MOE_NAMES[arch]
        name = router if field == "router" else experts[field].format(j=expert)
        return f"model.layers.{layer}.{name}"
    return f"model.layers.{layer}.{_LAYER_NAMES[field]}"


def _baichuan_tensor(cfg: ModelConfig, field: str, name: str, arr: np.ndarray,
                     where: str) -> np.ndarray:
    """A Baichuan2 tensor as the Llama field `field`: wq/wk/wv are row blocks of W_pack
    [3E, E]; a NormHead's lm_head [V, E] comes back with unit rows (float32)."""
    if name.endswith(_W_PACK):
        e = cfg.hidden_size
        if arr.shape != (3 * e, e):
            raise ValueError(f"{where} has shape {tuple(arr.shape)}, but the config expects "
                             f"{(3 * e, e)}")
        i = _PACKED.index(field)
        return arr[i * e:(i + 1) * e]
    if field == "lm_head" and cfg.norm_head:
        w = np.asarray(arr, np.float32)
        return w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12)
    return arr


class SafetensorsFile:
    """One .safetensors file: parsed header and a lazily opened memory map."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise ValueError(f"{path}: truncated safetensors file: header claims {n} bytes "
                                 f"but the file has {size}")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise ValueError(f"{path}: corrupt safetensors header: {e}") from e
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.tensors: dict[str, dict[str, Any]] = header
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
        if self.data_start + end > size:
            raise ValueError(f"{path}: truncated safetensors file: tensor data needs "
                             f"{self.data_start + end} bytes but the file has {size}")
        self._map: np.memmap | None = None

    def get(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._map[self.data_start + begin:self.data_start + end]
        return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def read_hf_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (not a Hugging Face checkpoint)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e
    try:
        return ModelConfig.from_hf_config(raw)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e


def _shard_paths(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [directory / name for name in names]
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"{index}: lists shard {p.name}, which is missing")
        return paths
    paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        pickled = sorted(p.name for p in directory.glob("pytorch_model*.bin"))
        if pickled:  # (what the Baichuan2 repositories ship)
            raise FileNotFoundError(
                f"{directory}: no *.safetensors files; PyTorch checkpoints ({', '.join(pickled)})"
                " are not read: convert them to safetensors first")
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    return paths


def open_tensors(directory: Path) -> dict[str, SafetensorsFile]:
    """Map every tensor name in the checkpoint to the file holding it."""
    where: dict[str, SafetensorsFile] = {}
    for path in _shard_paths(directory):
        shard = SafetensorsFile(path)
        where.update(dict.fromkeys(shard.tensors, shard))
    return where


def dequantize_fp8(w8: np.ndarray, scale: np.ndarray, where: str) -> np.ndarray:
    """An fp8 [out, in] tensor times its scale: a scalar ([] or [1]), per output row
    ([out] or [out, 1]) or per block ([ceil(out / b0), ceil(in / b1)]); float32."""
    out, inn = w8.shape
    scale = np.asarray(scale, np.float32)
    if scale.size == 1:
        s = scale.reshape(())
    elif scale.shape in ((out,), (out, 1)):
        s = scale.reshape(out, 1)
    elif scale.ndim == 2:
        b0, b1 = -(-out // scale.shape[0]), -(-inn // scale.shape[1])
        if (-(-out // b0), -(-inn // b1)) != scale.shape:
            raise ValueError(f"{where}: block scales {scale.shape} do not tile {w8.shape}")
        s = np.repeat(np.repeat(scale, b0, axis=0), b1, axis=1)[:out, :inn]
    else:
        raise ValueError(f"{where}: scale of shape {scale.shape} for a {w8.shape} weight "
                         "(one value, one per output row, or one per block)")
    return w8.astype(np.float32) * s


def load_hf_checkpoint(directory: Path, dtype: Any, shardings: Params | None = None,
                       ) -> tuple[Params, ModelConfig]:
    """Read a HF checkpoint directory into device Params of `dtype`."""
    cfg = read_hf_config(directory)
    tensors = open_tensors(directory)

    def get(field: str, layer: int | None) -> tuple[np.ndarray, str]:
        if cfg.moe and field in _MOE_NAMES[cfg.arch][1] and layer is not None:
            names = [hf_tensor_name(field, layer, cfg.arch, j) for j in range(cfg.num_experts)]
            arrs = [read(field, name)[0] for name in names]
            shapes = {a.shape for a in arrs}
            where = f"{directory}: tensors {names[0]} .. {names[-1]}"
            if len(shapes) > 1:
                raise ValueError(f"{where}: experts of different shapes {sorted(shapes)}")
            return np.stack(arrs), where
        return read(field, hf_tensor_name(field, layer, cfg.arch))

    def read(field: str, name: str) -> tuple[np.ndarray, str]:
        if name not in tensors:
            raise ValueError(f"{directory}: missing tensor {name}")
        arr, where = tensors[name].get(name), f"{tensors[name].path}: tensor {name}"
        if arr.dtype == FP8:
            scale = next((n for n in (name + "_scale", name + "_scale_inv") if n in tensors),
                         None)
            if scale is None or arr.ndim != 2:
                raise ValueError(f"{where} is fp8 {tuple(arr.shape)} without its "
                                 f"{name}_scale tensor")
            arr = dequantize_fp8(arr, tensors[scale].get(scale), where)
        if cfg.arch == "baichuan":
            arr = _baichuan_tensor(cfg, field, name, arr, where)
        return arr, where

    return build_params(cfg, get, dtype, shardings), cfg
