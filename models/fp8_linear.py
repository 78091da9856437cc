"""fp8 weights (`quantization="fp8"`): the linear layers' weights in float8_e4m3fn with
one float32 scale per output channel, quantised at load time from the model dtype, and
the one place that decides how an fp8 matmul runs (`fp8_matmul`).

Scheme (as vLLM's dynamic fp8): weight column j is stored as `w8[j, :] * w_scale[j]`
(transposed, [out, in]: both operands then contract over their minor axis, the layout
cuBLASLt's fp8 GEMM takes on Hopper, so XLA transposes nothing per step); activations
are quantised on the fly with one scale per token row (`ACTIVATION_SCALES = "token"`:
its amax over the row; "tensor": one amax over the whole input, cheaper to reduce but
an outlier token coarsens every other row); the dot takes both fp8 operands with
float32 accumulation, its result in the activations' dtype (`preferred_element_type`;
XLA:GPU lowers it to cuBLASLt's fp8 GEMM on Hopper, XLA:CPU emulates it), then scales
the [T, out] result by the row scale times the column scale. Embeddings, norms and the
lm_head stay in the model dtype. Scales never 0 or inf for finite input; quantised
values are clipped to +-448.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
ACTIVATION_SCALES = "token"  # "token" | "tensor" (module docstring)
DOT_DTYPE = None  # the fp8 dot's result type before scaling (`fp8_matmul`); None: x's
_TINY = float(np.finfo(np.float32).tiny)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8Weight:
    """A linear layer's weight [..., in, out] as fp8 `w8` [..., out, in] (transposed)
    and float32 `scale` [..., out]; leading axes (a stacked L) are batch axes."""

    w8: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for, [..., in, out]."""
        *lead, out, inn = self.w8.shape
        return (*lead, inn, out)


def _scale(amax: jax.Array) -> jax.Array:
    s = jnp.maximum(amax.astype(jnp.float32) / FP8_MAX, _TINY)
    return jnp.where(amax > 0, s, 1.0)


def _quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8)


@jax.jit
def quantize_weight(w: jax.Array) -> Fp8Weight:
    """w [..., in, out] in any float dtype -> Fp8Weight, one scale per output column."""
    scale = _scale(jnp.max(jnp.abs(w), axis=-2))  # [..., out]
    w8 = _quantize(jnp.swapaxes(w, -1, -2), scale[..., None])
    return Fp8Weight(w8, scale)


def dequantize_weight(w: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    """The [..., in, out] weight an Fp8Weight stands for, in `dtype`."""
    full = w.w8.astype(jnp.float32) * w.scale[..., None]
    return jnp.swapaxes(full, -1, -2).astype(dtype)


def quantize_activations(x: jax.Array, granularity: str | None = None
                         ) -> tuple[jax.Array, jax.Array]:
    """x [..., in] -> (x8 [..., in] fp8, scale [..., 1] float32), one scale per row or
    one for the whole input (`granularity` "token" / "tensor"; None: ACTIVATION_SCALES)."""
    granularity = granularity or ACTIVATION_SCALES
    if granularity not in ("token", "tensor"):
        raise ValueError(f"activation scale granularity {granularity!r}: expected 'token' "
                         "or 'tensor'")
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    if granularity == "tensor":
        amax = jnp.broadcast_to(jnp.max(amax), amax.shape)
    scale = _scale(amax)
    return _quantize(x, scale), scale


def fp8_matmul(x: jax.Array, w: Fp8Weight, *, dot_dtype=None,
               granularity: str | None = None) -> jax.Array:
    """x [..., in] @ the weight -> [..., out] in x.dtype: fp8 x fp8 with float32
    accumulation, rescaled by the row and column scales (module docstring).

    `dot_dtype` (None: DOT_DTYPE, whose None is x.dtype) is the dot's result type before
    the scales. In a 16-bit x.dtype the float32 sum is rounded once more before scaling
    (2^-9 relative, against e4m3's 2^-4 steps); cuBLASLt's fp8 GEMM runs faster writing
    16-bit output and the scaling pass reads half the bytes (docs/PERF.md).
    `granularity` as in `quantize_activations`."""
    x8, xs = quantize_activations(x, granularity)
    if dot_dtype is None:
        dot_dtype = x.dtype if DOT_DTYPE is None else DOT_DTYPE
    y = jax.lax.dot_general(x8, w.w8, (((x.ndim - 1,), (w.w8.ndim - 1,)), ((), ())),
                            preferred_element_type=dot_dtype)
    return (y.astype(jnp.float32) * xs * w.scale).astype(x.dtype)
