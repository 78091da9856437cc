"""Matmul for few rows (M a power of 2, up to a few hundred): x [M, K] @ w [K, N], the
weights streamed once.

A step of one short prompt (time to first token) or of a small decode batch multiplies
few rows by each weight matrix, so the cost is reading the weights. One program owns
`block_n` output columns and all M rows: it walks the K axis in `block_k` steps (Triton
pipelines the weight loads, hinted `evict_first`) and keeps the [M, block_n]
accumulator in registers, so each weight byte is read once and x (M x K, a few hundred
KB) comes from L2. Few output columns would leave most SMs idle, so the K axis can also
be split over `k_splits` programs, whose float32 partials the wrapper sums (XLA fuses
that sum with whatever follows, e.g. the residual add).

`act="silu_mul"` fuses the gated MLP: w is [gate | up] ([K, 2F]) and the output is
silu(x @ gate) * (x @ up) [M, F]; a program loads the matching columns of both halves.

fp8 weights (`scales`, `models.fp8_linear`): w is the fp8 [N, K] matrix (transposed),
with a float32 scale per row and per output column, and x the activations' fp8 values,
either held in a 16-bit dtype (exact there: a program converts its weight tiles to that
dtype in registers and multiplies in 16 bits) or as float8_e4m3fn itself (`out_dtype`
given: both operands go to the tensor cores' fp8 dot as loaded, nothing is converted).
Either way the dot accumulates in float32 and a program scales its columns once: the
arithmetic of `fp8_matmul` (per-row activation quantisation, so a row's result does not
depend on the other rows) with half the weight bytes of a 16-bit matmul.

`block_m` (0: all M rows in one program) splits the rows over programs, for row counts
where a program's [M, block_n] accumulator would be too large or too few programs
would run; each then reads its own rows of x and every weight column it owns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import FLOAT_DTYPES, is_pow2

FP8 = jnp.dtype(jnp.float8_e4m3fn)  # (models.fp8_linear's weight format)

ACTIVATIONS = (None, "silu_mul")
# Where the kernel is chosen over XLA's matmul (`skinny_tiling`): up to 16 rows, with
# at least 128 programs of 64 output columns (a GPU's SMs busy without K splits). With
# more rows every program re-reads x from L2, as many bytes as its share of the weights;
# with fewer columns K splits did not pay (docs/KERNEL_NOTES.md).
SKINNY_MAX_ROWS = 16
SKINNY_MIN_PROGRAMS = 128


@dataclasses.dataclass(frozen=True)
class MatmulTiling:
    """Launch parameters: output columns per program, K per inner step, K splits."""

    block_n: int = 64
    block_k: int = 128
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = 0  # rows per program; 0 = all of them


def _rows_ok(m: int) -> bool:
    """Whether the kernel takes m rows: a power of 2 (Triton's block sizes) >= 16 (its
    smallest dot)."""
    return m >= 16 and is_pow2(m)


def skinny_tiling(m: int, k: int, n: int, act: str | None, *,
                  min_programs: int = SKINNY_MIN_PROGRAMS) -> MatmulTiling | None:
    """The tiling to multiply x [m, k] by a weight of n output columns (n = F for
    silu_mul) with, or None where XLA's matmul is the faster choice (see above)."""
    block_k = next((b for b in (128, 64, 32, 16) if k % b == 0), None)
    if (m > SKINNY_MAX_ROWS or not _rows_ok(m) or block_k is None or n % 64
            or n // 64 < min_programs):
        return None
    return MatmulTiling(block_n=64, block_k=block_k, num_stages=3 if act else 4)


def fp8_tiling(m: int, k: int, n: int, act: str | None) -> MatmulTiling | None:
    """The tiling for x [m, k] in fp8 times an fp8 weight of n output columns (the
    fp8 x fp8 dot), or None where XLA's fp8 matmul is the faster choice: up to
    SKINNY_MAX_ROWS rows, at any column count (at 16 rows it beat XLA's fp8 dot on all
    four 7B projections, the 4096-column ones included, where the 16-bit kernel loses to
    XLA's). Long K (the MLP's down projection) splits in two; the gated MLP takes 128
    columns of each half per program (bench_gemm --fp8-native; docs/KERNEL_NOTES.md)."""
    block_k = next((b for b in (128, 64, 32) if k % b == 0), None)
    block_n = next((b for b in (64, 32, 16) if n % b == 0), None)
    if m > SKINNY_MAX_ROWS or not _rows_ok(m) or block_k is None or block_n is None:
        return None
    splits = 2 if k >= 8192 and k % (2 * block_k) == 0 and not act else 1
    if (act or splits > 1) and n % 128 == 0:
        block_n = 128
    return MatmulTiling(block_n=block_n, block_k=block_k, k_splits=splits)


def _matmul_kernel(x_ref, w_ref, *refs, tiling: MatmulTiling, act: str | None,
                   num_rows: int, k_per_split: int, up_offset: int, fp8: bool):
    """x_ref [M, K], w_ref [K, N_w] (`fp8`: [N_w, K] fp8, then refs start with the row
    scales [M, 1] and column scales [1, N_w], float32), o_ref [M, N_out] (k_splits 1) or
    [k_splits * M, N_out] float32 partials; program (j, s, r) computes columns
    j*block_n.. of rows r*bm.. (bm = block_m or M) over K split s."""
    *scale_refs, o_ref = refs
    j, s, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bn, bk = tiling.block_n, tiling.block_k
    bm = tiling.block_m or num_rows
    n0 = pl.multiple_of(j * bn, bn)
    r0 = pl.multiple_of(r * bm, bm)
    k_lo = s * k_per_split
    native = x_ref.dtype == FP8  # fp8 x fp8 on the tensor cores: nothing converted

    def load_w(k0, col0):  # (each weight byte is read once: evict it first)
        if fp8:  # [bn, bk] fp8, converted to x's 16-bit dtype unless native (exact)
            w = plgpu.load(w_ref.at[pl.ds(col0, bn), pl.ds(k0, bk)],
                           eviction_policy="evict_first")
            return w if native else w.astype(x_ref.dtype)
        return plgpu.load(w_ref.at[pl.ds(k0, bk), pl.ds(col0, bn)],
                          eviction_policy="evict_first")

    # float32 inputs multiply in full precision (Triton's default for them is TF32)
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    dot = (functools.partial(plgpu.dot, trans_b=True, precision=precision) if fp8 else
           functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32))

    def body(i, accs):
        k0 = pl.multiple_of(k_lo + i * bk, bk)
        x = x_ref[pl.ds(r0, bm), pl.ds(k0, bk)]  # [bm, bk]
        out = [accs[0] + dot(x, load_w(k0, n0))]
        if act == "silu_mul":
            out.append(accs[1] + dot(x, load_w(k0, up_offset + n0)))
        return tuple(out)

    zeros = jnp.zeros((bm, bn), jnp.float32)
    accs = lax.fori_loop(0, k_per_split // bk, body, (zeros,) * (1 + (act == "silu_mul")))
    if fp8:  # y * row scale * column scale, as fp8_matmul (each partial: the sum is linear)
        row_scale, col_scale = scale_refs
        accs = tuple(a * row_scale[pl.ds(r0, bm), :] * col_scale[:, pl.ds(col0, bn)]
                     for a, col0 in zip(accs, (n0, up_offset + n0)[:len(accs)], strict=True))
    if tiling.k_splits > 1:
        o_ref[pl.ds(s * num_rows + r0, bm), pl.ds(n0, bn)] = accs[0]
        return
    if act == "silu_mul":  # gate and up rounded as two matmul outputs would be, then f32
        # (one rounding at the end: within one bf16 step of XLA's unfused ops, which round
        # per op; not bit-equal to them, nor is XLA on CPU to XLA on a GPU)
        gate = accs[0].astype(o_ref.dtype).astype(jnp.float32)
        up = accs[1].astype(o_ref.dtype).astype(jnp.float32)
        result = gate * jax.nn.sigmoid(gate) * up
    else:
        result = accs[0]
    o_ref[pl.ds(r0, bm), pl.ds(n0, bn)] = result.astype(o_ref.dtype)


def check_matmul_inputs(x: jax.Array, w: jax.Array, act: str | None, tiling: MatmulTiling,
                        scales: tuple[jax.Array, jax.Array] | None = None,
                        out_dtype=None) -> None:
    """Raises ValueError naming the shape, dtype or tiling value the kernel cannot take."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x {x.shape} and w {w.shape} must both be 2-D")
    w_k, w_n = w.shape[::-1] if scales is not None else w.shape
    if x.shape[1] != w_k:
        raise ValueError(f"x {x.shape} and w {w.shape} disagree on K")
    if scales is not None:
        if w.dtype != FP8 or x.dtype not in (*FLOAT_DTYPES, FP8):
            raise ValueError(f"with scales, w ({w.dtype}) must be {FP8} [N, K] and x "
                             f"({x.dtype}) {FP8} or a float dtype holding fp8 values")
        if x.dtype == FP8 and tiling.block_k < 32:
            raise ValueError(f"block_k {tiling.block_k} must be >= 32 for an fp8 x "
                             "(the tensor cores' fp8 dot takes K in steps of 32)")
        shapes = tuple(tuple(jnp.shape(a)) for a in scales)
        if shapes != ((x.shape[0],), (w_n,)):
            raise ValueError(f"scales {shapes} must be [M] = [{x.shape[0]}] and "
                             f"[N] = [{w_n}] for x {x.shape} and w {w.shape}")
    elif x.dtype != w.dtype or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x ({x.dtype}) and w ({w.dtype}) must share a float dtype")
    if act not in ACTIVATIONS:
        raise ValueError(f"act {act!r} is not one of {ACTIVATIONS}")
    m, k = x.shape
    n = w_n // (2 if act == "silu_mul" else 1)
    out = jnp.dtype(out_dtype or x.dtype)
    if out not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype {out} must be one of {FLOAT_DTYPES} (x is {x.dtype}: "
                         "an fp8 x needs out_dtype)")
    if not _rows_ok(m):
        raise ValueError(f"x has {m} rows: a power of 2 >= 16 is needed (pad the rows)")
    bm = tiling.block_m or m
    if bm > m or m % bm or not _rows_ok(bm):
        raise ValueError(f"block_m {tiling.block_m} must be 0 or a power of 2 >= 16 "
                         f"dividing the {m} rows")
    if not all(b >= 16 and is_pow2(b) for b in (tiling.block_n, tiling.block_k)):
        raise ValueError(f"block_n {tiling.block_n} and block_k {tiling.block_k} must be "
                         "powers of 2 >= 16 (Triton's smallest dot)")
    if tiling.k_splits < 1:
        raise ValueError(f"k_splits {tiling.k_splits} must be >= 1")
    if act == "silu_mul" and w_n % 2:
        raise ValueError(f"w {w.shape} has an odd number of columns: silu_mul needs [gate | up]")
    if n % tiling.block_n:
        raise ValueError(f"output columns {n} (w {w.shape}, act {act}) are not a multiple of "
                         f"block_n {tiling.block_n}")
    if k % (tiling.block_k * tiling.k_splits):
        raise ValueError(f"K {k} is not a multiple of block_k {tiling.block_k} x k_splits "
                         f"{tiling.k_splits}")
    if act == "silu_mul" and tiling.k_splits != 1:
        raise ValueError(f"act {act!r} needs k_splits 1 (got {tiling.k_splits}): the "
                         "activation needs the whole sum")


@functools.partial(jax.jit, static_argnames=("act", "tiling", "interpret", "out_dtype"))
def skinny_matmul(x: jax.Array, w: jax.Array, *, act: str | None = None,
                  tiling: MatmulTiling = MatmulTiling(), interpret: bool = False,
                  scales: tuple[jax.Array, jax.Array] | None = None,
                  out_dtype=None) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in `out_dtype` (default x's; float32 accumulation;
    M a power of 2 >= 16, N a multiple of block_n, K of block_k x k_splits); with
    `act="silu_mul"`, w is [K, 2F] and the result silu(x @ w[:, :F]) * (x @ w[:, F:]).
    `scales` = (row scales [M], column scales [N]) float32: w is fp8 [N, K] and the
    product (x @ w.T) * row scale * column scale, x fp8 or fp8 values in a 16-bit dtype
    (module docstring)."""
    check_matmul_inputs(x, w, act, tiling, scales, out_dtype)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m, k = x.shape
    n = (w.shape[0] if scales is not None else w.shape[1]) // (2 if act == "silu_mul" else 1)
    splits = tiling.k_splits
    out_shape = (jax.ShapeDtypeStruct((m, n), out_dtype) if splits == 1
                 else jax.ShapeDtypeStruct((splits * m, n), jnp.float32))
    kernel = functools.partial(_matmul_kernel, tiling=tiling, act=act, num_rows=m,
                               k_per_split=k // splits, up_offset=n, fp8=scales is not None)
    inputs = (x, w)
    if scales is not None:
        inputs += (scales[0].astype(jnp.float32)[:, None], scales[1].astype(jnp.float32)[None])
    out = pl.pallas_call(
        kernel,
        grid=(n // tiling.block_n, splits, m // (tiling.block_m or m)),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                             num_stages=tiling.num_stages),
        name=f"skinny_matmul_n{tiling.block_n}_k{tiling.block_k}_s{splits}"
             + (f"_m{tiling.block_m}" if tiling.block_m else "")
             + ("_silu" if act else "") + ("_fp8" if scales is not None else ""),
    )(*inputs)
    if splits == 1:
        return out
    return out.reshape(splits, m, n).sum(axis=0).astype(out_dtype)


def skinny_matmul_reference(x: jax.Array, w: jax.Array, act: str | None = None) -> jax.Array:
    """The same in plain jnp (float32 accumulation, the matmul outputs in x's dtype)."""
    y = jnp.dot(x, w, precision=lax.Precision.HIGHEST,  # (GPU float32: not TF32)
                preferred_element_type=jnp.float32).astype(x.dtype)
    if act != "silu_mul":
        return y
    gate, up = jnp.split(y.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(x.dtype)
