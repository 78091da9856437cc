"""Grouped matmul for a mixture of experts: x [T, K] with rows sorted by group (expert),
group g owning `group_sizes[g]` consecutive rows, times each group's own weight
w [G, K, N] -> [T, N] (`jax.lax.ragged_dot`'s contract: rows past sum(group_sizes) come
out 0); float32 accumulation, the result in x's dtype.

Why a kernel: XLA:GPU expands ragged_dot into a product over every group (all G experts'
weights against all rows, masked), so a Qwen3-30B-A3B layer (128 experts, 8 per token)
does ~16x the work and reads every expert where a step may touch a few.

Design (the MoE grouped GEMM's): the rows are cut into tiles of `block_m` rows with a
tile boundary at every group start, so no tile spans two groups; `tile_metadata` (jnp,
outside the kernel) gives each tile its group and row range, and the kernel reads them
as scalars (Triton has no scalar prefetch). A program owns one row tile x `block_n`
columns: it walks K in `block_k` steps with `pl.dot`, reading its group's weight tile,
and stores its rows. A tile's rows are gathered by index, clamped to its group's last
row, so a group's ragged end needs no mask: a repeated row computes and stores the same
value as the row itself. The grid is sized for the most tiles any split of T rows into
G groups can need (T // block_m + min(G + 1, T)); tiles past the last return at once.
Rows past sum(group_sizes) form one more group whose tiles store zeros. The grid is one
axis with the column tiles fastest: the programs running together then share x's rows
(read once from DRAM, block_n columns at a time from L2) and a group's weight columns.

Decode-size steps (a few rows per expert) are bound by reading the touched experts'
weights: a 16-row tile (the smallest dot) and narrow column tiles, so enough programs
stream the weights. Prefill-size steps (hundreds of rows per expert) are a GEMM: 64-128
row tiles (`gmm_tiling`).

fp8 weights (`scale` given): w is float8_e4m3fn [G, N, K] (K-major, `models.fp8_linear`'s
`Fp8Weight.w8`) with float32 scales [G, N]; a program converts its weight tiles to x's
dtype (exact for e4m3), accumulates in float32 and scales its columns by its group's
scales once (W8A16: x is not quantised).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import FLOAT_DTYPES, INT32, is_pow2, next_pow2

FP8 = jnp.dtype(jnp.float8_e4m3fn)
_FP8_DIMS = lax.RaggedDotDimensionNumbers(  # x [T, K] . w8 [G, N, K] over K
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


@dataclasses.dataclass(frozen=True)
class GmmTiling:
    """Launch parameters: rows per tile, output columns and K per step of a program."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def _divisor(size: int, options: tuple[int, ...]) -> int | None:
    """The first of `options` dividing `size` (None: none does)."""
    return next((b for b in options if size % b == 0), None)


def gmm_tiling(rows: int, k: int, n: int, num_groups: int, *, fp8: bool = False,
               dtype=jnp.bfloat16) -> GmmTiling | None:
    """The default tiling for `rows` rows in `num_groups` groups times [K, N] weights,
    per regime (module docstring); None where the kernel cannot take the shape (K or N
    not a multiple of 16)."""
    per_group = -(-rows // max(1, min(num_groups, rows)))  # rows per touched group
    block_m = min(128, max(16, next_pow2(per_group)))
    f32 = jnp.dtype(dtype) == jnp.float32
    if block_m == 16:  # weight-bound: narrow columns, many programs to stream them
        programs = min(num_groups, rows)
        block_n = next((b for b in (128, 64, 32) if n % b == 0 and programs * n // b >= 264),
                       _divisor(n, (32, 16)))
        block_k = _divisor(k, (128, 64, 32, 16))
        warps, stages = 4, 4
    else:
        block_n = _divisor(n, (128, 64, 32, 16))
        block_k = _divisor(k, (64, 32, 16))
        warps, stages = (8 if block_m * (block_n or 0) >= 128 * 128 else 4), 3
    if block_n is None or block_k is None:
        return None
    if f32:  # float32 tiles take twice the shared memory
        block_k, stages = min(block_k, 32), 2
    return GmmTiling(block_m, block_n, block_k, warps, stages)


def num_tiles(rows: int, num_groups: int, block_m: int) -> int:
    """The most row tiles `rows` rows in num_groups groups (+ the zero tail) can need:
    each non-empty group adds at most one partial tile."""
    return rows // block_m + min(num_groups + 1, rows)


def tile_metadata(group_sizes: jax.Array, rows: int, block_m: int) -> jax.Array:
    """[num_tiles, 3] int32 per row tile: (group, first row, end row) of its group.
    group G: rows past sum(group_sizes) (stored as zeros); -1: a padding tile. Group
    ends are clamped to `rows`, so sizes summing past it lose their last rows."""
    g = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), rows)
    ends = jnp.concatenate([ends, jnp.full((1,), rows, jnp.int32)])  # + the zero tail
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    tiles = -(-(ends - starts) // block_m)  # per group, [G + 1]
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles(rows, g, block_m), dtype=jnp.int32)
    group = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    live = group <= g
    safe = jnp.minimum(group, g)
    first = starts[safe] + (t - (tile_end[safe] - tiles[safe])) * block_m
    return jnp.stack([jnp.where(live, group, -1), first, ends[safe]], axis=1)


def _kernel(meta_ref, x_ref, w_ref, *refs, tiling: GmmTiling, num_groups: int, k: int,
            n: int, fp8: bool):
    """meta_ref [NT, 3] int32 (`tile_metadata`); x_ref [T, K]; w_ref [G*K, N] (fp8:
    [G*N, K], then refs starts with the scales [G*N] float32); o_ref [T, N]. Program p:
    column tile p % (N / block_n) of row tile p // (N / block_n)."""
    cols = n // tiling.block_n
    # (the program id is read out here: interpret mode cannot lower it inside a cond)
    tile, j = pl.program_id(0) // cols, pl.program_id(0) % cols
    group = meta_ref[tile, 0]
    pl.when((group >= 0) & (group < num_groups))(functools.partial(
        _matmul_tile, tile, j, meta_ref, x_ref, w_ref, *refs, tiling=tiling, k=k, n=n,
        fp8=fp8))
    pl.when(group == num_groups)(functools.partial(
        _zero_tile, tile, j, meta_ref, refs[-1], tiling=tiling))


def _tile_rows(tile, j, meta_ref, tiling: GmmTiling):
    """The tile's output rows [block_m] (clamped to its group's last) and columns."""
    first, end = meta_ref[tile, 1], meta_ref[tile, 2]
    rows = jnp.minimum(first + jnp.arange(tiling.block_m, dtype=jnp.int32), end - 1)
    return rows, j * tiling.block_n + jnp.arange(tiling.block_n, dtype=jnp.int32)


def _matmul_tile(tile, j, meta_ref, x_ref, w_ref, *refs, tiling: GmmTiling, k: int, n: int,
                 fp8: bool):
    """One live tile: its rows times its group's weight columns over all of K."""
    *scale_refs, o_ref = refs
    rows, cols = _tile_rows(tile, j, meta_ref, tiling)
    group = meta_ref[tile, 0]
    bk, bn, n0 = tiling.block_k, tiling.block_n, j * tiling.block_n
    ks = jnp.arange(bk, dtype=jnp.int32)
    # float32 inputs multiply in full precision (Triton's default for them is TF32)
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(i, acc):
        k0 = pl.multiple_of(i * bk, bk)
        x = x_ref[rows[:, None], (k0 + ks)[None, :]]  # [bm, bk]
        if fp8:  # [bn, bk] fp8 -> x's dtype (exact), contracted over its minor axis
            w = w_ref[pl.ds(group * n + n0, bn), pl.ds(k0, bk)].astype(x.dtype)
            return acc + plgpu.dot(x, w, trans_b=True, precision=precision)
        w = w_ref[pl.ds(group * k + k0, bk), pl.ds(n0, bn)]  # [bk, bn]
        return acc + plgpu.dot(x, w, precision=precision)

    acc = lax.fori_loop(0, k // bk, body, jnp.zeros((tiling.block_m, bn), jnp.float32))
    if fp8:
        acc = acc * scale_refs[0][pl.ds(group * n + n0, bn)][None, :]
    o_ref[rows[:, None], cols[None, :]] = acc.astype(o_ref.dtype)


def _zero_tile(tile, j, meta_ref, o_ref, *, tiling: GmmTiling):
    """A tile of the rows past sum(group_sizes): zeros, as ragged_dot gives."""
    rows, cols = _tile_rows(tile, j, meta_ref, tiling)
    o_ref[rows[:, None], cols[None, :]] = jnp.zeros((tiling.block_m, tiling.block_n),
                                                    o_ref.dtype)


def check_inputs(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tiling: GmmTiling,
                 scale: jax.Array | None = None) -> None:
    """Raises ValueError naming the shape, dtype or tiling value the kernel cannot take."""
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"x {x.shape} must be [T, K] and w {w.shape} [G, K, N]")
    g = w.shape[0]
    k, n = (w.shape[2], w.shape[1]) if scale is not None else w.shape[1:]
    if x.shape[1] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} disagree on K")
    if group_sizes.shape != (g,) or jnp.dtype(group_sizes.dtype) != INT32:
        raise ValueError(f"group_sizes {group_sizes.dtype}{list(group_sizes.shape)} must be "
                         f"int32 [G] = [{g}]")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"x ({x.dtype}) must be one of {FLOAT_DTYPES}")
    if scale is not None:
        if jnp.dtype(w.dtype) != FP8 or tuple(scale.shape) != (g, n):
            raise ValueError(f"with scale {tuple(scale.shape)}, w ({w.dtype}{list(w.shape)}) "
                             f"must be {FP8} [G, N, K] and scale [G, N] = [{g}, {n}]")
    elif x.dtype != w.dtype:
        raise ValueError(f"x ({x.dtype}) and w ({w.dtype}) must share a float dtype")
    sizes = (tiling.block_m, tiling.block_n, tiling.block_k)
    if not all(b >= 16 and is_pow2(b) for b in sizes):
        raise ValueError(f"block_m, block_n, block_k {sizes} must be powers of 2 >= 16 "
                         "(Triton's smallest dot)")
    if n % tiling.block_n or k % tiling.block_k:
        raise ValueError(f"N {n} and K {k} must be multiples of block_n {tiling.block_n} "
                         f"and block_k {tiling.block_k}")


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   scale: jax.Array | None = None, tiling: GmmTiling | None = None,
                   interpret: bool = False) -> jax.Array:
    """x [T, K] (rows sorted by group) times w [G, K, N] per group -> [T, N] in x's
    dtype, float32 accumulation; rows past sum(group_sizes [G] int32) are 0. With
    `scale` [G, N] float32, w is fp8 [G, N, K] and each group's result columns are
    scaled (module docstring). `tiling` None: `gmm_tiling`'s for the shape."""
    fp8 = scale is not None
    rows, k = x.shape
    g, n = w.shape[0], (w.shape[1] if fp8 else w.shape[2])
    if tiling is None:
        tiling = gmm_tiling(rows, k, n, g, fp8=fp8, dtype=x.dtype)
        if tiling is None:
            raise ValueError(f"no tiling takes K {k}, N {n} (multiples of 16 are needed)")
    check_inputs(x, w, group_sizes, tiling, scale)
    if rows == 0:
        return jnp.zeros((0, n), x.dtype)
    meta = tile_metadata(group_sizes, rows, tiling.block_m)
    inputs = (meta, x, w.reshape(g * w.shape[1], w.shape[2]))
    inputs += (scale.astype(jnp.float32).reshape(g * n),) if fp8 else ()
    kernel = functools.partial(_kernel, tiling=tiling, num_groups=g, k=k, n=n, fp8=fp8)
    return pl.pallas_call(
        kernel,
        grid=(meta.shape[0] * (n // tiling.block_n),),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                             num_stages=tiling.num_stages),
        name=f"grouped_matmul_m{tiling.block_m}_n{tiling.block_n}_k{tiling.block_k}"
             + ("_fp8" if fp8 else ""),
    )(*inputs)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                             scale: jax.Array | None = None) -> jax.Array:
    """The same by `jax.lax.ragged_dot` (float32 accumulation, full precision)."""
    if scale is None:
        y = lax.ragged_dot(x, w, group_sizes, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    y = lax.ragged_dot_general(x, w.astype(x.dtype), group_sizes, _FP8_DIMS,
                               precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    row_group = jnp.repeat(jnp.arange(w.shape[0], dtype=jnp.int32), group_sizes,
                           total_repeat_length=x.shape[0])
    # rows past sum(group_sizes) are 0 in y: any finite scale keeps them 0
    return (y * scale[jnp.minimum(row_group, w.shape[0] - 1)]).astype(x.dtype)
