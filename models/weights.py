"""Assemble a Params pytree on device from per-tensor host reads, one field at a time.

Checkpoint readers expose `get(field, layer) -> (array, where)`: the tensor in Hugging Face
orientation (linears [out, in]) and "<file>: tensor <name>" for error messages. This module
checks shapes, transposes to our [in, out] layout, converts dtype while stacking layers, and
moves each field to the device before reading the next, so host memory never holds more
than one stacked field beyond the file's memory map.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.llama import LayerParams, Params, normalize_head, param_shapes

# (field name, layer index or None) -> (array in HF orientation, "<file>: tensor <name>")
TensorGetter = Callable[[str, int | None], tuple[np.ndarray, str]]

# Linears: HF stores [out, in], Params stores [in, out] (experts: [X, out, in], [X, in, out]).
_TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "router"}


def hf_shape(field: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF-orientation shape of one tensor of `field` whose Params shape is `shape`
    (a mixture of experts' weights: the experts' [out, in] stacked on a leading X)."""
    return (*shape[:-2], shape[-1], shape[-2]) if field in _TRANSPOSED else shape


class ShapeMismatchError(ValueError):
    pass


def _checked(get: TensorGetter, field: str, layer: int | None,
             shape: tuple[int, ...]) -> np.ndarray:
    arr, where = get(field, layer)
    want = hf_shape(field, shape)
    if tuple(arr.shape) != want:
        raise ShapeMismatchError(
            f"{where} ({field}) has shape {tuple(arr.shape)}, but the config expects {want}")
    return np.swapaxes(arr, -1, -2) if field in _TRANSPOSED else arr


def _stack_field(get: TensorGetter, field: str, shape: tuple[int, ...],
                 dtype: np.dtype) -> np.ndarray:
    out = np.empty(shape, dtype)
    for layer in range(shape[0]):
        out[layer] = _checked(get, field, layer, shape[1:])
    return out


def build_params(cfg: ModelConfig, get: TensorGetter, dtype: Any,
                 shardings: Params | None = None) -> Params:
    """Read every tensor through `get` into a device-resident Params of `dtype`.

    `shardings` (a Params of jax Shardings, e.g. from param_partition_specs) places each
    field; default is the default device.
    """
    np_dtype = np.dtype(dtype)
    shapes = param_shapes(cfg)

    def put(value: np.ndarray, sharding: Any) -> jax.Array:
        return jax.device_put(value, sharding) if sharding is not None else jax.device_put(value)

    def top(field: str) -> jax.Array | None:
        shape = getattr(shapes, field)
        if shape is None:
            return None
        host = _checked(get, field, None, shape).astype(np_dtype)
        return put(host, getattr(shardings, field) if shardings is not None else None)

    layer_fields = {}
    for field in LayerParams.__dataclass_fields__:
        shape = getattr(shapes.layers, field)
        if shape is None:
            layer_fields[field] = None
            continue
        host = _stack_field(get, field, shape, np_dtype)
        sharding = getattr(shardings.layers, field) if shardings is not None else None
        layer_fields[field] = put(host, sharding)
        del host
    return Params(embed=top("embed"), layers=LayerParams(**layer_fields),
                  final_norm=top("final_norm"), lm_head=top("lm_head"))


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.bfloat16) -> Params:
    """Random stacked weights (normal, std 0.02; norms 1).

    jit it with cfg and dtype static (and out_shardings) to create the weights on device.
    """
    shapes, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=_is_shape)
    keys = jax.random.split(key, len(shapes))

    def make(path: Any, shape: tuple[int, ...], k: jax.Array) -> jax.Array:
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    leaves = [make(path, shape, k) for (path, shape), k in zip(shapes, keys, strict=True)]
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    if cfg.norm_head:
        params = dataclasses.replace(params, lm_head=normalize_head(params.lm_head))
    return params
