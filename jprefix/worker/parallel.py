"""Tensor parallelism over one device mesh axis, "tp" (Megatron-style, through jit).

Weights take `models.layout.param_partition_specs` (Q/K/V and gate/up split by output,
wo and w_down by input); the KV cache is split on its kv-head axis. XLA's partitioner
inserts the all-reduces around the matmuls; attention and the KV write run per shard
under `shard_map`, each device on its own query and kv heads (heads are split in
contiguous blocks, so query head h still reads kv head h // G locally).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.layout import param_shardings

AXIS = "tp"
HEADS = PartitionSpec(None, AXIS)  # [T, H, D] activations and [L, K, N, B, D] caches
HEAD_VALUES = PartitionSpec(AXIS)  # [H]: one value per query head (ALiBi slopes)
REPLICATED = PartitionSpec()


def make_mesh(cfg: ModelConfig, tensor_parallel_size: int) -> Mesh | None:
    """A 1-D "tp" mesh over the first `tensor_parallel_size` devices; None for 1."""
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size {tp!r} must be a positive int")
    if tp == 1:
        return None
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size {tp} exceeds the {len(devices)} devices here")
    for name, heads in (("query heads", cfg.num_heads), ("kv heads", cfg.num_kv_heads)):
        if heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the {heads} {name}")
    return Mesh(devices[:tp], (AXIS,))


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
