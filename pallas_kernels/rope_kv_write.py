"""Rotary embedding of one layer's Q and K fused with the write of its new K/V into the
paged cache `[L, K, N, B, D]`: one kernel launch per layer where XLA runs three (q rope,
k rope + scatter, v scatter); each launch costs host time that a small step (decode, or
the time-to-first-token step of a short prompt) pays per layer.

The input is the fused projection `qkv` [T, (H + 2K) * D] (columns [q heads | k heads |
v heads], each head's D columns contiguous, as `models.llama._qkv` slices it). Program
(i, j) of the grid (token tiles, H + K) owns `block_tokens` tokens: j < H rotates query
head j into the q output; j >= H rotates KV head j - H and stores its k and v rows into
both caches at row (layer * K + head) * N * B + slot of their `[L*K*N*B, D]` views. A
head is loaded as its two [bt, D/2] halves (HF rotate_half layout: no concatenate), the
rotation computed in float32 exactly as `models.llama.apply_rope` does.

The caches are updated in place (`input_output_aliases`): inside a jit whose caches are
donated no cache-sized copy is made, and only the written rows change. Null-block slots
(< B, padding tokens) are not written, as in `kv_cache.write_kv`. Row indices stay int32
(L*K*N*B < 2**31 is checked); Pallas Triton scales them by D in 64 bits by itself once
an array passes 4 GiB (a 7B model's cache is ~50 GB).

An fp8 cache (`fp8.py`) comes with its scales `k_scale, v_scale` [L, K, N, B] float32,
also updated in place: each written k row (rotated, rounded to the model dtype) and v
row is quantised with its own scale (`fp8.quantize_rows`, computed in the kernel), the
scale stored at the row's index of the scales' flat view.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    check_caches,
    check_float_dtypes,
    check_int32_rows,
    is_pow2,
    next_pow2,
)
from pallas_kernels.fp8 import check_fp8_cache, quantize_with, row_scale
from pallas_kernels.kv_cache import write_kv

# Elements of one head's tile ([bt, D]): a q program moves ~2K elements in and out, a KV
# program ~4K (k and v), 8-16 per thread with 4 warps (a usual size for elementwise
# Triton kernels). Small T gets one tile of next_pow2(T) tokens per head.
_TILE_ELEMENTS = 2048


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static shape and tiling facts of one kernel instantiation."""

    num_tokens: int  # T
    num_heads: int  # H
    num_kv_heads: int  # K
    slots: int  # N * B: rows of one (layer, kv head) in the flat cache
    block_size: int  # B
    head_dim: int  # D
    block_tokens: int  # bt
    fp8: bool = False  # the caches are fp8, with scales (two more aliased inputs)


def _rope_write_kernel(layer_ref, pos_ref, slot_ref, inv_ref, qkv_ref, *refs, cfg: _Config):
    """qkv_ref [T, (H+2K)*D]; refs: the cache inputs (k, v [L*K*N*B, D]; with cfg.fp8
    also the k, v scales [L*K*N*B] float32), then the outputs q_ref [T, H*D] and the
    caches k_ref, v_ref (and ks_ref, vs_ref), aliasing those inputs. Program (i, j):
    tokens i*bt.., q head j (j < H) or kv head j-H."""
    n_cache = 4 if cfg.fp8 else 2
    q_ref, k_ref, v_ref, *scale_refs = refs[n_cache:]
    # (the program ids are read out here: interpret mode cannot lower them inside a cond)
    i, j = pl.program_id(0), pl.program_id(1)
    h, d, half = cfg.num_heads, cfg.head_dim, cfg.head_dim // 2
    tok = i * cfg.block_tokens + jnp.arange(cfg.block_tokens, dtype=jnp.int32)
    ok = tok < cfg.num_tokens
    tok_ld = jnp.minimum(tok, cfg.num_tokens - 1)  # loads of tokens past T: the last one's
    c = jnp.arange(half, dtype=jnp.int32)
    angles = pos_ref[tok_ld].astype(jnp.float32)[:, None] * inv_ref[c][None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # [bt, D/2] float32

    def rotate(col0):
        """The two rotated halves of the head at qkv columns col0.., [bt, D/2] each."""
        x1 = qkv_ref[tok_ld[:, None], (col0 + c)[None, :]].astype(jnp.float32)
        x2 = qkv_ref[tok_ld[:, None], (col0 + half + c)[None, :]].astype(jnp.float32)
        dt = q_ref.dtype
        return (x1 * cos - x2 * sin).astype(dt), (x2 * cos + x1 * sin).astype(dt)

    @pl.when(j < h)
    def _q_head():
        o1, o2 = rotate(j * d)
        # tokens past T: masked on the GPU; out of bounds (dropped) in interpret mode
        plgpu.store(q_ref.at[tok[:, None], (j * d + c)[None, :]], o1, mask=ok[:, None])
        plgpu.store(q_ref.at[tok[:, None], (j * d + half + c)[None, :]], o2,
                    mask=ok[:, None])

    @pl.when(j >= h)
    def _kv_head():
        kvh = j - h
        k1, k2 = rotate((h + kvh) * d)
        cd = jnp.arange(d, dtype=jnp.int32)
        v = qkv_ref[tok_ld[:, None], ((h + cfg.num_kv_heads + kvh) * d + cd)[None, :]]
        slot = slot_ref[tok_ld]
        write = ok & (slot >= cfg.block_size)  # not past T, not the null block
        base = (layer_ref[0] * cfg.num_kv_heads + kvh) * cfg.slots
        # Masked lanes aim at the head's null-block row 0, which no lane writes: an
        # interpret-mode store still scatters there (the row's own value, read back), so
        # no lane may share a row with a written one (a past-T lane's clamped slot would).
        row = (base + jnp.where(write, slot, 0))[:, None]
        m = write[:, None]
        if cfg.fp8:  # each row quantised with its own scale, stored beside it
            k1, k2, v = k1.astype(jnp.float32), k2.astype(jnp.float32), v.astype(jnp.float32)
            amax = jnp.maximum(jnp.abs(k1).max(axis=1), jnp.abs(k2).max(axis=1))
            ks, vs = row_scale(amax, k_ref.dtype), row_scale(jnp.abs(v).max(axis=1), v_ref.dtype)
            k1 = quantize_with(k1, ks[:, None], k_ref.dtype)
            k2 = quantize_with(k2, ks[:, None], k_ref.dtype)
            v = quantize_with(v, vs[:, None], v_ref.dtype)
            plgpu.store(scale_refs[0].at[row[:, 0]], ks, mask=write)
            plgpu.store(scale_refs[1].at[row[:, 0]], vs, mask=write)
        plgpu.store(k_ref.at[row, c[None, :]], k1, mask=m)
        plgpu.store(k_ref.at[row, (half + c)[None, :]], k2, mask=m)
        plgpu.store(v_ref.at[row, cd[None, :]], v, mask=m)


def _check_inputs(qkv, positions, slot_mapping, k_cache, v_cache, layer, inv_freq,
                  num_heads, num_kv_heads, block_tokens, k_scale=None, v_scale=None):
    """Raises ValueError naming the argument whose shape or dtype breaks the contract."""
    check_caches(k_cache, v_cache, layer)
    check_fp8_cache(k_cache, v_cache, k_scale, v_scale)
    num_layers, kh, n, b, d = k_cache.shape
    if kh != num_kv_heads:
        raise ValueError(f"the caches have {kh} kv heads, num_kv_heads is {num_kv_heads}")
    if num_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    if not (is_pow2(d) and d >= 2):
        raise ValueError(f"head_dim ({d}) must be a power of 2 >= 2 (Triton block shapes)")
    width = (num_heads + 2 * num_kv_heads) * d
    if qkv.ndim != 2 or qkv.shape[1] != width or qkv.shape[0] < 1:
        raise ValueError(f"qkv must be [T >= 1, (H + 2K) * D = {width}], got {qkv.shape}")
    t = qkv.shape[0]
    if k_scale is None:
        check_float_dtypes(qkv=qkv, k_cache=k_cache, v_cache=v_cache)
    else:
        check_float_dtypes(qkv=qkv)
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        if x.shape != (t,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer [{t}], got {x.dtype}{list(x.shape)}")
    if inv_freq.shape != (d // 2,) or jnp.dtype(inv_freq.dtype) != jnp.float32:
        raise ValueError(f"inv_freq must be float32 [{d // 2}] (head_dim {d}), got "
                         f"{inv_freq.dtype}{list(inv_freq.shape)}")
    check_int32_rows(num_layers * kh * n * b)
    if block_tokens is not None and not is_pow2(block_tokens):
        raise ValueError(f"block_tokens ({block_tokens}) must be a power of 2")


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "interpret",
                                             "block_tokens"))
def rope_write_kv(
    qkv: jax.Array,  # [T, (H + 2K) * D]
    positions: jax.Array,  # [T] int32
    slot_mapping: jax.Array,  # [T] int32
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array | int,  # int32 scalar
    inv_freq: jax.Array,  # [D/2] float32
    *,
    num_heads: int,
    num_kv_heads: int,
    interpret: bool = False,
    block_tokens: int | None = None,
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,  # [L, K, N, B] float32
) -> tuple[jax.Array, ...]:
    """Returns (q [T, H, D] rotated, k_cache, v_cache) with token t's rotated k and its v
    at `slot_mapping[t]` of layer `layer` (null-block slots < B not written); for an
    fp8 cache (q, k_cache, v_cache, k_scale, v_scale), the rows quantised on write.

    Equals `rope_write_kv_reference`; in place when the caches are donated to the
    enclosing jit. `block_tokens` (a power of 2) defaults to ~2K elements per head tile.
    """
    _check_inputs(qkv, positions, slot_mapping, k_cache, v_cache, layer, inv_freq,
                  num_heads, num_kv_heads, block_tokens, k_scale, v_scale)
    t = qkv.shape[0]
    num_layers, kh, n, b, d = k_cache.shape
    bt = block_tokens or min(max(1, _TILE_ELEMENTS // d), next_pow2(t))
    cfg = _Config(num_tokens=t, num_heads=num_heads, num_kv_heads=kh, slots=n * b,
                  block_size=b, head_dim=d, block_tokens=bt, fp8=k_scale is not None)
    rows = num_layers * kh * n * b
    caches = [k_cache.reshape(rows, d), v_cache.reshape(rows, d)]
    if cfg.fp8:
        caches += [k_scale.reshape(rows), v_scale.reshape(rows)]
    out = pl.pallas_call(
        functools.partial(_rope_write_kernel, cfg=cfg),
        grid=(pl.cdiv(t, bt), num_heads + kh),
        out_shape=[jax.ShapeDtypeStruct((t, num_heads * d), qkv.dtype)]
        + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in caches],
        input_output_aliases={5 + i: 1 + i for i in range(len(caches))},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=max(1, min(4, bt * d // 512))),
        name=f"rope_write_kv_t{bt}" + ("_fp8" if cfg.fp8 else ""),
    )(jnp.asarray(layer, jnp.int32).reshape(1), positions.astype(jnp.int32),
      slot_mapping.astype(jnp.int32), inv_freq, qkv, *caches)
    shapes = (k_cache.shape, v_cache.shape) + ((k_scale.shape, v_scale.shape) if cfg.fp8
                                               else ())
    return (out[0].reshape(t, num_heads, d),
            *(x.reshape(shape) for x, shape in zip(out[1:], shapes, strict=True)))


def rope_write_kv_reference(
    qkv: jax.Array,  # [T, (H + 2K) * D]
    positions: jax.Array,  # [T] int32
    slot_mapping: jax.Array,  # [T] int32
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array | int,  # int32 scalar
    inv_freq: jax.Array,  # [D/2] float32
    *,
    num_heads: int,
    num_kv_heads: int,
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,  # [L, K, N, B] float32
) -> tuple[jax.Array, ...]:
    """The same unfused: `models.llama.apply_rope` on q and k, then `kv_cache.write_kv`."""
    from models.llama import apply_rope  # (here: models may come to import this module)

    _check_inputs(qkv, positions, slot_mapping, k_cache, v_cache, layer, inv_freq,
                  num_heads, num_kv_heads, None, k_scale, v_scale)
    t, d = qkv.shape[0], k_cache.shape[-1]
    hd, kd = num_heads * d, num_kv_heads * d
    q = qkv[:, :hd].reshape(t, num_heads, d)
    k = qkv[:, hd : hd + kd].reshape(t, num_kv_heads, d)
    v = qkv[:, hd + kd :].reshape(t, num_kv_heads, d)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    return (q, *write_kv(k_cache, v_cache, layer, k, v, slot_mapping, k_scale, v_scale))
