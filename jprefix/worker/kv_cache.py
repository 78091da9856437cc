"""The paged KV cache's number format and buffers (device side): the one place that
turns `EngineArgs.kv_cache_dtype` into arrays.

A cache is `(k, v)`, each `[L, K, N, B, D]` in the model's dtype, or for fp8
`(k, v, k_scale, v_scale)`: fp8 K/V plus one float32 scale per (layer, kv head, block,
slot) row (`pallas_kernels/fp8.py` owns the format: per-row scales chosen on write).
Every attention op and both KV writes take the scales as keyword arguments
(`scale_kwargs`); the cache tuple travels through the model unchanged. On the CPU with
the XLA backend an fp8 or 16-bit cache is stored as unsigned-integer bits
(`worker.kv_bits`: XLA:CPU would convert the whole cache on every write).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from pallas_kernels.fp8 import FP8_NAMES, SCALE_DTYPE, is_fp8

KVCache = tuple[jax.Array, ...]  # (k, v) or (k, v, k_scale, v_scale)
# fp8 tensor cores and conversions: Ada (8.9) and Hopper (9.0) onwards
_FP8_MIN_COMPUTE_CAPABILITY = 8.9


def kv_dtype(kv_cache_dtype: str, model_dtype: Any) -> jnp.dtype:
    """The cache's element dtype: the model's for "auto", else the named fp8 format."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in FP8_NAMES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of auto, "
                         f"{', '.join(FP8_NAMES)}")
    check_fp8_device(f"kv_cache_dtype={kv_cache_dtype!r}")
    return FP8_NAMES[kv_cache_dtype]


def check_fp8_device(what: str) -> None:
    """Raises ValueError when the first device is a GPU without fp8 (compute capability
    below 8.9). The CPU emulates fp8 (XLA converts), so CPU runs and tests may use it."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return
    cc = getattr(dev, "compute_capability", None)
    if cc is not None and float(cc) < _FP8_MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"{what} needs a GPU with fp8 support (compute capability >= "
                         f"{_FP8_MIN_COMPUTE_CAPABILITY}: Ada, Hopper or newer); "
                         f"{dev.device_kind} has {cc}")


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: Any, layers: int | None = None
                   ) -> int:
    """Bytes of one physical block across all layers (or a hybrid cache's page of
    `layers` slots, `worker.hybrid_kv`), K and V (and their scales)."""
    row = cfg.head_dim * jnp.dtype(dtype).itemsize
    if is_fp8(dtype):
        row += SCALE_DTYPE.itemsize
    return 2 * (layers or cfg.num_layers) * cfg.num_kv_heads * block_size * row


def empty_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: Any,
                   sharding: Any = None, stored_as: Any = None, layers: int | None = None
                   ) -> KVCache:
    """A zeroed cache of `num_blocks` blocks, created in place (sharded by kv heads under
    `sharding`); fp8 scales start at 1 (never 0). `stored_as`: the integer dtype whose
    bits hold the values (`worker.kv_bits`, the CPU's fp8 and 16-bit caches); zero bits
    are zeros in every float format. `layers`: a hybrid cache's slots per page."""
    shape = (layers or cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    store = dtype if stored_as is None else stored_as
    zeros = jax.jit(lambda: jnp.zeros(shape, store), out_shardings=sharding)
    if not is_fp8(dtype):
        return zeros(), zeros()
    ones = jax.jit(lambda: jnp.ones(shape[:-1], SCALE_DTYPE), out_shardings=sharding)
    return zeros(), zeros(), ones(), ones()


def scale_kwargs(cache: KVCache) -> dict[str, jax.Array]:
    """The keyword arguments the attention ops and writes take for `cache`'s scales."""
    if len(cache) == 2:
        return {}
    return {"k_scale": cache[2], "v_scale": cache[3]}


CPU_KV_BYTES = 1 << 30  # the CPU default cache: start-up zeroes it, so it stays small
CPU_MAX_BLOCKS = 4096


def auto_num_blocks(
    cfg: ModelConfig, block_size: int, dtype: Any, memory_fraction: float,
    cpu_blocks: int | None,
    num_shards: int = 1, device: Any = None, layers: int | None = None,
) -> int:
    """KV blocks that fit in `memory_fraction` of the device memory free now on `device`
    (default: this process's first; `cpu_blocks` where device memory cannot be measured,
    None: as many as fit in `CPU_KV_BYTES`, at most `CPU_MAX_BLOCKS`);
    each of `num_shards` devices holds 1/num_shards of every block. `dtype` is the cache's
    element dtype (an fp8 one counts its scales).

    "Free" is at most the allocator's largest free block: the cache's few arrays must each
    be contiguous, and weights placed and then replaced (fp8 quantisation, a copy to a
    replica's device) leave holes that add to the free total but hold no cache array."""
    stats = (device or jax.local_devices()[0]).memory_stats() or {}
    if "bytes_limit" not in stats:  # CPU: no device memory to size from
        if cpu_blocks is not None:
            return cpu_blocks
        block = kv_block_bytes(cfg, block_size, dtype, layers)
        return max(2, min(CPU_MAX_BLOCKS, CPU_KV_BYTES // block))
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    free = min(free, stats.get("largest_free_block_bytes", free))
    per_device = kv_block_bytes(cfg, block_size, dtype, layers) // num_shards
    return max(2, int(free * memory_fraction) // per_device)
