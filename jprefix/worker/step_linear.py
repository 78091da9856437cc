"""The step's linear layers: which matmul runs each projection (XLA's dot, the few-row
`skinny_matmul` kernel, or the backend table's Mosaic GPU fp8 matmul), and which grouped
matmul runs a mixture of experts' experts (ragged_dot or the Pallas grouped GEMM), per
device under a mesh."""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from jprefix.worker.parallel import shard_columns, shard_experts
from models import moe
from models.fp8_linear import Fp8Weight, quantize_activations
from models.llama import LinearFn, dense_linear
from pallas_kernels import backend as kernel_backend
from pallas_kernels import grouped_matmul as gmm
from pallas_kernels.skinny_matmul import (
    SKINNY_MIN_PROGRAMS,
    fp8_tiling,
    skinny_matmul,
    skinny_tiling,
)


def step_linear(backend: str, mesh: Mesh | None) -> LinearFn:
    """The layers' matmuls: `skinny_matmul` where it beats XLA's (few rows, many output
    columns; one device), XLA's elsewhere (and for a mesh's row-parallel matmuls, whose
    all-reduce XLA inserts). fp8 weights take the kernel's fp8 x fp8 variant
    (`fp8_matmul`'s arithmetic, reading the fp8 bytes) on few rows at any column count
    (`fp8_tiling`). Interpret mode takes the bf16 kernel for any number of output
    columns (the rows' limit stays), so that the CPU tests' small models run it."""
    if backend == "xla" or mesh is not None:
        return dense_linear
    interpret = backend == "pallas-interpret"
    min_programs = 1 if interpret else SKINNY_MIN_PROGRAMS

    def linear(x, w, act=None):
        if act not in (None, "silu_mul"):  # (the kernel fuses SwiGLU only: Gemma's GeGLU)
            return dense_linear(x, w, act)
        fp8 = isinstance(w, Fp8Weight)
        n = w.shape[1] // (2 if act == "silu_mul" else 1)
        x2 = x.reshape(-1, x.shape[-1])
        tiling = (fp8_tiling(*x2.shape, n, act) if fp8 else
                  skinny_tiling(*x2.shape, n, act, min_programs=min_programs))
        if fp8 and act is None and (out := kernel_backend.fp8_matmul_mosaic(
                x2, w.w8, w.scale, quantize_activations)) is not None:
            return out.reshape(*x.shape[:-1], n)  # (where the backend table says Mosaic GPU)
        if tiling is None or (not fp8 and x.dtype != w.dtype):
            return dense_linear(x, w, act)
        if fp8:  # the activations quantised per row as fp8_matmul does, fp8 x fp8 dot
            x8, row_scale = quantize_activations(x2)
            out = skinny_matmul(x8, w.w8, act=act, tiling=tiling, interpret=interpret,
                                scales=(row_scale[:, 0], w.scale), out_dtype=x.dtype)
        else:
            out = skinny_matmul(x2, w, act=act, tiling=tiling, interpret=interpret)
        return out.reshape(*x.shape[:-1], n)

    return linear


def col_linear(backend: str, mesh: Mesh | None) -> LinearFn | None:
    """The column-parallel matmuls (Q/K/V, gate/up) under a mesh: `_linear`'s one-device
    choice per device on its columns (`parallel.shard_columns`); None (= `step_linear`)
    without one."""
    return None if mesh is None else shard_columns(step_linear(backend, None), mesh)


def step_experts(backend: str, mesh: Mesh | None) -> moe.ExpertsFn | None:
    """A mixture of experts' `experts_fn`: `models.moe.experts` with its grouped matmuls
    on XLA's ragged_dot ("xla") or the Pallas grouped GEMM (`kernel_grouped_matmul`; the
    Pallas backends), per device on its slice of every expert's F under a mesh
    (`parallel.shard_experts`). None: the model's default (ragged_dot, one device)."""
    if backend == "xla":
        return shard_experts(mesh)
    fn = functools.partial(moe.experts, matmul=kernel_grouped_matmul(
        interpret=backend == "pallas-interpret"))
    return fn if mesh is None else shard_experts(mesh, fn)


def kernel_grouped_matmul(interpret: bool) -> moe.GroupedMatmulFn:
    """`models.moe.grouped_matmul`'s contract on `pallas_kernels.grouped_matmul` (an
    `Fp8Weight` as its fp8 variant), with the kernel's tiling for the shape; ragged_dot
    where no tiling takes it (K or N not a multiple of 16) or the dtypes differ."""

    def matmul(x: jax.Array, w: jax.Array | Fp8Weight, group_sizes: jax.Array) -> jax.Array:
        fp8 = isinstance(w, Fp8Weight)
        groups, k, n = w.shape
        tiling = gmm.gmm_tiling(x.shape[0], k, n, groups, fp8=fp8, dtype=x.dtype)
        if tiling is None or (not fp8 and x.dtype != w.dtype):
            return moe.grouped_matmul(x, w, group_sizes)
        return gmm.grouped_matmul(x, w.w8 if fp8 else w, group_sizes,
                                  scale=w.scale if fp8 else None, tiling=tiling,
                                  interpret=interpret)

    return matmul
