"""The fp8 KV cache's number format: per (token, KV head) scales, quantise on write,
dequantise on read (inside the attention kernels).

An fp8 cache is four arrays: `k_cache, v_cache: [L, K, N, B, D]` in float8_e4m3fn or
float8_e5m2, and `k_scale, v_scale: [L, K, N, B]` float32, one scale per cached row
(token, KV head). A row's true value is `cache[..., :] * scale`. The writer picks
`scale = amax(|x|) / fp8_max` for its row, so every row uses the format's whole range:
no calibration pass, nothing ever clipped but rounding at the top, and a row's stored
bytes depend only on that row's own K/V (a block cached once reads the same for every
sequence that shares it, so the prefix cache cannot change results). The scales cost
4 bytes per D-element row: (D + 4) / 2D of the bf16 cache's bytes (0.52x at D = 128).

Scales are never 0, inf or NaN for finite input: a zero row takes scale 1, and a row
whose amax / fp8_max underflows takes float32's smallest normal. The quantised value is
clipped to +-fp8_max before the cast, because a float8_e4m3fn cast of anything beyond
448 is NaN (the format has no inf).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# the engine's kv_cache_dtype names of the fp8 formats ("fp8" is e4m3, as in vLLM)
FP8_NAMES = {"fp8": FP8_DTYPES[0], "fp8_e4m3": FP8_DTYPES[0], "fp8_e5m2": FP8_DTYPES[1]}
SCALE_DTYPE = jnp.dtype(jnp.float32)
_TINY = float(np.finfo(np.float32).tiny)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
    """The largest finite value of an fp8 format (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def row_scale(amax: jax.Array, dtype) -> jax.Array:
    """The scale of rows whose largest magnitude is `amax` (float32, any shape): finite
    and > 0 for finite amax (module docstring)."""
    amax = amax.astype(jnp.float32)
    scale = jnp.maximum(amax / fp8_max(dtype), _TINY)
    return jnp.where(amax > 0, scale, 1.0)


def quantize_rows(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (x8 [..., D] in fp8 `dtype`, scale [...] float32) with
    x ~= x8 * scale[..., None], each row scaled to the format's full range."""
    xf = x.astype(jnp.float32)
    scale = row_scale(jnp.max(jnp.abs(xf), axis=-1), dtype)
    return quantize_with(xf, scale[..., None], dtype), scale


def quantize_with(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x / scale clipped to the format's range, cast to fp8 `dtype` (round to nearest)."""
    m = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -m, m).astype(dtype)


def dequantize_rows(x8: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """x8 [..., D] * scale [...] in `dtype`."""
    return (x8.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)


def check_fp8_cache(k_cache, v_cache, k_scale, v_scale) -> None:
    """Raises ValueError unless the scales are given together, float32 [L, K, N, B] for
    caches of one fp8 format; or both absent."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    if k_scale is None:
        if is_fp8(k_cache.dtype) or is_fp8(v_cache.dtype):
            raise ValueError(f"an fp8 cache ({k_cache.dtype}) needs k_scale and v_scale")
        return
    if not (is_fp8(k_cache.dtype) and k_cache.dtype == v_cache.dtype):
        names = ", ".join(map(str, FP8_DTYPES))
        raise ValueError(f"scales are for fp8 caches of one format ({names}), got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    want = k_cache.shape[:-1]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.shape != want or jnp.dtype(s.dtype) != SCALE_DTYPE:
            raise ValueError(f"{name} must be float32 {list(want)}, got "
                             f"{s.dtype}{list(s.shape)}")
