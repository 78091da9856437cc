"""pallas_kernels.tiled_attention: the XLA path of many-sequence steps equals
`paged_attention_reference` over ragged batches (decode rows, prefill chunks cutting
through blocks, a cached prefix, padding rows and a padding sequence), GQA, ALiBi, a soft
cap, sliding windows, fp8 caches with scales, tile sizes and lax.map batching; and the
XLA step sends prefill and mixed steps of several sequences to it, decode steps to the
reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import make_batch, random_ragged_seqs

from models.alibi import alibi_slopes
from pallas_kernels import tiled_attention as tiled
from pallas_kernels.fp8 import quantize_rows
from pallas_kernels.paged_attention import paged_attention_reference

ARGS = ("q", "k_cache", "v_cache", "layer", "block_tables", "kv_lens", "cu_q_lens")


def _check(batch, tile=8, **kw):
    args = tuple(batch[k] for k in ARGS)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(paged_attention_reference(*args, **kw))
        got = np.asarray(tiled.tiled_attention(*args, tile=tile, **kw))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    n = int(batch["cu_q_lens"][-1])
    assert not got[n:].any()  # padding rows are zeros
    return got


# (heads, kv_heads, alibi, soft_cap, window, tile)
GRID = [(4, 2, False, None, None, 8), (4, 4, True, None, None, 4),
        (6, 1, False, 5.0, None, 16), (4, 2, False, None, 7, 8), (6, 2, True, None, 12, 1),
        (4, 1, True, 5.0, 5, 32)]


@pytest.mark.parametrize("heads,kv_heads,alibi,soft_cap,window,tile", GRID)
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_the_reference_on_ragged_batches(seed, heads, kv_heads, alibi, soft_cap,
                                                window, tile):
    rng = np.random.default_rng(seed * 31 + heads + tile)
    seqs = random_ragged_seqs(rng) + [(1, 9), (1, 1)]  # decode rows too
    batch = make_batch(rng, seqs, heads=heads, kv_heads=kv_heads, extra_rows=5)
    _check(batch, tile=tile, scale=0.3, soft_cap=soft_cap, sliding_window=window,
           alibi_slopes=jnp.asarray(alibi_slopes(heads)) if alibi else None)


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_cache_with_scales_equals_the_reference(fmt):
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [(5, 37), (20, 20), (1, 8), (0, 0)], heads=4, kv_heads=2)
    k8, ks = quantize_rows(batch["k_cache"], fmt)
    v8, vs = quantize_rows(batch["v_cache"], fmt)
    _check(batch | dict(k_cache=k8, v_cache=v8), scale=0.3, k_scale=ks, v_scale=vs)


def test_tiles_in_several_lax_map_batches(monkeypatch):
    """A bound on the gathered elements small enough that the tiles run in batches of
    two (the last one short) gives the same rows."""
    monkeypatch.setattr(tiled, "GATHER_ELEMENTS", 2 * 2 * 2 * 6 * 8 * 64)
    tiled.tiled_attention.clear_cache()
    rng = np.random.default_rng(5)
    batch = make_batch(rng, [(13, 40), (3, 3), (1, 17), (9, 30)], heads=4, kv_heads=2)
    _check(batch, tile=4, scale=0.3)
    tiled.tiled_attention.clear_cache()


def test_xla_steps_of_several_sequences_run_it(monkeypatch):
    """The XLA step sends prefill and mixed steps of several sequences here, decode steps
    of several to the reference; outputs equal a one-at-a-time run's."""
    import jprefix
    import jprefix.worker.step as step
    from jprefix import LLM, SamplingParams

    calls = {"tiled": 0, "ref": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(step, "tiled_attention", counting("tiled", tiled.tiled_attention))
    monkeypatch.setattr(step, "paged_attention_reference",
                        counting("ref", paged_attention_reference))
    step.step.clear_cache()
    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in (40, 7, 23)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny, block_size=8, num_kv_blocks=64)
    together = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert calls["tiled"] > 0 and calls["ref"] > 0  # (traced per layer per step shape)
    alone = [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p in prompts]
    assert together == alone
    step.step.clear_cache()
