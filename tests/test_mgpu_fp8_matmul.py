"""pallas_kernels.mgpu_fp8_matmul: its jnp reference (CPU) against models.fp8_linear's
fp8 matmul and float64, its input checks (CPU), and the Mosaic GPU kernel against the
reference over a shape and tiling grid (Hopper GPU only: Mosaic GPU's interpreter in jax
0.10.2 lacks what the kernel uses, see the module docstring).

On the GPU the output is poisoned through the allocator: a NaN array of the output's
size is freed just before each call, so an element the kernel never wrote most likely
reads NaN."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.fp8_linear import fp8_matmul, quantize_weight
from pallas_kernels.backend import mosaic_available

absl = pytest.importorskip("absl", reason="Mosaic GPU's Python package imports absl")
mgpu = pytest.importorskip("pallas_kernels.mgpu_fp8_matmul")

ON_HOPPER = mosaic_available()  # a Hopper GPU and jax >= 0.11.2
C = mgpu.MgpuMatmulConfig


def make(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
    return x, quantize_weight(w)


def rel(out, ref):
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "an output element was never written"
    return np.linalg.norm(out - np.asarray(ref, np.float64)) / np.linalg.norm(ref)


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (7, 128, 48), (33, 256, 64)])
def test_reference_is_fp8_matmul(m, k, n):
    """The reference == fp8_matmul's arithmetic (per-token e4m3, per-channel scales,
    float32 dot result), and both are the float product within e4m3's error."""
    x, w = make(m, k, n)
    ref = mgpu.mgpu_fp8_matmul_reference(x, w.w8, w.scale)
    with jax.default_matmul_precision("highest"):
        today = fp8_matmul(x, w, dot_dtype=jnp.float32)
    assert ref.dtype == jnp.bfloat16 and ref.shape == (m, n)
    assert rel(ref, today) < 1e-2
    dense = np.asarray(x, np.float64) @ np.asarray(mgpu.mgpu_fp8_matmul_reference(
        jnp.eye(k, dtype=jnp.bfloat16), w.w8, w.scale), np.float64)
    assert rel(ref, dense) < 0.1


def test_reference_saturates_and_keeps_zero_rows():
    x = jnp.zeros((3, 64), jnp.bfloat16).at[1].set(1e4).at[2, 5].set(-3.0)
    w = quantize_weight(jnp.ones((64, 32), jnp.float32))
    out = np.asarray(mgpu.mgpu_fp8_matmul_reference(x, w.w8, w.scale), np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out[0], 0)
    np.testing.assert_allclose(out[1], 64e4, rtol=1e-2)
    np.testing.assert_allclose(out[2], -3.0, rtol=1e-2)


@pytest.mark.parametrize("bad,match", [
    (dict(x=jnp.zeros((4, 64), jnp.float32)), "x .* must be bfloat16"),
    (dict(w8=jnp.zeros((32, 64), jnp.bfloat16)), "w8 .* float8_e4m3fn"),
    (dict(w8=jnp.zeros((32, 128), jnp.float8_e4m3fn)), "disagree on K"),
    (dict(w_scale=jnp.ones((31,), jnp.float32)), r"w_scale \(31,\)"),
    (dict(config=C(tile_m=32)), "tile_m must be a multiple of 64"),
    (dict(config=C(tile_k=32)), "tile_k 32"),
    (dict(config=C(tile_k=128)), "K 64 must be a multiple of tile_k 128"),
    (dict(config=C(wg_split="k")), "wg_split"),
    (dict(quant="int8"), "quant 'int8'"),
    (dict(w8=jnp.zeros((96, 64), jnp.float8_e4m3fn), w_scale=jnp.ones(96)),
     "N 96 must be a multiple of the CTA's 64"),
    (dict(config=C(tile_k=64, delay_release=1)), "delay_release must be 0 with quant 'fused'"),
])
def test_bad_inputs_are_refused_by_name(bad, match):
    args = dict(x=jnp.zeros((4, 64), jnp.bfloat16), w8=jnp.zeros((64, 64), jnp.float8_e4m3fn),
                w_scale=jnp.ones((64,), jnp.float32), config=C(tile_n=64, tile_k=64),
                quant="fused")
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        mgpu.check_inputs(**args)


def test_shared_memory_need_is_refused_by_name():
    """The one tiling of the GPU grid the compiler refused (245,824 bytes on the H200):
    refused before compiling, naming the bytes."""
    big = C(tile_m=128, tile_n=128, tile_k=64, a_operand="smem")
    assert mgpu.smem_bytes(big, "fused", 4096) == 245760 + 1024
    assert mgpu.smem_bytes(C(), "fused", 4096) <= mgpu.SMEM_BYTES
    x, w8 = jnp.zeros((4, 4096), jnp.bfloat16), jnp.zeros((256, 4096), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="246784 bytes of shared memory"):
        mgpu.check_inputs(x, w8, jnp.ones(256), big, "fused")
    mgpu.check_inputs(x, w8, jnp.ones(256), C(**{**big.__dict__, "a_operand": "regs"}),
                      "fused")


CONFIGS = [C(tile_m=64, tile_n=64, tile_k=128, wg_split="n"),
           C(tile_m=64, tile_n=128, tile_k=128, max_stages=3),
           C(tile_m=64, tile_n=256, tile_k=64),
           C(tile_m=128, tile_n=128, tile_k=64)]


@pytest.mark.skipif(not ON_HOPPER, reason="Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("m,k,n,config,a_operand", [
    (m, k, n, c, a) for (m, k, n), c, a in itertools.product(
        [(1, 512, 256), (100, 256, 512), (256, 1024, 256), (300, 4096, 512)],
        CONFIGS, ["regs", "smem"])
])
def test_kernel_matches_reference(m, k, n, config, a_operand):
    config = C(**{**config.__dict__, "a_operand": a_operand})
    x, w = make(m, k, n, seed=m + n)
    if mgpu.smem_bytes(config, "fused", k) > mgpu.SMEM_BYTES:
        with pytest.raises(ValueError, match="shared memory"):
            mgpu.mgpu_fp8_matmul(x, w.w8, w.scale, config=config)
        return
    ref = mgpu.mgpu_fp8_matmul_reference(x, w.w8, w.scale)
    poison = jnp.full((m + 256, n), jnp.nan, jnp.bfloat16).block_until_ready()
    del poison
    out = mgpu.mgpu_fp8_matmul(x, w.w8, w.scale, config=config)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert rel(out, ref) < 1e-2


@pytest.mark.skipif(not ON_HOPPER, reason="Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("delay", [0, 1])
def test_kernel_pre_quantised(delay):
    x, w = make(200, 512, 256, seed=3)
    ref = mgpu.mgpu_fp8_matmul_reference(x, w.w8, w.scale)
    from models.fp8_linear import quantize_activations

    x8, xs = quantize_activations(x)
    out = mgpu.mgpu_fp8_matmul(x8, w.w8, w.scale, quant="pre", x_scale=xs[:, 0],
                               config=C(delay_release=delay))
    assert rel(out, ref) < 1e-2
