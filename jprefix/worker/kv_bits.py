"""The KV cache stored as unsigned-integer bits on the CPU (fp8, bfloat16, float16).

XLA:CPU does no arithmetic in these formats: it converts every operation on them to a
wider float, the in-place scatter of a KV write included, so each write converted the
whole cache and back (O(cache) per layer and step: ~150 s for 8 tokens of SmolLM2 with
an fp8 cache of 4,095 blocks, 3.4 s with 64). A bitcast to integers is a copy there too.
So on the CPU such a cache is stored as unsigned integers of its element's width
(`bits_dtype`) and never converted whole:

- `write_bits`: the new rows quantised (fp8, with their scales) or rounded, bitcast,
  and scattered as integers by `write_kv` (in place, as for float32);
- `compact`: the blocks the step's block tables name, gathered for one layer and
  bitcast back to their format (with their scales) as a small cache [1, K, n, B, D]
  with the tables renumbered over it, which the reference attention then reads as it
  reads any cache (it gathers each token's blocks anyway: this is no more than that).

The step takes the cache's element format as `kv_format` (its name; None: a float32
cache or one stored as itself); `worker.model_runner` decides the storage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pallas_kernels.fp8 import quantize_rows
from pallas_kernels.kv_cache import write_kv

# batch keys of the block tables each attention path reads
TABLE_KEYS = {False: ("block_tables",), True: ("prefix_block_tables", "suffix_block_tables")}


def bits_dtype(dtype) -> jnp.dtype | None:
    """The unsigned dtype a CPU cache of `dtype` is stored as; None for 4-byte floats
    (stored as themselves)."""
    size = jnp.dtype(dtype).itemsize
    return None if size >= 4 else jnp.dtype(f"uint{8 * size}")


def bits_format(dtype, backend: str, mesh: Mesh | None) -> str | None:
    """The step's `kv_format` for a runner's cache of `dtype`: its name where the cache
    is stored as bits (`bits_dtype`: on the CPU, with the XLA backend, on one device),
    else None (stored as itself)."""
    cpu = backend == "xla" and mesh is None and jax.default_backend() == "cpu"
    return jnp.dtype(dtype).name if cpu and bits_dtype(dtype) is not None else None


def stored_values(cache: tuple, kv_format: str | None) -> tuple:
    """`cache` with K and V in their element format (a copy where stored as bits)."""
    if kv_format is None:
        return cache
    return (*(_bitcast(x, jnp.dtype(kv_format)) for x in cache[:2]), *cache[2:])


def write_and_attend(attend, q, k, v, cache: tuple, layer, batch: dict, cascade: bool,
                     kv_format: str) -> tuple:
    """The step's KV write and attention on a bits cache: `write_bits`, then
    `attend(q, view, layer 0, batch with the renumbered tables)` over `compact`'s view.
    Returns (attention output, the updated cache)."""
    cache = write_bits(cache, layer, k, v, batch["slot_mapping"], kv_format)
    view, tables = compact(cache, layer, batch, cascade, kv_format)
    return attend(q, view, jnp.int32(0), {**batch, **tables}), cache


def _bitcast(x: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype)


def write_bits(cache: tuple, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
               kv_format: str) -> tuple:
    """`write_kv` into a bits cache ((k, v), or (k, v, k_scale, v_scale) for fp8): k, v
    [T, K, D] in any float dtype."""
    fmt = jnp.dtype(kv_format)
    if len(cache) == 4:
        (k8, ks), (v8, vs) = quantize_rows(k, fmt), quantize_rows(v, fmt)
    else:
        k8, v8 = k.astype(fmt), v.astype(fmt)
    bits = cache[0].dtype
    kb, vb = write_kv(cache[0], cache[1], layer, _bitcast(k8, bits), _bitcast(v8, bits),
                      slot_mapping)
    if len(cache) == 2:
        return kb, vb
    k_scale, v_scale = write_kv(cache[2][..., None], cache[3][..., None], layer,
                                ks[..., None], vs[..., None], slot_mapping)
    return kb, vb, k_scale[..., 0], v_scale[..., 0]


def compact(cache: tuple, layer, batch: dict[str, jax.Array], cascade: bool,
            kv_format: str) -> tuple[tuple[jax.Array, ...], dict[str, jax.Array]]:
    """(this layer's blocks that the step's tables name as a cache of their own, in the
    element format: (k, v) [1, K, n, B, D], with an fp8 cache's scales [1, K, n, B];
    the tables renumbered over it), n = the tables' entries together."""
    tables = [batch[key] for key in TABLE_KEYS[cascade]]
    flat = jnp.concatenate([t.reshape(-1) for t in tables])  # [n] block ids

    def load(x):  # one gather [n, K, B, ...] from [L, K, N, B, ...], then [1, K, n, B, ...]
        rows = x[layer, :, flat]
        if jnp.issubdtype(rows.dtype, jnp.unsignedinteger):
            rows = _bitcast(rows, jnp.dtype(kv_format))
        return jnp.swapaxes(rows, 0, 1)[None]

    renumbered, start = {}, 0
    for key, table in zip(TABLE_KEYS[cascade], tables, strict=True):
        renumbered[key] = start + jnp.arange(table.size, dtype=jnp.int32).reshape(table.shape)
        start += table.size
    return tuple(load(x) for x in cache), renumbered
