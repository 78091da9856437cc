"""fp8 x fp8 matmul on Mosaic GPU (Hopper wgmma + TMA), the activations quantised inside.

    y [M, N] = (quant(x) @ w8.T) * x_scale[:, None] * w_scale[None, :]   (bf16 out)

x [M, K] bf16 activations; w8 [N, K] float8_e4m3fn weights stored K-major (the layout
`models.fp8_linear.Fp8Weight` keeps, and the only one Hopper's fp8 wgmma takes for its
B operand) with one float32 scale per output channel, `w_scale [N]`. `x_scale [M]` is one
scale per token row, amax(|x[m]|) / 448 (`pallas_kernels.fp8.row_scale`), and
quant(x) = e4m3(x / x_scale) saturated at +-448: the arithmetic of
`models.fp8_linear.fp8_matmul` with per-token scales, except that the float32 sum is
scaled once in float32 (fp8_matmul rounds the dot to bf16 first).

Passes. A row's scale needs the whole row's amax before any of its elements can be
quantised, and a tile of the kernel sees only `tile_k` of K at a time, so the amax is one
XLA reduction over x (reading it once, writing M floats) ahead of the kernel; everything
else is one kernel (`quant="fused"`): per K step the producer warpgroup brings a
[rows, tile_k] bf16 tile of x and a [cols, tile_k] fp8 tile of w into shared memory by
TMA (`max_stages` deep); each of the two consumer warpgroups loads its 64-row slice of
the x tile into registers (the wgmma 8-bit operand layout), multiplies by the rows'
inverse scales, converts to e4m3 and issues wgmma with A from registers (or, with
`a_operand="smem"`, through a shared-memory tile) and B (w) from shared memory; the
epilogue scales the float32 accumulator by the row and column scales and stores bf16
through shared memory by TMA. `quant="pre"` takes x already quantised (fp8 [M, K] with
its row scales, by XLA's fusion as today): the same kernel with A from shared memory.
It measured faster than the fused form on every shape, and is what the engine runs
where the backend table picks Mosaic (`backend.fp8_matmul_mosaic`; docs/PERF.md).

Tiles: a CTA owns 2 x `tile_m` rows x `tile_n` columns (`wg_split` "m": each consumer
warpgroup takes `tile_m` of the rows) or `tile_m` x 2 x `tile_n` ("n": each takes
`tile_n` of the columns, for few rows). Rows are padded to a multiple of the CTA's (zero
rows, scale 1, cut off after); N must be a multiple of the CTA's columns, K of `tile_k`.

No interpret mode: the Mosaic GPU interpreter of jax 0.10.2 (Pallas's CPU simulation of
this backend) has no `plgpu.load`, no wgmma with A in registers and no transposed B
operand, all of which this kernel needs; it runs on Hopper GPUs only (tests/test_mgpu_*),
and was built and measured with jax 0.11.2 (`backend.MOSAIC_MIN_JAX`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import row_scale

FP8 = jnp.dtype(jnp.float8_e4m3fn)
QUANT_MODES = ("fused", "pre")
_COMPUTE_WGS = 2
SMEM_BYTES = 232448  # the shared memory a Hopper CTA may take (227 KiB)


@dataclasses.dataclass(frozen=True)
class MgpuMatmulConfig:
    """Launch parameters: a consumer warpgroup's tile_m rows (a multiple of 64, wgmma's
    M) x tile_n columns (<= 256, wgmma's N), K per pipeline step, pipeline depth, and
    the variants (module docstring). The defaults are the engine's: the tiling that
    measured fastest at 256 and 4,096 rows."""

    tile_m: int = 64
    tile_n: int = 256
    tile_k: int = 64
    max_stages: int = 4
    wg_split: str = "m"  # the consumer warpgroups split the CTA's tile along M or N
    a_operand: str = "regs"  # quantised x: wgmma's A from registers, or through smem
    delay_release: int = 0  # 1 (quant "pre"): a step's wgmma runs on into the next step


def _load(ref, layout, optimized: bool = True):
    """The whole of `ref` in registers in `layout` (jax >= 0.11's plgpu.load);
    `optimized` False for a load from global memory."""
    return plgpu.load(ref, layout=layout, optimized=optimized)


def _bcast(v, shape, dim: int, layout):
    """v [shape[dim]] broadcast along the other axis of a 2-D `shape`, in `layout`."""
    return plgpu.layout_cast(lax.broadcast_in_dim(v, shape, [dim]), layout)


def check_inputs(x, w8, w_scale, config: MgpuMatmulConfig, quant: str) -> None:
    """Raises ValueError naming the shape, dtype or config value the kernel cannot take."""
    if quant not in QUANT_MODES:
        raise ValueError(f"quant {quant!r} is not one of {QUANT_MODES}")
    if x.ndim != 2 or w8.ndim != 2:
        raise ValueError(f"x {x.shape} and w8 {w8.shape} must both be 2-D")
    want = FP8 if quant == "pre" else jnp.dtype(jnp.bfloat16)
    if x.dtype != want or w8.dtype != FP8:
        raise ValueError(f"x ({x.dtype}) must be {want} and w8 ({w8.dtype}) {FP8}")
    (m, k), (n, k2) = x.shape, w8.shape
    if k != k2:
        raise ValueError(f"x {x.shape} and w8 {w8.shape} (= [N, K]) disagree on K")
    if w_scale.shape != (n,):
        raise ValueError(f"w_scale {w_scale.shape} must be [N] = [{n}]")
    c = config
    if c.tile_m % 64 or c.tile_n % 8 or not 8 <= c.tile_n <= 256 or c.max_stages < 2:
        raise ValueError(f"{c}: tile_m must be a multiple of 64, tile_n a multiple of 8 "
                         "in [8, 256], max_stages >= 2")
    if c.wg_split not in ("m", "n") or c.a_operand not in ("regs", "smem"):
        raise ValueError(f"{c}: wg_split must be 'm' or 'n', a_operand 'regs' or 'smem'")
    if c.delay_release not in (0, 1) or c.delay_release >= c.max_stages - 1:
        raise ValueError(f"{c}: delay_release must be 0 or 1, below max_stages - 1")
    if c.delay_release and quant == "fused":
        raise ValueError(f"{c}: delay_release must be 0 with quant 'fused' (the next "
                         "step's quantised A would overwrite the operand of a wgmma still "
                         "running: wrong results on an H200)")
    if c.tile_k not in (64, 128):
        raise ValueError(f"tile_k {c.tile_k} must be 64 or 128 (one swizzle span of fp8)")
    if k % c.tile_k:
        raise ValueError(f"K {k} must be a multiple of tile_k {c.tile_k}")
    cta_n = _cta(c)[1]
    if n % cta_n:
        raise ValueError(f"N {n} must be a multiple of the CTA's {cta_n} columns ({c})")
    if m < 1:
        raise ValueError(f"x has {m} rows")
    if (need := smem_bytes(c, quant, k)) > SMEM_BYTES:
        raise ValueError(f"{c} needs {need} bytes of shared memory with quant {quant!r}, "
                         f"over a Hopper CTA's {SMEM_BYTES}: fewer stages or smaller tiles")


def smem_bytes(config: MgpuMatmulConfig, quant: str, k: int) -> int:
    """The shared memory a CTA takes: the pipeline's x and w tiles per stage, the two
    warpgroups' bf16 output tiles, their fp8 A tiles (a_operand "smem"), and 1 KiB for
    the barriers and alignment (the Mosaic GPU compiler's count, seen on an H200, was
    the first three plus 64 bytes)."""
    c = config
    cta_m, cta_n = _cta(c)
    stages = min(c.max_stages, k // c.tile_k)
    x_bytes = 1 if quant == "pre" else 2
    a8 = _COMPUTE_WGS * c.tile_m * c.tile_k if quant == "fused" and c.a_operand == "smem" else 0
    return (stages * (cta_m * c.tile_k * x_bytes + cta_n * c.tile_k)
            + _COMPUTE_WGS * c.tile_m * c.tile_n * 2 + a8 + 1024)


def _cta(c: MgpuMatmulConfig) -> tuple[int, int]:
    """A CTA's rows and columns of the output."""
    return c.tile_m * (1 + (c.wg_split == "m")), c.tile_n * (1 + (c.wg_split == "n"))


def _transforms(cols: int, dtype) -> tuple:
    """Tiling + swizzle of a shared-memory tile whose rows are `cols` elements."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _kernel(x_gmem, w_gmem, inv_gmem, xs_gmem, ws_gmem, out_gmem, out_smem, a8_smem, *,
            config: MgpuMatmulConfig, k_steps: int, quant: str):
    """One CTA: its rows x its columns of the output over all of K; the two consumer
    warpgroups split the CTA's tile along M (`wg_split` "m") or N ("n")."""
    c = config
    tm, tn, tk = c.tile_m, c.tile_n, c.tile_k
    split_m = c.wg_split == "m"
    cta_m, cta_n = _cta(c)
    m_idx, n_idx = lax.axis_index("m"), lax.axis_index("n")
    wg = lax.axis_index("wg")
    wg_m = pl.ds(wg * tm, tm) if split_m else pl.ds(0, tm)  # within the CTA's tile
    wg_n = pl.ds(0, tn) if split_m else pl.ds(wg * tn, tn)
    fused = quant == "fused"

    def compute_context(eval_pipeline):
        rows = pl.ds(m_idx * cta_m + wg_m.start, tm)  # global
        cols = pl.ds(n_idx * cta_n + wg_n.start, tn)
        inv = None
        if fused:
            inv = _load(inv_gmem.at[rows], plgpu.Layout.WGMMA_8BIT.reduce(1), optimized=False)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
        def _epilogue(acc_ref):
            eval_pipeline((acc_ref, inv))
            acc = acc_ref[...]
            xs = _load(xs_gmem.at[rows], plgpu.Layout.WGMMA.reduce(1), optimized=False)
            ws = _load(ws_gmem.at[cols], plgpu.Layout.WGMMA.reduce(0), optimized=False)
            y = (acc * _bcast(xs, (tm, tn), 0, plgpu.Layout.WGMMA)
                 * _bcast(ws, (tm, tn), 1, plgpu.Layout.WGMMA))
            out_smem[wg] = y.astype(out_gmem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[rows, cols])
            plgpu.wait_smem_to_gmem(0)

    def mma_body(_, x_smem, w_smem, carry):
        acc_ref, inv = carry
        x_tile = x_smem.at[wg_m]
        w_t = plgpu.transpose_ref(w_smem.at[wg_n], (1, 0))  # [tile_k, tile_n], K-major
        a = x_tile
        if fused:  # this warpgroup's rows of the x tile, quantised (e4m3 saturates)
            x = _load(x_tile, plgpu.Layout.WGMMA_8BIT).astype(jnp.float32)
            a = (x * _bcast(inv, (tm, tk), 0, plgpu.Layout.WGMMA_8BIT)
                 ).astype(FP8)
            if c.a_operand == "smem":
                a8_smem[wg] = a
                plgpu.commit_smem()
                a = a8_smem.at[wg]
        plgpu.wgmma(acc_ref, a, w_t)
        plgpu.wgmma_wait(c.delay_release)  # (the slot is released that many steps later)
        return carry

    pipeline = plgpu.emit_pipeline_warp_specialized(
        mma_body,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((cta_m, tk), lambda k: (0, k), delay_release=c.delay_release,
                            transforms=_transforms(tk, x_gmem.dtype)),
            plgpu.BlockSpec((cta_n, tk), lambda k: (0, k), delay_release=c.delay_release,
                            transforms=_transforms(tk, FP8)),
        ],
        wg_axis="wg",
        num_compute_wgs=_COMPUTE_WGS,
        max_concurrent_steps=min(c.max_stages, k_steps),
        compute_context=compute_context,
    )
    pipeline(x_gmem.at[pl.ds(m_idx * cta_m, cta_m)], w_gmem.at[pl.ds(n_idx * cta_n, cta_n)])


ENGINE_CONFIG = MgpuMatmulConfig()


def takes(k: int, n: int, config: MgpuMatmulConfig = ENGINE_CONFIG) -> bool:
    """Whether the kernel takes a weight of K x N with `config` (any row count does)."""
    return k % config.tile_k == 0 and n % _cta(config)[1] == 0


@functools.partial(jax.jit, static_argnames=("config", "quant"))
def mgpu_fp8_matmul(x: jax.Array, w8: jax.Array, w_scale: jax.Array, *,
                    config: MgpuMatmulConfig = MgpuMatmulConfig(), quant: str = "fused",
                    x_scale: jax.Array | None = None) -> jax.Array:
    """x [M, K] bf16 (quant "fused") @ w8 [N, K] fp8 -> [M, N] bf16 (module docstring).
    With quant "pre", x is already fp8 and `x_scale` [M] its row scales."""
    check_inputs(x, w8, w_scale, config, quant)
    m, k = x.shape
    n = w8.shape[0]
    if quant == "fused":
        x_scale = row_scale(jnp.max(jnp.abs(x), axis=-1).astype(jnp.float32), FP8)
    elif x_scale is None or x_scale.shape != (m,):
        raise ValueError(f"quant 'pre' needs x_scale [M] = [{m}], got "
                         f"{None if x_scale is None else x_scale.shape}")
    c = config
    cta_m, cta_n = _cta(c)
    mp = -(-m // cta_m) * cta_m
    pad = mp - m
    xs = jnp.pad(x_scale.astype(jnp.float32), (0, pad), constant_values=1.0)
    xp = jnp.pad(x, ((0, pad), (0, 0)))
    out_dtype = jnp.dtype(jnp.bfloat16)
    kernel = functools.partial(_kernel, config=c, k_steps=k // c.tile_k, quant=quant)
    a8 = (plgpu.SMEM((_COMPUTE_WGS, c.tile_m, c.tile_k), FP8,
                     transforms=_transforms(c.tile_k, FP8))
          if quant == "fused" and c.a_operand == "smem" else None)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(n // cta_n, mp // cta_m),
        grid_names=("n", "m"),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        scratch_types=[plgpu.SMEM((_COMPUTE_WGS, c.tile_m, c.tile_n), out_dtype,
                                  transforms=_transforms(c.tile_n, out_dtype)), a8],
    )
    out = call(xp, w8, 1.0 / xs, xs, w_scale.astype(jnp.float32))
    return out[:m]


def mgpu_fp8_matmul_reference(x: jax.Array, w8: jax.Array, w_scale: jax.Array) -> jax.Array:
    """The same function in plain jnp: per-row e4m3 quantisation of x, the dot in float32
    of the exact fp8 values, both scales, bf16 out."""
    xf = x.astype(jnp.float32)
    xs = row_scale(jnp.max(jnp.abs(xf), axis=-1), FP8)
    x8 = jnp.clip(xf * (1.0 / xs)[:, None], -448.0, 448.0).astype(FP8)
    return _dot_scaled(x8, xs, w8, w_scale)


def _dot_scaled(x8, xs, w8, w_scale):
    y = jnp.dot(x8.astype(jnp.float32), w8.astype(jnp.float32).T,
                precision=lax.Precision.HIGHEST)
    return (y * xs[:, None] * w_scale[None, :].astype(jnp.float32)).astype(jnp.bfloat16)
