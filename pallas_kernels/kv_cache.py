"""Writes new tokens' K/V into the paged cache `[L, K, N, B, D]` at their slots.

slot = block * B + offset; padding tokens carry slots 0..B-1 of the null block 0.
`write_kv` is one XLA row scatter per cache into its `[L*K*N*B, D]` view. Under `jit`
with the caches donated (or inside a jitted step whose cache is donated) XLA updates the
buffer in place: the cost is the T*K*D written elements, not the cache size.

Writes aimed at the null block are dropped (its content is unspecified anyway), which
makes the remaining indices unique; telling XLA so (`unique_indices`) keeps it off its
slow path for possibly colliding indices (docs/KERNEL_NOTES.md).

With an fp8 cache (`fp8.py`: fp8 K/V plus float32 scales [L, K, N, B]) each new row is
quantised with its own scale (`fp8.quantize_rows`) and the scale scattered next to it.

On XLA:CPU a bfloat16 or fp8 scatter is upcast through a conversion of the whole cache
on every write (O(cache)); an integer scatter is not, so the engine stores such caches
there as unsigned-integer bits and writes bitcast rows into them (`jprefix.worker.kv_bits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import check_caches, check_int32_rows
from pallas_kernels.fp8 import check_fp8_cache, quantize_rows


def _check_inputs(k_cache, v_cache, layer, k, v, slot_mapping, k_scale=None, v_scale=None):
    """Raises ValueError naming the argument whose shape or dtype breaks the contract."""
    check_caches(k_cache, v_cache, layer)
    check_fp8_cache(k_cache, v_cache, k_scale, v_scale)
    _, kh, _, _, d = k_cache.shape
    if k.ndim != 3 or k.shape != v.shape or k.shape[1:] != (kh, d):
        raise ValueError(f"k and v must both be [T, {kh}, {d}], got {k.shape} and {v.shape}")
    if slot_mapping.shape != (k.shape[0],) or not jnp.issubdtype(slot_mapping.dtype,
                                                                   jnp.integer):
        raise ValueError(f"slot_mapping must be integer [{k.shape[0]}], got "
                         f"{slot_mapping.dtype}{list(slot_mapping.shape)}")
    if k_scale is not None:  # fp8: any float K/V, quantised on write
        if not (jnp.issubdtype(k.dtype, jnp.floating) and k.dtype == v.dtype):
            raise ValueError(f"k/v must share one float dtype, got {k.dtype}, {v.dtype}")
    elif k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtypes ({k.dtype}, {v.dtype}) must match the caches' "
                         f"({k_cache.dtype}, {v_cache.dtype})")


def _rows(cache_shape, layer, slot_mapping):
    """Row of each (token, head) in the [L*K*N*B, D] view, [T*K] int32.

    Null-block slots (< B) get distinct rows past the end, which the scatter drops.
    """
    num_layers, kh, n, b, _ = cache_shape
    num_rows = num_layers * kh * n * b
    check_int32_rows(num_rows, slot_mapping.shape[0] * kh)
    slots = slot_mapping.astype(jnp.int32)[:, None]  # [T, 1]
    heads = jnp.arange(kh, dtype=jnp.int32)[None, :]  # [1, K]
    rows = (layer * kh + heads) * (n * b) + slots
    dropped = num_rows + jnp.arange(rows.size, dtype=jnp.int32).reshape(rows.shape)
    return jnp.where(slots < b, dropped, rows).reshape(-1)


def _scatter(cache, rows, x):
    """cache[layer, h, slot] = x[t, h] for every (t, h) not aimed at the null block
    (cache [L, K, N, B, D] with x [T, K, D], or scales [L, K, N, B] with x [T, K])."""
    if cache.ndim == 4:
        flat = cache.reshape(-1).at[rows].set(x.reshape(-1), mode="drop",
                                              unique_indices=True)
        return flat.reshape(cache.shape)
    d = cache.shape[-1]
    flat = cache.reshape(-1, d).at[rows].set(x.reshape(-1, d), mode="drop",
                                             unique_indices=True)
    return flat.reshape(cache.shape)


@jax.jit
def write_kv(
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # [T] int32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,  # [L, K, N, B] float32
) -> tuple[jax.Array, ...]:
    """Returns the caches with token t's K/V at `slot_mapping[t]` of layer `layer`:
    (k_cache, v_cache), or for an fp8 cache (k_cache, v_cache, k_scale, v_scale) with
    each new row quantised with its own scale (`fp8.quantize_rows`).

    In place when the caches are donated to the enclosing jit (as the engine's step does).
    """
    _check_inputs(k_cache, v_cache, layer, k, v, slot_mapping, k_scale, v_scale)
    rows = _rows(k_cache.shape, layer, slot_mapping)
    if k_scale is None:
        return _scatter(k_cache, rows, k), _scatter(v_cache, rows, v)
    k8, ks = quantize_rows(k, k_cache.dtype)
    v8, vs = quantize_rows(v, v_cache.dtype)
    return (_scatter(k_cache, rows, k8), _scatter(v_cache, rows, v8),
            _scatter(k_scale, rows, ks), _scatter(v_scale, rows, vs))


def write_kv_reference(
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # [T] int32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,  # [L, K, N, B] float32
) -> tuple[jax.Array, ...]:
    """Plain scatter over the [L, K, N*B, D] view: cache[layer, :, slot] = k[t] for all t
    (null-block slots included, where duplicates leave any one of the values); fp8
    caches as in `write_kv`."""
    _check_inputs(k_cache, v_cache, layer, k, v, slot_mapping, k_scale, v_scale)
    num_layers, kh, n, b, d = k_cache.shape

    def put(cache, x):
        flat = cache.reshape(num_layers, kh, n * b, *cache.shape[4:])
        # NumPy rule: scalar and array indices split by a slice put the T axis first.
        flat = flat.at[layer, :, slot_mapping].set(x)
        return flat.reshape(cache.shape)

    if k_scale is None:
        return put(k_cache, k), put(v_cache, v)
    (k8, ks), (v8, vs) = quantize_rows(k, k_cache.dtype), quantize_rows(v, v_cache.dtype)
    return put(k_cache, k8), put(v_cache, v8), put(k_scale, ks), put(v_scale, vs)
