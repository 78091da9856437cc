"""skinny_matmul (Pallas, interpret mode on CPU) == float64 numpy, over a tiling grid.

Interpret mode starts every output buffer as NaN, so "no NaN anywhere" is the check that
every output column was written (by every K split). On a GPU backend the same tests run
the compiled Triton kernel.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import equations

from pallas_kernels.skinny_matmul import (
    MatmulTiling,
    check_matmul_inputs,
    skinny_matmul,
    skinny_matmul_reference,
    skinny_tiling,
)

INTERPRET = jax.default_backend() == "cpu"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}  # relative L2 error vs float64


def numpy_matmul(x, w, act):
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if act != "silu_mul":
        return y
    gate, up = np.split(y, 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "an output element was never written"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def make(rng, m, k, n, dtype):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    return x, w


TILINGS = [MatmulTiling(block_n=32, block_k=64),
           MatmulTiling(block_n=64, block_k=32, k_splits=2),
           MatmulTiling(block_n=16, block_k=64, k_splits=4, num_stages=2)]


@pytest.mark.parametrize("m,k,n,act,tiling,dtype", [
    (m, k, n, act, t, dt)
    for (m, k, n), act, t, dt in itertools.product(
        [(16, 256, 64), (32, 128, 192), (128, 512, 64)], [None, "silu_mul"], TILINGS,
        [jnp.float32, jnp.bfloat16])
    if not (act and t.k_splits > 1)
    and (n // (2 if act else 1)) % t.block_n == 0 and k % (t.block_k * t.k_splits) == 0
])
def test_skinny_matmul_matches_numpy(m, k, n, act, tiling, dtype):
    x, w = make(np.random.default_rng(m + k + n), m, k, n, dtype)
    out = skinny_matmul(x, w, act=act, tiling=tiling, interpret=INTERPRET)
    assert out.shape == (m, n // (2 if act else 1)) and out.dtype == x.dtype
    assert rel_err(out, numpy_matmul(x, w, act)) < TOL[dtype]


@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_reference_matches_numpy(act):
    x, w = make(np.random.default_rng(0), 32, 64, 128, jnp.float32)
    assert rel_err(skinny_matmul_reference(x, w, act), numpy_matmul(x, w, act)) < 1e-6


@pytest.mark.parametrize("shapes,kwargs,match", [
    (((16, 64), (32, 64)), {}, "disagree on K"),
    (((20, 64), (64, 64)), {}, "power of 2 >= 16"),
    (((48, 64), (64, 64)), {}, "power of 2 >= 16"),
    (((16, 96), (96, 96)), {"tiling": MatmulTiling(block_n=48, block_k=32)}, "powers of 2"),
    (((16, 64), (64, 64)), {"tiling": MatmulTiling(block_n=8, block_k=32)}, "powers of 2"),
    (((16, 64), (64, 64)), {"tiling": MatmulTiling(block_n=32, block_k=32, k_splits=0)},
     "k_splits 0"),
    (((16, 64), (64, 65)), {"act": "silu_mul"}, "odd number of columns"),
    (((16, 64), (64, 48)), {"tiling": MatmulTiling(block_n=32)}, "block_n 32"),
    (((16, 96), (96, 64)), {"tiling": MatmulTiling(block_n=32, block_k=64)}, "K 96"),
    (((16, 128), (128, 64)), {"act": "silu_mul",
                              "tiling": MatmulTiling(block_n=32, block_k=32, k_splits=2)},
     "k_splits 1"),
    (((16, 64), (64, 64)), {"act": "gelu"}, "act 'gelu'"),
])
def test_bad_inputs_raise_value_error(shapes, kwargs, match):
    x, w = (jnp.zeros(s, jnp.float32) for s in shapes)
    with pytest.raises(ValueError, match=match):
        skinny_matmul(x, w, interpret=INTERPRET, **kwargs)


@pytest.mark.parametrize("m,k,n,act,expect", [
    (16, 4096, 12288, None, MatmulTiling(block_n=64, block_k=128)),  # 7B fused Q/K/V
    (16, 4096, 11008, "silu_mul", MatmulTiling(block_n=64, block_k=128, num_stages=3)),
    (16, 4096, 4096, None, None),  # attention output: 64 programs, XLA's is faster
    (32, 4096, 12288, None, None),  # past SKINNY_MAX_ROWS
    (16, 4100, 12288, None, None),  # no K step divides 4,100
])
def test_skinny_tiling_picks_the_kernel_where_it_was_measured_faster(m, k, n, act, expect):
    assert skinny_tiling(m, k, n, act) == expect


def _pallas_calls(fn, *args):
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


def _pallas_operands(fn, *args):
    """The operand avals of every pallas_call in fn's jaxpr (nested jaxprs included)."""
    return [[v.aval for v in eqn.invars]
            for eqn in equations(fn, *args, primitive="pallas_call")]


@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_runner_linear_runs_the_kernel_on_few_rows_and_xla_otherwise(act):
    from jprefix.worker.step_linear import step_linear as _linear
    from models.llama import dense_linear

    linear = _linear("pallas-interpret", None)
    rng = np.random.default_rng(1)
    x, w = make(rng, 16, 64, 256, jnp.float32)
    x3 = x.reshape(2, 8, 64)  # leading dims are flattened into rows
    out = linear(x3, w, act)
    assert _pallas_calls(lambda a, b: linear(a, b, act), x3, w) == 1
    with jax.default_matmul_precision("highest"):  # (XLA on a GPU: TF32 otherwise)
        expect = dense_linear(x3, w, act)
    np.testing.assert_allclose(out, expect, rtol=2e-5, atol=2e-5)
    big = jnp.zeros((64, 64), jnp.float32)  # 64 rows: XLA's matmul
    assert _pallas_calls(lambda a, b: linear(a, b, act), big, w) == 0
    assert _pallas_calls(lambda a, b: _linear("xla", None)(a, b, act), x, w) == 0


@pytest.mark.skipif(INTERPRET, reason="the compiled kernel's shapes (a 7B layer) on a GPU")
@pytest.mark.parametrize("n,act", [(12288, None), (2 * 11008, "silu_mul")])
def test_runner_linear_on_gpu_matches_xla_on_a_7b_layer(n, act):
    from jprefix.worker.step_linear import step_linear as _linear
    from models.llama import dense_linear

    x, w = make(np.random.default_rng(2), 16, 4096, n, jnp.bfloat16)
    linear = _linear("pallas", None)
    assert _pallas_calls(lambda a, b: linear(a, b, act), x, w) == 1
    ref = np.asarray(dense_linear(x.astype(jnp.float32), w.astype(jnp.float32), act))
    assert rel_err(linear(x, w, act), ref) < TOL[jnp.bfloat16]
    assert rel_err(dense_linear(x, w, act), ref) < TOL[jnp.bfloat16]


FP8_CASES = [(m, k, n, act, t, dt)
             for (m, k, n), act, t, dt in itertools.product(
                 [(16, 256, 64), (32, 128, 192)], [None, "silu_mul"], TILINGS,
                 [jnp.float32, jnp.bfloat16])
             if not (act and t.k_splits > 1)
             and (n // (2 if act else 1)) % t.block_n == 0
             and k % (t.block_k * t.k_splits) == 0]


@pytest.mark.parametrize("m,k,n,act,tiling,dtype", FP8_CASES)
def test_fp8_weights_match_the_models_fp8_matmul(m, k, n, act, tiling, dtype):
    """fp8 weights ([N, K] fp8 + column scales) and per-row quantised activations: the
    kernel computes `fp8_matmul`'s product (the fp8 values exact in x's dtype, float32
    sums in another order), every column written by every split."""
    from models.fp8_linear import fp8_matmul, quantize_activations, quantize_weight
    from models.llama import dense_linear

    x, w = make(np.random.default_rng(m * n + k), m, k, n, dtype)
    x = x * jnp.asarray(np.geomspace(0.01, 100, m)[:, None], dtype)  # rows of every size
    wq = quantize_weight(w)
    x8, row_scale = quantize_activations(x)
    out = skinny_matmul(x8.astype(dtype), wq.w8, act=act, tiling=tiling, interpret=INTERPRET,
                        scales=(row_scale[:, 0], wq.scale))
    ref = np.asarray(dense_linear(x.astype(jnp.float32), wq, act), np.float64)
    assert out.dtype == dtype
    assert rel_err(out, ref) < (1e-5 if dtype == jnp.float32 else TOL[dtype])
    if act is None:  # against fp8_matmul in x's own dtype too
        assert rel_err(out, np.asarray(fp8_matmul(x, wq), np.float64)) < TOL[jnp.bfloat16]


NATIVE_TILINGS = [MatmulTiling(block_n=32, block_k=64),
                  MatmulTiling(block_n=64, block_k=32, k_splits=2, block_m=16),
                  MatmulTiling(block_n=16, block_k=32, block_m=32, num_stages=2)]


@pytest.mark.parametrize("m,k,n,act,tiling,out_dtype", [
    (m, k, n, act, t, dt)
    for (m, k, n), act, t, dt in itertools.product(
        [(32, 128, 192), (64, 256, 64)], [None, "silu_mul"], NATIVE_TILINGS,
        [jnp.float32, jnp.bfloat16])
    if not (act and t.k_splits > 1) and (n // (2 if act else 1)) % t.block_n == 0
])
def test_native_fp8_x_matches_the_16_bit_held_values(m, k, n, act, tiling, out_dtype):
    """x as float8_e4m3fn itself (the tensor cores' fp8 dot, `out_dtype` given) computes
    the product of the same fp8 values held in float32, for every row block and K split:
    both are exact products summed in float32."""
    from models.fp8_linear import quantize_activations, quantize_weight

    x, w = make(np.random.default_rng(m + n + k), m, k, n, jnp.float32)
    x = x * jnp.asarray(np.geomspace(0.01, 100, m)[:, None], jnp.float32)
    wq = quantize_weight(w)
    x8, row_scale = quantize_activations(x)
    scales = (row_scale[:, 0], wq.scale)
    out = skinny_matmul(x8, wq.w8, act=act, tiling=tiling, interpret=INTERPRET,
                        scales=scales, out_dtype=out_dtype)
    held = skinny_matmul(x8.astype(jnp.float32), wq.w8, act=act, tiling=MatmulTiling(
        block_n=16, block_k=32), interpret=INTERPRET, scales=scales)
    assert out.dtype == out_dtype
    assert rel_err(out, np.asarray(held, np.float64)) < (1e-5 if out_dtype == jnp.float32
                                                          else TOL[jnp.bfloat16])


def test_native_fp8_and_row_blocks_are_checked():
    from models.fp8_linear import quantize_activations, quantize_weight

    x, w = make(np.random.default_rng(1), 32, 64, 64, jnp.float32)
    wq = quantize_weight(w)
    x8, row_scale = quantize_activations(x)
    scales = (row_scale[:, 0], wq.scale)
    with pytest.raises(ValueError, match="an fp8 x needs out_dtype"):
        skinny_matmul(x8, wq.w8, scales=scales, interpret=True)
    with pytest.raises(ValueError, match="block_k 16 must be >= 32"):
        skinny_matmul(x8, wq.w8, scales=scales, interpret=True, out_dtype=jnp.float32,
                      tiling=MatmulTiling(block_n=16, block_k=16))
    for bm in (8, 24, 64):
        with pytest.raises(ValueError, match=f"block_m {bm} must be"):
            skinny_matmul(x, w, interpret=True, tiling=MatmulTiling(block_n=16, block_m=bm))


def test_fp8_scales_are_checked():
    from models.fp8_linear import quantize_weight

    x, w = make(np.random.default_rng(0), 16, 64, 64, jnp.float32)
    wq = quantize_weight(w)
    with pytest.raises(ValueError, match=r"scales .*\[M\] = \[16\]"):
        skinny_matmul(x, wq.w8, scales=(jnp.ones(8), wq.scale), interpret=True)
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        skinny_matmul(x, w, scales=(jnp.ones(16), jnp.ones(64)), interpret=True)
    with pytest.raises(ValueError, match="must share a float dtype"):
        skinny_matmul(x, wq.w8, interpret=True)


def test_fp8_tiling_takes_few_rows_of_every_7b_projection():
    """Up to 16 rows (power of 2 >= 16) every Llama-2-7B and Llama-3-8B projection takes
    the kernel with valid tilings; more rows are XLA's."""
    from pallas_kernels.skinny_matmul import fp8_tiling

    shapes = [(4096, 12288, None), (4096, 4096, None), (4096, 11008, "silu_mul"),
              (11008, 4096, None), (4096, 6144, None), (4096, 14336, "silu_mul"),
              (14336, 4096, None)]
    x8 = jnp.zeros((16, 1), jnp.float8_e4m3fn)
    for k, n, act in shapes:
        t = fp8_tiling(16, k, n, act)
        assert t is not None and fp8_tiling(32, k, n, act) is None
        assert fp8_tiling(8, k, n, act) is None  # (the engine pads rows to 16)
        cols = 2 * n if act else n
        check_matmul_inputs(jnp.broadcast_to(x8, (16, k)),
                            jax.ShapeDtypeStruct((cols, k), jnp.float8_e4m3fn), act, t,
                            (jnp.ones(16), jnp.ones(cols)), jnp.bfloat16)


@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_runner_linear_takes_fp8_weights_through_the_kernel_on_few_rows(act):
    """`_linear` on an Fp8Weight: the kernel's fp8 variant for few rows, with the row
    quantisation of `fp8_matmul` (so a row's result does not depend on the batch), and
    XLA's fp8 matmul for many rows."""
    from jprefix.worker.step_linear import step_linear as _linear
    from models.fp8_linear import quantize_weight
    from models.llama import dense_linear

    linear = _linear("pallas-interpret", None)
    rng = np.random.default_rng(3)
    x, w = make(rng, 16, 64, 256, jnp.float32)
    wq = quantize_weight(w)
    x3 = x.reshape(2, 8, 64)
    assert _pallas_calls(lambda a: linear(a, wq, act), x3) == 1
    # the fp8 x fp8 dot: the kernel takes the activations as fp8, not 16-bit held values
    [operands] = _pallas_operands(lambda a: linear(a, wq, act), x3)
    assert [str(a.dtype) for a in operands[:2]] == ["float8_e4m3fn"] * 2
    np.testing.assert_allclose(linear(x3, wq, act), dense_linear(x3, wq, act),
                               rtol=2e-5, atol=2e-5)
    alone = linear(jnp.concatenate([x[:1], jnp.zeros((15, 64))]), wq, act)[0]
    np.testing.assert_allclose(alone, linear(x, wq, act)[0], rtol=1e-6, atol=1e-6)
    big = jnp.zeros((64, 64), jnp.float32)  # 64 rows: XLA's fp8 matmul
    assert _pallas_calls(lambda a: linear(a, wq, act), big) == 0
