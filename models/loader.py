"""`load`: one entry point for HF checkpoints, GGUF files, the embedded model and dummy presets."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import PRESETS, ModelConfig
from models.fetch import EMBEDDED, fetch_embedded, snapshot
from models.gguf_loader import gguf_config, load_gguf, open_gguf
from models.layout import param_shardings
from models.llama import Params
from models.safetensors_loader import load_hf_checkpoint, read_hf_config
from models.weights import init_params

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEFAULT_MODEL = "smollm2-135m"
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32", "fp16": "float16"}
_SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float16)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """Device weights, their config, the tokenizer (None if the checkpoint has none), a name."""

    params: Params
    config: ModelConfig
    tokenizer: Any
    name: str


def load(model: str | os.PathLike = DEFAULT_MODEL, dtype: Any = "bfloat16",
         load_format: str = "auto", *, tokenizer: str | os.PathLike | None = None,
         seed: int = 0, mesh: Mesh | None = None) -> LoadedModel:
    """Load a model for inference.

    model: a HF checkpoint directory (config.json + *.safetensors, sharded or not), a .gguf
      file (or a directory holding one), a hub id such as "HuggingFaceTB/SmolLM2-135M", the
      embedded "smollm2-135m", or with load_format="dummy" a preset name from PRESETS (or a
      checkpoint directory / ModelConfig) for random weights created on device.
    dtype: "bfloat16"/"bf16", "float32"/"fp32" (or "float16"), or a jnp dtype.
    load_format: "auto", "safetensors", "gguf" or "dummy".
    tokenizer: optional path or hub id of a tokenizer, overriding the checkpoint's.
    seed: PRNG seed for dummy weights.
    mesh: optional device mesh with a "tp" axis; weights are then sharded for tensor
      parallelism (see param_partition_specs).

    Baichuan2 directories (safetensors; its NormHead and W_pack are mapped, see
    models.safetensors_loader) load with no tokenizer unless `tokenizer` is given: theirs
    is a sentencepiece `tokenizer.model` behind the remote-code class `BaichuanTokenizer`
    (named in tokenizer_config.json's auto_map), which transformers' AutoTokenizer loads
    only with trust_remote_code, and jprefix runs no checkpoint code. Pass `tokenizer` (a
    directory AutoTokenizer loads, e.g. one holding a tokenizer.json converted from
    tokenizer.model) or give prompts as token ids.
    """
    dt = _parse_dtype(dtype)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    if load_format == "dummy":
        return _load_dummy(model, dt, tokenizer, seed, mesh)
    path, name = _resolve(model, load_format)
    is_gguf = load_format == "gguf" or path.suffix == ".gguf" or (
        path.is_dir() and load_format == "auto" and not (path / "config.json").exists()
        and len(list(path.glob("*.gguf"))) == 1)
    if is_gguf:
        if path.is_dir():
            path = _single_gguf(path)
        gguf = open_gguf(path)  # (read once: config, weights and tokenizer)
        params, cfg = load_gguf(gguf, dt, _shardings(mesh, gguf_config(gguf, path)))
        tok = _tokenizer(tokenizer) if tokenizer else _gguf_tokenizer(path, gguf.fields)
    else:
        if not path.is_dir():
            raise ValueError(f"{path}: expected a checkpoint directory or a .gguf file")
        params, cfg = load_hf_checkpoint(path, dt, _shardings(mesh, path))
        tok = _tokenizer(tokenizer or (None if cfg.arch == "baichuan" else _dir_tokenizer(path)))
    return LoadedModel(params=params, config=cfg, tokenizer=tok, name=name)


def model_config(model: str | os.PathLike | ModelConfig, load_format: str = "auto"
                 ) -> ModelConfig:
    """The config `load(model, load_format=...)` would use, without loading any weights."""
    if load_format == "dummy":
        return _dummy_config(model)
    path, _ = _resolve(model, load_format)
    if path.is_dir() and not (path / "config.json").exists():
        path = _single_gguf(path)
    return _config_of(path)


def _parse_dtype(dtype: Any) -> jnp.dtype:
    if isinstance(dtype, str):
        dtype = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"unknown dtype {dtype!r}; use 'bfloat16' or 'float32'") from e
    if dt not in [jnp.dtype(d) for d in _SUPPORTED_DTYPES]:
        raise ValueError(f"unsupported dtype {dt}; use 'bfloat16' or 'float32'")
    return dt


def _resolve(model: str | os.PathLike, load_format: str) -> tuple[Path, str]:
    """(local path, display name), fetching the embedded model or a hub snapshot if needed."""
    path = Path(model).expanduser()
    if path.exists():
        return path, path.name
    spec = os.fspath(model)
    if spec in EMBEDDED:
        return fetch_embedded(spec), spec
    if spec in PRESETS:
        raise FileNotFoundError(f"{spec!r} is an architecture preset, not a checkpoint; "
                                "pass load_format='dummy' for random weights")
    if _HUB_ID.match(spec) and load_format != "gguf":
        return snapshot(spec), spec
    raise FileNotFoundError(f"{spec}: no such file or directory, and not a known model name "
                            f"(embedded: {sorted(EMBEDDED)})")


def _single_gguf(directory: Path) -> Path:
    found = sorted(directory.glob("*.gguf"))
    if len(found) != 1:
        raise ValueError(f"{directory}: expected exactly one .gguf file, found {len(found)}")
    return found[0]


def _dummy_config(model: Any) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    if Path(model).is_dir():
        return read_hf_config(Path(model))
    if model not in PRESETS:
        raise ValueError(f"unknown preset {model!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[model]


def _load_dummy(model: Any, dtype: jnp.dtype, tokenizer: Any, seed: int,
                mesh: Mesh | None) -> LoadedModel:
    cfg = _dummy_config(model)
    name = model if isinstance(model, str) else f"dummy-{cfg.arch}"
    out = _shardings(mesh, cfg)
    make = jax.jit(init_params, static_argnums=(0, 2), out_shardings=out)
    params = make(cfg, jax.random.key(seed), dtype)  # created on device, no host copy
    return LoadedModel(params, cfg, _tokenizer(tokenizer) if tokenizer else None, name)


def _shardings(mesh: Mesh | None, cfg_or_path: Any) -> Params | None:
    if mesh is None:
        return None
    cfg = cfg_or_path if isinstance(cfg_or_path, ModelConfig) else _config_of(cfg_or_path)
    return param_shardings(cfg, mesh)


def _config_of(path: Path) -> ModelConfig:
    if path.is_dir() and (path / "config.json").exists():
        return read_hf_config(path)
    path = _single_gguf(path) if path.is_dir() else path
    return gguf_config(open_gguf(path), path)


def _dir_tokenizer(directory: Path) -> Path | None:
    return directory if any((directory / f).exists() for f in _TOKENIZER_FILES) else None


def _tokenizer(source: str | os.PathLike | None) -> Any:
    if source is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(source))


def _gguf_tokenizer(path: Path, fields: dict[str, Any]) -> Any:
    from models.gguf_tokenizer import gguf_tokenizer

    return gguf_tokenizer(path, fields)
