"""Helpers shared by the kernels: power-of-2 arithmetic and the input checks of the
paged-cache contract.

The paged KV cache of every kernel here is `k_cache, v_cache: [L, K, N, B, D]` (layers,
KV heads, blocks, block size, head dim), block 0 the null block that padding tokens
address. The layer is an input, so the engine passes the whole multi-layer buffer
(slicing one layer out would copy it every step).
"""

from __future__ import annotations

import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
INT32 = jnp.dtype(jnp.int32)
MAX_INT32_ROWS = 2**31  # row indices of a flat [rows, D] cache view stay int32


def next_pow2(x: int) -> int:
    """The smallest power of 2 >= x (1 for x <= 1)."""
    return 1 << max(0, x - 1).bit_length()


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def check_caches(k_cache, v_cache, layer) -> None:
    """Raises ValueError unless the caches share one [L, K, N, B, D] shape and `layer` is
    an integer scalar."""
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [L, K, N, B, D], got "
                         f"{k_cache.shape} and {v_cache.shape}")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {jnp.result_type(layer)}"
                         f"{list(jnp.shape(layer))}")


def check_float_dtypes(**arrays) -> None:
    """Raises ValueError unless the named arrays share one of bf16/f16/f32."""
    dtypes = [jnp.dtype(x.dtype) for x in arrays.values()]
    if len(set(dtypes)) != 1 or dtypes[0] not in FLOAT_DTYPES:
        raise ValueError(f"{', '.join(arrays)} must share one of bf16/f16/f32, got "
                         f"{', '.join(map(str, dtypes))}")


def check_int32_rows(cache_rows: int, extra_rows: int = 0) -> None:
    """Raises ValueError unless `cache_rows` (+ `extra_rows` past its end) row indices
    fit in int32."""
    if cache_rows + extra_rows >= MAX_INT32_ROWS:
        raise ValueError(f"cache of {cache_rows} rows is too large for int32 row indices")


def check_window(sliding_window, causal: bool = True) -> None:
    """Raises ValueError for a window that is not an integer scalar >= 1 (a traced one's
    value cannot be checked) or one given with `causal=False`."""
    if sliding_window is None:
        return
    if not causal:
        raise ValueError("sliding_window needs causal=True (a non-causal row has no position)")
    if isinstance(sliding_window, (int, float)) or not hasattr(sliding_window, "dtype"):
        if int(sliding_window) != sliding_window or sliding_window < 1:
            raise ValueError(f"sliding_window must be an integer >= 1, got {sliding_window!r}")
    elif jnp.ndim(sliding_window) != 0 or not jnp.issubdtype(sliding_window.dtype,
                                                              jnp.integer):
        raise ValueError(f"sliding_window must be an integer scalar, got "
                         f"{sliding_window.dtype}{list(jnp.shape(sliding_window))}")


def masked_softmax(s, visible):
    """The references' float32 softmax over the last axis of logits `s` [..., J] where
    `visible` (broadcast to s) and zero elsewhere; a row with no visible key gives zeros.
    Returns (p, s_max, denom), the last two [..., 1], for the log-sum-exp
    `s_max + log(denom)` (-inf for a row with no visible key)."""
    s = jnp.where(visible, s, -jnp.inf)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)
    p = jnp.exp(s - s_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom == 0.0, 1.0, denom), s_max, denom
