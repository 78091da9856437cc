"""Ragged paged prefill / prefix-prefill attention on Mosaic GPU (Hopper wgmma + TMA).

The contract of `paged_attention.paged_attention` for causal prefill rows: sequence s
owns query rows `cu_q_lens[s]:cu_q_lens[s+1]` at the last q_len of its `kv_lens[s]`
positions and attends to every cached key at or before its position (the cached prefix
included), found through `block_tables[s]` in the `[L, K, N, B, D]` caches; query head h
reads KV head h // G; rows past `cu_q_lens[S]` come out as zeros. Optional ALiBi slopes
([H] float32, `alibi.py`). Refused by name (`refusal`): fp8 caches, sliding windows,
soft caps, `causal=False`, the log-sum-exp output, dtypes other than bf16, head dims
other than 128, pages whose B is not a multiple of 8 dividing `block_kv`.

Work: one CTA per (tile, query head), a tile being `compute_wgs` x 64 query rows from a
multiple of 8 (`row_tiles`: a TMA copy into a swizzled tile cannot start inside its
8-row tiling), of which it stores one sequence's; empty tiles return at once. A producer
warpgroup walks the tile's key steps (`block_kv` keys = block_kv / B pages, read from
the block table) and TMA-copies each page's [B, D] K and V rows into the step's slot of
a `max_stages`-deep ring in shared memory, one barrier per slot counting its pages. Each
consumer warpgroup TMA-loads its 64 query rows once, then per step: S = Q K^T by wgmma
(A and B from shared memory), the online softmax in log2 units on the float32 tile (the
causal mask only on the steps past the tile's first row), O += P V by wgmma (P from
registers), and releases the slot. Both consumers walk every step of the tile, so the
producer refills a slot once both released it. With `pingpong` the two consumers take
turns on the tensor cores (FlashAttention-3's schedule: one's softmax overlaps the
other's matmuls). The output goes through shared memory and TMA stores of 64, 32, ..., 1
rows, so a tile writes exactly its sequence's rows.

No interpret mode: Mosaic GPU's interpreter cannot run these primitives on the CPU; the
kernel runs on Hopper GPUs with jax >= `backend.MOSAIC_MIN_JAX` only. On the CPU the
tests trace and lower it for CUDA (`jax.jit(...).trace(...).lower(lowering_platforms=
("cuda",))`), which runs Mosaic GPU's lowering in Python and catches shape, layout and
indexing errors before a GPU sees it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_paged_prefill_kernel import BF16, HEAD_DIM, ROWS, kernel

SMEM_BYTES = 232448  # the shared memory a Hopper CTA may take (227 KiB)
# jax 0.11's default lowering (FlashAttention-3's example, the fp8 matmul run under it);
# the kernel also lowers with Lane semantics (tests/test_mgpu_paged_prefill.py)
LOWERING = plgpu.LoweringSemantics.Warpgroup


@dataclasses.dataclass(frozen=True)
class MgpuPrefillConfig:
    """Keys per pipeline step, pipeline depth, consumer warpgroups per CTA (each 64
    query rows) and FlashAttention-3's ping-pong between two consumers. None of them
    changes the function computed."""

    block_kv: int = 128
    max_stages: int = 2
    compute_wgs: int = 2
    pingpong: bool = False

    @property
    def block_q(self) -> int:
        return ROWS * self.compute_wgs


# the engine's (`backend.prefill_attention_mosaic`): FlashAttention-3's ping-pong measured
# 2% faster than without on both benchmarked shapes of an H200 (docs/PERF.md)
ENGINE_CONFIG = MgpuPrefillConfig(pingpong=True)


def smem_bytes(config: MgpuPrefillConfig) -> int:
    """Shared memory a CTA takes: per consumer a swizzled Q tile and a plain output tile
    (bf16 [64, D] each), K and V rings of `max_stages` x [block_kv, D], 1 KiB for
    barriers and alignment."""
    c = config
    return (2 * c.compute_wgs * ROWS * HEAD_DIM + 2 * c.max_stages * c.block_kv * HEAD_DIM
            ) * 2 + 1024


def refusal(q, k_cache, *, config: MgpuPrefillConfig = MgpuPrefillConfig(),
            scale: float = 1.0, k_scale=None, sliding_window=None, soft_cap=None,
            causal: bool = True, return_lse: bool = False) -> str | None:
    """Why the kernel cannot run this call (None: it can). Shapes and dtypes beyond
    these are `paged_attention._check_inputs`'s to judge."""
    c = config
    if k_scale is not None:
        return "an fp8 KV cache (k_scale) is not supported by the Mosaic GPU prefill kernel"
    if sliding_window is not None:
        return "sliding_window is not supported by the Mosaic GPU prefill kernel"
    if soft_cap is not None:
        return f"soft_cap {soft_cap} is not supported by the Mosaic GPU prefill kernel"
    if not scale > 0:
        return f"scale {scale} must be > 0 (the kernel's max commutes with it)"
    if not causal or return_lse:
        return "causal=False and return_lse are not supported by the Mosaic GPU prefill kernel"
    if jnp.dtype(q.dtype) != BF16 or jnp.dtype(k_cache.dtype) != BF16:
        return f"q ({q.dtype}) and the caches ({k_cache.dtype}) must be bfloat16"
    if q.ndim != 3 or k_cache.ndim != 5 or q.shape[-1] != HEAD_DIM or k_cache.shape[-1] != HEAD_DIM:
        return f"head_dim must be {HEAD_DIM}: q {q.shape}, k_cache {k_cache.shape}"
    b = k_cache.shape[3]
    if c.block_kv not in (64, 128) or c.compute_wgs not in (1, 2) or c.max_stages < 2:
        return f"{c}: block_kv must be 64 or 128, compute_wgs 1 or 2, max_stages >= 2"
    if c.pingpong and c.compute_wgs != 2:
        return f"{c}: pingpong needs compute_wgs 2"
    if b % 8 or c.block_kv % b:
        return f"block_size {b} must be a multiple of 8 dividing block_kv {c.block_kv}"
    if (need := smem_bytes(c)) > SMEM_BYTES:
        return f"{c} needs {need} bytes of shared memory, over a Hopper CTA's {SMEM_BYTES}"
    return None


def takes(q, k_cache, **kw) -> bool:
    """Whether the kernel can run this call (`refusal` is None)."""
    return refusal(q, k_cache, **kw) is None


def check_inputs(q, k_cache, **kw) -> None:
    """Raises ValueError naming what the kernel cannot take (`refusal`)."""
    if (why := refusal(q, k_cache, **kw)) is not None:
        raise ValueError(why)


def row_tiles(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int,
              block_q: int) -> jax.Array:
    """The kernel's tiles, int32 [max_tiles(T, S, block_q), 6]: per tile `[seq, row8, lo,
    n, pos0, kv_len]`: the tile computes the block_q query rows from `row8 * 8`, of which
    rows `row8 * 8 + i`, i in [lo, lo + n), are sequence `seq`'s and stored, row i at
    position `pos0 + i`. A sequence's tiles start at its first row rounded down to a
    multiple of 8 (a TMA copy into a swizzled tile cannot start inside its 8-row tiling),
    so a tile computes at most 7 rows of the sequence before and the rows after its
    sequence's end, and stores none of them (two tiles may load the same rows). Rows
    `cu_q_lens[S]:T` form one more sequence of no keys: they come out as zeros. Tiles
    past the last have n = 0."""
    s = kv_lens.shape[0]
    starts = cu_q_lens
    ends = jnp.maximum(jnp.concatenate([cu_q_lens[1:], jnp.full((1,), num_tokens, jnp.int32)]),
                       starts)
    q_lens = ends - starts
    kv = jnp.concatenate([kv_lens, jnp.zeros((1,), jnp.int32)])
    first = starts - starts % 8  # the sequence's first tile's first row
    count = (ends - first + block_q - 1) // block_q * (q_lens > 0)
    tile_end = jnp.cumsum(count)
    t = jnp.arange(max_tiles(num_tokens, s, block_q), dtype=jnp.int32)
    seg = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)
    live = seg <= s
    seg = jnp.minimum(seg, s)
    row = first[seg] + (t - (tile_end[seg] - count[seg])) * block_q
    lo = jnp.clip(starts[seg] - row, 0, block_q)
    n = jnp.clip(ends[seg] - row, 0, block_q) - lo
    meta = [jnp.minimum(seg, s - 1), jnp.where(live, row // 8, 0), lo,
            jnp.where(live, jnp.maximum(n, 0), 0), kv[seg] - q_lens[seg] + row - starts[seg],
            jnp.where(live, kv[seg], 0)]
    return jnp.stack(meta, axis=1).astype(jnp.int32)


def max_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """The most tiles `row_tiles` can give: each of the S + 1 row ranges (the padding
    rows' included) starts up to 7 rows early and ends in a partial tile."""
    return (num_tokens + 7 * (num_seqs + 1)) // block_q + num_seqs + 1


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def mgpu_paged_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                       layer: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
                       cu_q_lens: jax.Array, *, scale: float,
                       alibi_slopes: jax.Array | None = None,
                       config: MgpuPrefillConfig = MgpuPrefillConfig()) -> jax.Array:
    """Causal paged attention of a ragged prefill batch, [T, H, D] bf16 (module
    docstring); the arguments as `paged_attention`'s. ValueError for what the kernel
    cannot take (`check_inputs`)."""
    check_inputs(q, k_cache, config=config, scale=scale)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {v_cache.dtype}{v_cache.shape} must match k_cache "
                         f"{k_cache.dtype}{k_cache.shape}")
    t, h, d = q.shape
    kh, b = k_cache.shape[1], k_cache.shape[3]
    if h % kh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kh})")
    if alibi_slopes is not None and alibi_slopes.shape != (h,):
        raise ValueError(f"alibi_slopes must be [H] = [{h}], got {alibi_slopes.shape}")
    c = config
    pages = c.block_kv // b
    bt = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % pages)))
    # Q's TMA box (64 rows, 8-row tiles) needs rows a multiple of 8 and at least 64 each
    tp = max(-(-t // 8) * 8, c.block_q)
    qp = q if tp == t else jnp.pad(q, ((0, tp - t), (0, 0), (0, 0)))
    meta = row_tiles(cu_q_lens, kv_lens, t, c.block_q)
    inputs = [meta, bt, jnp.asarray(layer, jnp.int32).reshape(1), qp.reshape(tp, h * d),
              k_cache, v_cache]
    if alibi_slopes is not None:
        inputs.append(alibi_slopes.astype(jnp.float32))
    call = plgpu.kernel(
        functools.partial(kernel, cfg=c, scale=float(scale), group=h // kh,
                          alibi=alibi_slopes is not None),
        out_type=jax.ShapeDtypeStruct((tp, h, d), BF16),
        grid=(meta.shape[0], h),
        grid_names=("tile", "head"),
        num_threads=c.compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=LOWERING),
    )
    return call(*inputs)[:t]
