"""fp8 accuracy on the real SmolLM2-135M (float32 baseline), teacher-forced over 2,048
tokens of a public-domain text (tests/data/coriolanus.txt: the opening of Shakespeare's
Coriolanus): top-1 agreement of each position's prediction with the baseline's, and the
perplexity change, for the fp8 KV cache (e4m3 and e5m2), fp8 weights, and both.

The fp8 cache is applied as its exact per-row round trip (`fp8.quantize_rows` then
`dequantize_rows`, what the cache stores and every kernel reads) inside dense attention;
`test_paged_fp8_cache_matches_the_round_trip` ties that to the engine's paged path (write
with quantisation, paged attention on the fp8 cache) on a prefix of the text.

fp8 weights are `quantize_linears`' default, the engine's: every linear layer in fp8 but
the last layer's MLP, kept in the model dtype (with it in fp8 too: weights 89.6% top-1,
+3.8% perplexity; both 88.3%, +4.2%, on 1,024 tokens).

Measured (docs/PERF.md's figures, jaxlib 0.10.2): fp8 e4m3 KV 95.3% top-1, +0.61%
perplexity; e5m2 KV 89.4%, +3.2%; fp8 weights 90.3%, +1.9%; both 89.0%, +2.2% (jaxlib
0.10.1: 95.4% / +0.61%, 90.1% / +3.0%, 91.0% / +1.6%, 89.0% / +2.7%). Issue 17's bounds
are fp8 KV >= 98% top-1 and <= +1% perplexity, both <= +3%: the perplexity bounds are
met, the KV cache's top-1 is not on this 135M model
(`test_issue_kv_top1_bound_not_met_on_smollm2`, strict xfail). Why 2,048 tokens: the
figures move with the XLA build and the machine (rounding flips); over 1,024 tokens
"both" measured +2.8% on one machine and +3.35% on another with the same packages, across
the +3% bound. The floors below are the worse of the measured figures with a margin, so a
regression fails and a rebuilt XLA does not.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_options import FULL_OPT

import jprefix
from models.layout import quantize_linears
from models.llama import compute_logits, forward
from models.reference import causal_attention, dense_forward
from pallas_kernels.fp8 import FP8_NAMES, dequantize_rows, quantize_rows
from pallas_kernels.kv_cache import write_kv
from pallas_kernels.paged_attention import paged_attention_reference

TOKENS = 2048
DATA = "tests/data/coriolanus.txt"


@pytest.fixture(scope="module")
def smollm2():
    model = jprefix.load("smollm2-135m", dtype="float32")
    with open(DATA) as f:
        ids = np.asarray(model.tokenizer(f.read()).input_ids, np.int32)
    assert len(ids) > TOKENS
    return model, ids[:TOKENS + 1]


def round_trip_logits(params, cfg, tokens, fp8):
    """float32 logits [T, V]: dense causal attention with every K/V row through the fp8
    cache's per-row round trip (`fp8` None: no round trip)."""
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def attn(q, k, v, cache, layer):
        if fp8 is not None:
            k = dequantize_rows(*quantize_rows(k, fp8), dtype=k.dtype)
            v = dequantize_rows(*quantize_rows(v, fp8), dtype=v.dtype)
        return causal_attention(q, k, v, pos, pos), cache

    def logits(p, t):
        hidden, _ = forward(p, cfg, t[None], pos, None, attn)
        return compute_logits(p, cfg, hidden[0])

    return np.asarray(jax.jit(logits, compiler_options=FULL_OPT)(params, tokens))


def scores(logits, base, targets):
    """(top-1 agreement with the baseline, perplexity / baseline perplexity - 1)."""
    def ppl(lg):
        lg = lg - lg.max(-1, keepdims=True)
        nll = np.log(np.exp(lg).sum(-1)) - lg[np.arange(len(targets)), targets]
        return float(np.exp(nll.mean()))
    return float(np.mean(logits.argmax(-1) == base.argmax(-1))), ppl(logits) / ppl(base) - 1


@pytest.fixture(scope="module")
def results(smollm2):
    model, ids = smollm2
    cfg, params = model.config, model.params
    tokens, targets = jnp.asarray(ids[:-1]), ids[1:]
    base = np.asarray(jax.jit(lambda p, t: dense_forward(p, cfg, t[None])[0],
                              compiler_options=FULL_OPT)(params, tokens))
    fp8w = quantize_linears(params)
    out = {
        "kv_e4m3": round_trip_logits(params, cfg, tokens, FP8_NAMES["fp8"]),
        "kv_e5m2": round_trip_logits(params, cfg, tokens, FP8_NAMES["fp8_e5m2"]),
        "weights": round_trip_logits(fp8w, cfg, tokens, None),
        "both": round_trip_logits(fp8w, cfg, tokens, FP8_NAMES["fp8"]),
    }
    res = {k: scores(v, base, targets) for k, v in out.items()}
    print({k: (f"top-1 {t:.2%}", f"ppl {p:+.2%}") for k, (t, p) in res.items()})
    return res


# (top-1 floor, perplexity-change ceiling): measured figures with a margin (docstring)
FLOORS = {"kv_e4m3": (0.945, 0.0095), "kv_e5m2": (0.885, 0.037), "weights": (0.895, 0.025),
          "both": (0.88, 0.03)}


@pytest.mark.parametrize("mode", sorted(FLOORS))
def test_accuracy_against_the_float32_baseline(results, mode):
    top1, ppl = results[mode]
    floor, ceiling = FLOORS[mode]
    assert top1 >= floor and ppl <= ceiling, (mode, top1, ppl)


def test_fp8_kv_meets_the_issue_perplexity_bound(results):
    assert results["kv_e4m3"][1] <= 0.01  # issue 17: within +1%


def test_both_fp8_modes_meet_the_issue_perplexity_bound(results):
    assert results["both"][1] <= 0.03  # issue 17: within +3%


@pytest.mark.xfail(strict=True, reason="issue 17's fp8 KV top-1 >= 98% is not met on "
                   "SmolLM2-135M (95.3%)")
def test_issue_kv_top1_bound_not_met_on_smollm2(results):
    assert results["kv_e4m3"][0] >= 0.98


def test_paged_fp8_cache_matches_the_round_trip(smollm2):
    """The engine's XLA path on 256 tokens in two chunks (write_kv quantising into the
    paged fp8 cache, paged attention reading it back) gives the round trip's logits, up
    to fp8 rounding flips (below)."""
    model, ids = smollm2
    cfg, params = model.config, model.params
    tokens, b, fp8 = ids[:256], 16, FP8_NAMES["fp8"]
    shape = (cfg.num_layers, cfg.num_kv_heads, 1 + len(tokens) // b, b, cfg.head_dim)
    cache = (jnp.zeros(shape, fp8), jnp.zeros(shape, fp8), jnp.ones(shape[:-1], jnp.float32),
             jnp.ones(shape[:-1], jnp.float32))
    table = jnp.arange(1, shape[2], dtype=jnp.int32)[None]

    @functools.partial(jax.jit, static_argnums=2, compiler_options=FULL_OPT)
    def chunk(cache, toks, start):
        pos = start + jnp.arange(toks.shape[0], dtype=jnp.int32)

        def attn(q, k, v, cache, layer):
            cache = write_kv(*cache[:2], layer, k, v, pos + b, *cache[2:])
            out = paged_attention_reference(
                q, *cache[:2], layer, table, jnp.asarray([start + toks.shape[0]], jnp.int32),
                jnp.asarray([0, toks.shape[0]], jnp.int32), scale=cfg.head_dim ** -0.5,
                k_scale=cache[2], v_scale=cache[3])
            return out, cache

        hidden, cache = forward(params, cfg, toks, pos, cache, attn)
        return compute_logits(params, cfg, hidden), cache

    first, cache = chunk(cache, jnp.asarray(tokens[:160]), 0)
    second, _ = chunk(cache, jnp.asarray(tokens[160:]), 160)
    paged = np.concatenate([np.asarray(first), np.asarray(second)])
    want = round_trip_logits(params, cfg, jnp.asarray(tokens), fp8)
    exact = round_trip_logits(params, cfg, jnp.asarray(tokens), None)
    # The first rows agree to float32 rounding; later, a K/V element that the paged and
    # dense paths compute a rounding apart can straddle an fp8 rounding boundary and
    # land one fp8 step (~6%) apart, and 30 layers amplify such flips: the two fp8 paths
    # then differ by quantisation-sized noise (measured 0.020 relative L2, 96.9% top-1
    # agreement), less than the round trip differs from float32 (0.034), not bit for bit.
    np.testing.assert_allclose(paged[:4], want[:4], rtol=1e-4, atol=1e-4)
    err = np.linalg.norm(paged - want) / np.linalg.norm(want)
    quant = np.linalg.norm(exact - want) / np.linalg.norm(want)
    print(f"paged vs round trip {err:.4f}, round trip vs float32 {quant:.4f}, top-1 "
          f"{np.mean(paged.argmax(-1) == want.argmax(-1)):.3f}")
    assert err < quant
    assert np.mean(paged.argmax(-1) == want.argmax(-1)) >= 0.95
