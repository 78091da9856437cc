"""fp8 weights (`quantization="fp8"`, models/fp8_linear.py): per-output-channel weight
quantisation, the fp8 matmul against a float64 numpy emulation of the same scheme, the
engine against the dense reference on the same quantised weights (prefix cache on/off,
with and without the fp8 KV cache), and the refusal of already-quantised checkpoints."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import equations

import jprefix
from jprefix import LLM, SamplingParams
from jprefix.worker.step import compiled_steps
from models.fp8_linear import (
    FP8,
    FP8_MAX,
    Fp8Weight,
    dequantize_weight,
    fp8_matmul,
    quantize_activations,
    quantize_weight,
)
from models.layout import quantize_linears
from models.llama import dense_linear
from models.reference import dense_generate

BS = 8


def test_weight_quantisation_per_output_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 48, 40)) * np.exp(rng.uniform(-8, 8, (1, 1, 40)))
    w[:, :, 3] = 0.0  # an all-zero column: scale 1, zeros back
    q = quantize_weight(jnp.asarray(w, jnp.float32))
    assert isinstance(q, Fp8Weight) and q.w8.dtype == FP8
    assert q.w8.shape == (2, 40, 48) and q.scale.shape == (2, 40) and q.shape == w.shape
    scale = np.asarray(q.scale)
    assert np.all(np.isfinite(scale)) and np.all(scale > 0) and np.all(scale[:, 3] == 1.0)
    back = np.asarray(dequantize_weight(q), np.float64)
    amax = np.abs(w).max(axis=1, keepdims=True)
    assert np.all(np.abs(back - w) <= 2.0**-4 * amax * 1.0001)
    np.testing.assert_allclose(np.abs(np.asarray(q.w8, np.float32)).max(axis=2)[:, :3],
                               FP8_MAX)


def test_fp8_matmul_equals_the_scheme_in_float64():
    """y = (x8 * x_scale) @ (w8 * w_scale)^T computed in float64 from the same fp8
    operands: the matmul's only error beyond the quantisation is float32 accumulation."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, 64)) * [[1], [10], [1e-3], [0], [300]],
                    jnp.float32)
    w = quantize_weight(jnp.asarray(rng.standard_normal((64, 24)), jnp.float32))
    got = np.asarray(fp8_matmul(x, w), np.float64)
    x8, xs = quantize_activations(x)
    want = (np.asarray(x8, np.float64) * np.asarray(xs, np.float64)) @ \
        np.asarray(dequantize_weight(w), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert np.all(got[3] == 0.0)  # a zero row stays zero, no NaN
    # and within the quantisation error of the float matmul
    exact = np.asarray(x, np.float64) @ np.asarray(dequantize_weight(w), np.float64)
    rel = np.linalg.norm(got - exact, axis=1) / np.maximum(np.linalg.norm(exact, axis=1), 1e-30)
    assert np.all(rel[[0, 1, 2, 4]] < 0.06)


def _dot_result_types(fn, *args) -> list:
    return [e.params["preferred_element_type"]
            for e in equations(fn, *args, primitive="dot_general")]


def test_fp8_matmul_dot_result_in_the_activations_dtype():
    """bf16 activations: the fp8 dot writes bf16 (the faster cuBLASLt output), float32 on
    request; the result stays within one more bf16 rounding of the float64 scheme, and
    granularity "tensor" takes one scale for all rows. A bad granularity names itself."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((6, 128)) * [[1], [8], [1e-2], [1], [50], [3]],
                    jnp.bfloat16)
    w = quantize_weight(jnp.asarray(rng.standard_normal((128, 48)), jnp.float32))
    assert _dot_result_types(fp8_matmul, x, w) == [jnp.dtype(jnp.bfloat16)]
    f32 = functools.partial(fp8_matmul, dot_dtype=jnp.dtype(jnp.float32))
    assert _dot_result_types(f32, x, w) == [jnp.dtype(jnp.float32)]
    assert _dot_result_types(fp8_matmul, x.astype(jnp.float32), w) == [jnp.dtype(jnp.float32)]
    x8, xs = quantize_activations(x)
    want = (np.asarray(x8, np.float64) * np.asarray(xs, np.float64)) @ \
        np.asarray(dequantize_weight(w), np.float64)
    for got in (fp8_matmul(x, w), f32(x, w)):
        assert got.dtype == jnp.bfloat16
        err = np.abs(np.asarray(got, np.float64) - want)
        assert np.all(err <= 2 ** -7 * np.abs(want) + 1e-6 * np.abs(want).max())
    x8t, xst = quantize_activations(x, "tensor")
    assert np.all(np.asarray(xst) == np.asarray(xst).max())
    assert float(np.asarray(xst).max()) == float(np.asarray(xs).max())
    with pytest.raises(ValueError, match="'row'"):
        quantize_activations(x, "row")


def test_quantize_linears_keeps_the_last_layers_mlp_in_the_model_dtype(sharp):
    """Every linear weight becomes an Fp8Weight except the last layer's gate, up and down
    (kept as they were, the same arrays); stacked params come back per layer (a stack
    holds one dtype). keep_last_mlp=False quantises all of it in any layout. Both are
    idempotent, and the fused layout keeps its fused last-layer MLP the same way."""
    from models.layout import unstack_layers

    stacked = sharp.params
    num_layers = stacked.layers.wq.shape[0]
    got = quantize_linears(stacked)
    assert got.layout == "per_layer" and len(got.layers) == num_layers
    for i, lp in enumerate(got.layers):
        last = i == num_layers - 1
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            w = getattr(lp, name)
            assert isinstance(w, Fp8Weight) != (last and name in ("w_gate", "w_up", "w_down"))
    np.testing.assert_array_equal(got.layers[-1].w_down, stacked.layers.w_down[-1])
    again = quantize_linears(got)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(got),
                                      strict=True))
    everything = quantize_linears(stacked, keep_last_mlp=False)
    assert everything.layout == "stacked"
    assert isinstance(everything.layers.w_down, Fp8Weight)
    fused = quantize_linears(unstack_layers(stacked, fuse=True))
    assert fused.layout == "fused"
    assert isinstance(fused.layers[-1].wq, Fp8Weight)
    assert not isinstance(fused.layers[-1].w_gate, Fp8Weight)  # [gate | up] of the last
    assert isinstance(fused.layers[0].w_gate, Fp8Weight)


def test_dense_linear_takes_fp8_weights_with_silu_mul():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 20)), jnp.float32)
    q = quantize_weight(w)
    got = dense_linear(x, q, "silu_mul")
    assert got.shape == (3, 10)
    x8, xs = quantize_activations(x)
    y = (np.asarray(x8, np.float32) * np.asarray(xs)) @ np.asarray(dequantize_weight(q))
    want = y[:, :10] / (1 + np.exp(-y[:, :10])) * y[:, 10:]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def sharp(sharp_tiny):
    return sharp_tiny


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_with_fp8_weights_equals_dense_reference_on_the_same_weights(
        sharp, kv_cache_dtype):
    """Greedy tokens with fp8 weights, prefix cache off and on, equal the dense reference
    run on the quantised params (with an fp8 cache: the reference round-trips K/V)."""
    from test_fp8_engine import dense_fp8_generate

    from pallas_kernels.fp8 import FP8_NAMES

    cfg = sharp.config
    rng = np.random.default_rng(4)
    shared = rng.integers(3, cfg.vocab_size, 2 * BS).tolist()
    prompts = [shared + rng.integers(3, cfg.vocab_size, n).tolist() for n in (3, 7, 12)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    qparams = quantize_linears(sharp.params)
    if kv_cache_dtype == "auto":
        want = [dense_generate(qparams, cfg, p, 5, eos_token_ids=()) for p in prompts]
    else:
        want = [dense_fp8_generate(qparams, cfg, p, 5, FP8_NAMES["fp8"]) for p in prompts]
    for caching in (False, True):
        llm = LLM(sharp, block_size=BS, num_kv_blocks=64, attention_backend="xla",
                  quantization="fp8", kv_cache_dtype=kv_cache_dtype,
                  enable_prefix_caching=caching)
        layers = llm.engine.runner.params.layers
        assert isinstance(layers[0].wq, Fp8Weight) and isinstance(layers[-1].wq, Fp8Weight)
        assert not isinstance(layers[-1].w_down, Fp8Weight)  # the last MLP: model dtype
        # its steps compile with XLA's Triton GEMMs off (worker.xla_flags)
        assert llm.engine.runner._step is compiled_steps(True)[0] is not compiled_steps(False)[0]
        assert not isinstance(sharp.params.layers.wq, Fp8Weight)  # the caller's untouched
        got = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want, caching


def test_fp8_weights_with_the_fused_layout_and_pallas_interpret(sharp):
    """unroll_layers (GPU's layout: fused Q/K/V and gate/up, rope_write_kv): the fused
    columns quantise as their parts do."""
    cfg = sharp.config
    prompt = np.random.default_rng(5).integers(3, cfg.vocab_size, 19).tolist()
    want = dense_generate(quantize_linears(sharp.params), cfg, prompt, 4, eos_token_ids=())
    outs = jprefix.generate(sharp, [prompt], prefix_len=BS, quantization="fp8",
                            sampling_params=SamplingParams(temperature=0, max_tokens=4,
                                                           ignore_eos=True),
                            num_kv_blocks=32, block_size=BS, unroll_layers=True,
                            attention_backend="pallas-interpret")
    assert outs[0].token_ids == want


def test_unsupported_quantised_checkpoints_are_refused_through_load(tmp_path):
    """(fp8 checkpoints load: tests/test_fp8_checkpoint.py.) A quantisation jprefix does
    not read is refused when the checkpoint loads, naming it."""
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32,
              hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, max_position_embeddings=64,
              quantization_config={"quant_method": "compressed-tensors"})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="compressed-tensors format None is not supported"):
        jprefix.load(str(tmp_path))


def test_prepare_params_moves_what_it_made_into_fresh_buffers(sharp):
    """With the weights donated, the leaves prepare_params made (unrolled, fused, fp8)
    are copied into fresh buffers once everything they were made from is freed, so they
    can fill the hole those leave (worker.params._compact); the copies hold the same
    values, the leaves it kept from the caller are the caller's, the first buffers are
    released."""
    import jax

    from jprefix.worker.params import _compact, prepare_params

    cfg = sharp.config
    want = prepare_params(sharp.params, cfg, unroll_layers=True, quantization="fp8")
    given = jax.tree.map(lambda x: x.copy(), sharp.params)
    got = prepare_params(given, cfg, unroll_layers=True, donate=True, quantization="fp8")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))
    kept = {id(x) for x in jax.tree.leaves(given)}
    assert any(id(x) in kept for x in jax.tree.leaves(got))  # e.g. the embedding
    assert all(x.is_deleted() for x in jax.tree.leaves(given)
               if id(x) not in {id(y) for y in jax.tree.leaves(got)})

    made, keep = jnp.arange(6.0), jnp.ones(3)
    tree = {"made": made, "keep": keep}
    out = _compact(tree, {id(keep)})
    assert out["keep"] is keep and out["made"] is not made and made.is_deleted()
    np.testing.assert_array_equal(out["made"], np.arange(6.0))


def test_prepare_params_settles_what_it_made_before_the_cache_is_sized(sharp, monkeypatch):
    """The KV cache is sized from the memory free once prepare_params returns, so the
    computations that made new weights must have ended (a buffer they consumed counts as
    in use until then): `settle` runs on the result whenever the layout changed, donated
    or not, and not when nothing was made."""
    import jax

    import jprefix.worker.params as wp

    seen = []
    monkeypatch.setattr(wp, "settle", lambda p: seen.append(p))
    cfg = sharp.config
    got = wp.prepare_params(sharp.params, cfg, unroll_layers=True, quantization="fp8")
    assert len(seen) == 1 and seen[0] is got
    seen.clear()
    assert wp.prepare_params(got, cfg, unroll_layers=True) is got  # idempotent: no work
    assert seen == []
    leaves = jax.tree.leaves(got)
    monkeypatch.undo()
    wp.settle(got)  # the real one: every leaf ready
    assert all(x.is_ready() for x in leaves)
