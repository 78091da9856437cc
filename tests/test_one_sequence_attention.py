"""One sequence's rows gathered once (`one_sequence_attention`, the XLA step's path for
one stream) equal `paged_attention_reference` over query lengths (decode, a verify row,
a chunk, padding rows past the sequence), cached lengths that cut through a block, GQA
ratios, ALiBi, soft caps, sliding windows and fp8 caches with their scales; a step of
one stream runs it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import make_batch

from models.alibi import alibi_slopes
from pallas_kernels.fp8 import quantize_rows
from pallas_kernels.one_sequence_attention import one_sequence_attention
from pallas_kernels.paged_attention import paged_attention_reference


def _args(batch):
    return tuple(batch[k] for k in ("q", "k_cache", "v_cache", "layer", "block_tables",
                                    "kv_lens", "cu_q_lens"))


# (q_len, kv_len, heads, kv_heads, alibi, soft_cap, window): decode, a verify row, a
# chunk cutting through a block, a prompt alone, padding rows after each
CASES = [(1, 1, 4, 2, False, None, None), (1, 20, 4, 4, True, None, None),
         (5, 21, 4, 2, False, None, None), (5, 21, 6, 1, True, None, 7),
         (8, 64, 4, 2, False, 5.0, None), (3, 3, 6, 1, False, None, 1),
         (16, 40, 4, 4, False, None, 7), (16, 40, 6, 1, True, 5.0, None)]


@pytest.mark.parametrize("q_len,kv_len,heads,kv_heads,alibi,soft_cap,window", CASES)
def test_equals_the_reference(q_len, kv_len, heads, kv_heads, alibi, soft_cap, window):
    rng = np.random.default_rng(q_len * 100 + kv_len)
    batch = make_batch(rng, [(q_len, kv_len)], heads=heads, kv_heads=kv_heads, extra_rows=3)
    kw = dict(scale=0.3, soft_cap=soft_cap, sliding_window=window,
              alibi_slopes=jnp.asarray(alibi_slopes(heads)) if alibi else None)
    with jax.default_matmul_precision("highest"):
        want = paged_attention_reference(*_args(batch), **kw)
        got = one_sequence_attention(*_args(batch), **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert not np.asarray(got[q_len:]).any()  # padding rows are zeros


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_cache_with_scales_equals_the_reference(fmt):
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [(5, 37)], heads=4, kv_heads=2)
    k8, ks = quantize_rows(batch["k_cache"], fmt)
    v8, vs = quantize_rows(batch["v_cache"], fmt)
    args = _args(batch | dict(k_cache=k8, v_cache=v8))
    want = paged_attention_reference(*args, scale=0.3, k_scale=ks, v_scale=vs)
    got = one_sequence_attention(*args, scale=0.3, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_more_than_one_sequence_is_refused():
    batch = make_batch(np.random.default_rng(0), [(2, 5), (1, 3)])
    with pytest.raises(ValueError, match="one sequence"):
        one_sequence_attention(*_args(batch), scale=0.3)


def test_one_stream_steps_run_it(monkeypatch):
    """The XLA step sends a one-sequence batch here and a wider one to the reference."""
    import jprefix
    import jprefix.worker.step as step
    from jprefix import LLM, SamplingParams

    calls = {"one": 0, "ref": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(step, "one_sequence_attention", counting("one", one_sequence_attention))
    monkeypatch.setattr(step, "paged_attention_reference",
                        counting("ref", paged_attention_reference))
    jax.clear_caches()  # (steps compiled before the patch would not call it)
    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    llm = LLM(tiny, block_size=8, num_kv_blocks=32, attention_backend="xla")
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7]], sp, use_tqdm=False)  # one stream: T = 2 or 4, S = 1
    assert calls["one"] > 0 and calls["ref"] == 0
    llm.generate([[5, 6, 7], [8, 9]], sp, use_tqdm=False)
    assert calls["ref"] > 0
