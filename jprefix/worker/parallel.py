"""Tensor parallelism over one device mesh axis, "tp" (Megatron-style, through jit).

Weights take `models.layout.param_partition_specs` (Q/K/V and gate/up split by output,
wo and w_down by input); the KV cache is split on its kv-head axis. XLA's partitioner
inserts the all-reduces around the matmuls; attention and the KV write run per shard
under `shard_map`, each device on its own query and kv heads (heads are split in
contiguous blocks, so query head h still reads kv head h // G locally).

A model with fewer kv heads K than shards (K dividing the TP size) has each kv head
replicated TP / K times, as vLLM does: shard s keeps the one kv head its query heads read
(`tp_config`, `replicate_kv_heads`), so the step sees a model of TP kv heads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.layout import param_shardings
from models.llama import Params
from models.moe import experts

AXIS = "tp"
HEADS = PartitionSpec(None, AXIS)  # [T, H, D] activations and [L, K, N, B, D] caches
HEAD_VALUES = PartitionSpec(AXIS)  # [H]: one value per query head (ALiBi slopes)
REPLICATED = PartitionSpec()


def make_mesh(cfg: ModelConfig, tensor_parallel_size: int,
              devices: list[Any] | None = None) -> Mesh | None:
    """A 1-D "tp" mesh over the first `tensor_parallel_size` of `devices` (default: all
    of this process's, `jax.devices()`); None for 1."""
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size {tp!r} must be a positive int")
    if tp == 1:
        return None
    devices = jax.devices() if devices is None else devices
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size {tp} exceeds the {len(devices)} devices here")
    check_tp_size(cfg, tp)
    return Mesh(devices[:tp], (AXIS,))


def device_groups(data_parallel_size: int, tensor_parallel_size: int,
                  devices: list[Any] | None = None) -> list[list[Any]]:
    """Data-parallel replica i's devices: `devices[i * tp : (i + 1) * tp]` (default: this
    process's, `jax.devices()`)."""
    devices = jax.devices() if devices is None else list(devices)
    dp, tp = data_parallel_size, tensor_parallel_size
    if dp * tp > len(devices):
        raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs {dp * tp} "
                         f"devices; {len(devices)} are here")
    return [devices[i * tp:(i + 1) * tp] for i in range(dp)]


def placed_on(device: Any) -> contextlib.AbstractContextManager:
    """Arrays created in this context without a placement go to `device` (None: jax's
    default device, unchanged)."""
    return contextlib.nullcontext() if device is None else jax.default_device(device)
def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    """ValueError unless `tp` shards can split the model: it must divide the query heads
    (each shard attends with H / tp of them) and either divide the kv heads or be a
    multiple of them (then each kv head is replicated on tp / K shards)."""
    h, k = cfg.num_heads, cfg.num_kv_heads
    if tp > h:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's {h} query heads "
                         f"(each shard needs at least one)")
    if h % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {h} query "
                         f"heads; divisors of {h} work")
    if k % tp and tp % k:
        raise ValueError(f"tensor_parallel_size {tp} neither divides nor is a multiple of the "
                         f"model's {k} kv heads, so the kv heads can be neither split nor "
                         f"replicated evenly")
    if cfg.moe and cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the experts' "
                         f"intermediate_size {cfg.intermediate_size} (each device holds "
                         f"F / tp of every expert)")


def tp_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded step runs: `cfg`, with tp kv heads where it has fewer (each
    replicated, `replicate_kv_heads`)."""
    if cfg.num_kv_heads >= tp:
        return cfg
    return dataclasses.replace(cfg, num_kv_heads=tp)


def replicate_kv_heads(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """Stacked params of `cfg` -> those of `tp_config(cfg, tp)`: with K < tp kv heads,
    each kv head's K/V weight columns (and biases) repeated tp / K times, so kv head j of
    the result is kv head j // (tp / K) of the model, and query head h (shard h // (H / tp))
    still reads its kv head h // G. Placed split over the mesh (one head per shard);
    unchanged when the kv heads split evenly."""
    tp = mesh.shape[AXIS]
    if cfg.num_kv_heads >= tp:
        return params
    reps, d = tp // cfg.num_kv_heads, cfg.head_dim
    layers = params.layers
    out = param_shardings(tp_config(cfg, tp), mesh, AXIS).layers

    def expand(w):  # [..., K*D] -> [..., tp*D], heads repeated in place
        heads = w.reshape(*w.shape[:-1], cfg.num_kv_heads, d)
        return jnp.repeat(heads, reps, axis=-2).reshape(*w.shape[:-1], tp * d)

    names = [n for n in ("wk", "wv", "bk", "bv") if getattr(layers, n) is not None]
    new = jax.jit(lambda *ws: tuple(expand(w) for w in ws),
                  out_shardings=tuple(getattr(out, n) for n in names)
                  )(*(getattr(layers, n) for n in names))
    return dataclasses.replace(params, layers=dataclasses.replace(
        layers, **dict(zip(names, new, strict=True))))


def shard_params(params: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """Places (stacked-layer) params with their tensor-parallel shardings."""
    return jax.device_put(params, param_shardings(cfg, mesh, AXIS))


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, HEADS)


def per_shard(fn, mesh: Mesh | None):
    """Runs `fn(q, k, v, cache, alibi_slopes, layer, batch) -> (out, cache)` on each
    device's heads (`cache` a tuple of [L, K, ...] arrays, the caches and any fp8 scales,
    all split on their kv-head axis; `alibi_slopes` [H] or None: each device gets its
    query heads' slopes); unchanged without a mesh."""
    if mesh is None:
        return fn
    return jax.shard_map(
        fn, mesh=mesh,
        in_specs=(HEADS, HEADS, HEADS, HEADS, HEAD_VALUES, REPLICATED, REPLICATED),
        out_specs=(HEADS, HEADS),
        check_vma=False,
    )


def shard_columns(linear, mesh: Mesh):
    """A column-parallel `LinearFn` (Q/K/V, gate/up: w [E, N] split by output columns)
    running `linear` per device on its columns under shard_map: x [..., E] whole on each
    device, out [..., N] split by columns. With act "silu_mul" each device's block of w
    is its own [gate | up] (`Params.shards`). No collective: the all-reduce after the
    row-parallel wo / w_down stays XLA's."""

    def col_linear(x, w, act=None):
        out = PartitionSpec(*(None,) * (x.ndim - 1), AXIS)
        return jax.shard_map(functools.partial(linear, act=act), mesh=mesh,
                             in_specs=(REPLICATED, PartitionSpec(None, AXIS)),
                             out_specs=out, check_vma=False)(x, w)

    return col_linear


def per_shard_qkv(fn, mesh: Mesh | None):
    """Runs `fn(qkv, positions, inv_freq, cache, layer, batch) -> (out, cache)` on each
    device's heads: qkv [T, N] split by columns (each device's block is its [q | k | v]
    heads, `Params.shards`), `cache` (a tuple: the caches and any fp8 scales) by kv heads,
    out [T, H, D] by query heads; unchanged without a mesh."""
    if mesh is None:
        return fn
    return jax.shard_map(
        fn, mesh=mesh,
        in_specs=(PartitionSpec(None, AXIS), REPLICATED, REPLICATED, HEADS,
                  REPLICATED, REPLICATED),
        out_specs=(HEADS, HEADS),
        check_vma=False,
    )


def shard_experts(mesh: Mesh | None, fn=experts):
    """A mixture of experts' `experts_fn` (`fn`, default `models.moe.experts(x, weights,
    ids, w_gate, w_up, w_down)`) run per device on its slice of every expert's F
    (`param_partition_specs`: gate/up [X, E, F] by columns, fused per shard as
    [gate_s | up_s], down [X, F, E] by rows), the tokens and their routing whole on
    each device. Each device returns its partial sum [T, E]; they are stacked on a
    leading device axis outside the shard_map and summed there, so the all-reduce is
    XLA's (no collective inside). None without a mesh (the model's default runs)."""
    if mesh is None:
        return None
    cols, rows = PartitionSpec(None, None, AXIS), PartitionSpec(None, AXIS, None)

    def local(x, weights, ids, w_gate, w_up, w_down):
        return fn(x, weights, ids, w_gate, w_up, w_down)[None]

    def experts_fn(x, weights, ids, w_gate, w_up, w_down):
        if w_up is None:  # fused [gate_s | up_s] per shard
            run = jax.shard_map(lambda x, wt, i, g, d: local(x, wt, i, g, None, d), mesh=mesh,
                                in_specs=(REPLICATED,) * 3 + (cols, rows),
                                out_specs=PartitionSpec(AXIS), check_vma=False)
            parts = run(x, weights, ids, w_gate, w_down)
        else:
            run = jax.shard_map(local, mesh=mesh, in_specs=(REPLICATED,) * 3 + (cols, cols, rows),
                                out_specs=PartitionSpec(AXIS), check_vma=False)
            parts = run(x, weights, ids, w_gate, w_up, w_down)
        return jnp.sum(parts, axis=0)

    return experts_fn
