"""The weights in the layout the engine's step runs: sharded for tensor parallelism, split
per layer with fused projections on GPU, optionally quantised to fp8."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jprefix.worker.kv_cache import check_fp8_device
from jprefix.worker.parallel import replicate_kv_heads, shard_params, tp_config
from models.config import ModelConfig
from models.layout import FUSED_FIELDS, fuse_projections, quantize_linears, unstack_layers
from models.llama import LayerParams, Params


def prepare_params(params: Any, cfg: ModelConfig, mesh: Mesh | None = None,
                   unroll_layers: bool | None = None, donate: bool = False,
                   quantization: str | None = None) -> Any:
    """The weights in the layout the step runs (the one place that decides it): sharded
    over `mesh` (kv heads replicated where fewer than the shards: `parallel.tp_config`,
    the config the step then runs); on GPU (or with `unroll_layers`) split into per-layer
    buffers (no per-layer weight copy in the step), with Q/K/V and gate/up fused into one
    matmul each (layout "fused"; per shard under a mesh, `Params.shards`); on the CPU by
    default (`unroll_layers` None, one device) per-layer buffers, fused likewise (layout
    "fused"; a mixture of experts' unfused, "per_layer"), which the step scans
    (`worker.layer_switch`). Idempotent.
    `donate`: the caller hands the weights over, so the input buffers the result does
    not reuse are freed at once (one copy of the weights on the device, not two, before
    the KV cache is sized). `quantization="fp8"`: the linear layers' weights quantised to
    fp8 (one device; `layout.quantize_linears`: the last layer's MLP stays in the model
    dtype, except for an fp8 checkpoint)."""
    gpu = jax.default_backend() == "gpu"
    if unroll_layers is None and not gpu and mesh is None and params.layout == "stacked":
        # CPU: per-layer buffers scanned, each matmul reading its layer's own buffer
        # (`worker.layer_switch`): no per-step weight copy, one compiled layer; Q/K/V and
        # gate/up fused (fewer, larger dots), except a mixture of experts' (unrolled)
        params = _unstack_in_host_memory(params, fuse=params.layers.router is None)
    if unroll_layers is None:  # GPU: unrolled (fused); CPU: under lax.scan
        unroll_layers = gpu
    given = params
    if mesh is not None and params.layout == "stacked":  # (per-layer ones are sharded)
        params = replicate_kv_heads(shard_params(params, cfg, mesh), cfg, mesh)
    elif mesh is not None and tp_config(cfg, mesh.size) is not cfg:
        raise ValueError(f"replicating {cfg.num_kv_heads} kv heads over {mesh.size} shards "
                         f"needs layout 'stacked' params, got {params.layout!r}")
    if unroll_layers:
        if params.layout == "stacked":
            params = unstack_layers(params, fuse=True, shards=1 if mesh is None else mesh.size)
        elif mesh is None:
            params = fuse_projections(params)
    if quantization == "fp8":
        if mesh is not None:
            raise ValueError("quantization='fp8' runs on one device (tensor_parallel_size 1)")
        check_fp8_device("quantization='fp8'")
        # a checkpoint's own fp8 values are served as they are, the last MLP too
        params = quantize_linears(params, keep_last_mlp=not cfg.checkpoint_quantization)
    elif quantization is not None:
        raise ValueError(f"quantization {quantization!r} is not one of None, fp8")
    if params is not given:  # (the KV cache is sized from the memory free after this)
        settle(params)
    if donate and params is not given:
        given_ids = {id(x) for x in jax.tree.leaves(given)}
        kept = {id(x) for x in jax.tree.leaves(params)}
        for x in jax.tree.leaves(given):
            if id(x) not in kept:
                x.delete()
        params = _compact(params, given_ids)
    return params


def _unstack_in_host_memory(params: Params, fuse: bool = False) -> Params:
    """`layout.unstack_layers(params, fuse)` (layout "per_layer", or "fused") for weights
    in host memory (the CPU device, one device): each layer's slice (or concatenation of
    slices) copied by NumPy into its own buffer, where the jitted split compiles a program
    per field shape (seconds at start-up)."""
    stacked = params.layers
    num_layers = stacked.attn_norm.shape[0]
    groups = FUSED_FIELDS if fuse else {}
    fused_away = {name for names in groups.values() for name in names[1:]}

    def split(name: str) -> list[jax.Array | None]:
        parts = [getattr(stacked, n) for n in groups.get(name, (name,))]
        if name in fused_away or parts[0] is None:
            return [None] * num_layers
        hosts = [np.asarray(x) for x in parts]
        return [jax.device_put(np.concatenate([h[i] for h in hosts], axis=-1), parts[0].sharding)
                for i in range(num_layers)]

    fields = {f.name: split(f.name) for f in dataclasses.fields(LayerParams)}
    layers = tuple(LayerParams(**{name: col[i] for name, col in fields.items()})
                   for i in range(num_layers))
    return dataclasses.replace(params, layers=layers, layout="fused" if fuse else "per_layer")


def settle(params: Any) -> None:
    """Waits for the computations that made `params`, then collects garbage: a buffer
    dropped while a computation still reads it (the per-layer copies that fp8
    quantisation consumed) stays counted in use until that computation ends, and the KV
    cache sized from the free memory before then would lose their size."""
    jax.block_until_ready(params)
    gc.collect()


def _compact(params: Any, given_ids: set[int]) -> Any:
    """`params` with every leaf this module made (id not in `given_ids`) copied into a
    fresh buffer, then the originals deleted, once the buffers they were made from are
    gone. Why: the KV cache is sized from the allocator's largest free block, since each
    cache array must be contiguous (`kv_cache.auto_num_blocks`). The given weights (and,
    with fp8, the unquantised per-layer ones) were allocated below the results and freed
    after them, which leaves a hole of one model's weights below the results that no
    cache array fits in. Copied after the frees, the results fill that hole (the
    allocator takes the smallest free chunk that fits) and their old place joins the
    free space above, so the cache can use it. Costs one device copy of the weights and
    their size in free memory for a moment, before the cache exists. Leaves spread over
    several processes stay where they are."""
    leaves, treedef = jax.tree.flatten(params)  # (settled by prepare_params)
    fresh = [jax.device_put(x, x.sharding, may_alias=False)
             if id(x) not in given_ids and x.is_fully_addressable else x for x in leaves]
    jax.block_until_ready(fresh)
    for old, new in zip(leaves, fresh, strict=True):
        if new is not old:
            old.delete()
    return jax.tree.unflatten(treedef, fresh)
