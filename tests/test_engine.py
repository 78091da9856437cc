"""Engine equivalences: cached == uncached == dense greedy generation, on random tiny models.

Also: a second batch computes only its new tokens, in-batch sharing, eviction and
preemption keep outputs right, the compile count stays bounded, and ref counts balance.
"""

import jax
import numpy as np
import pytest

import jprefix
from jprefix import LLM, SamplingParams
from models.reference import dense_generate

BS = 8  # block size: small so short prompts span several blocks
# The Pallas kernels: compiled on a GPU, interpreted elsewhere
PALLAS = "pallas" if jax.default_backend() == "gpu" else "pallas-interpret"


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama", dtype="float32", load_format="dummy")


def _prompts(rng, vocab, prefix_len, unique_lens):
    shared = rng.integers(3, vocab, prefix_len).tolist()
    return [shared + rng.integers(3, vocab, n).tolist() for n in unique_lens]


def _dense(model, prompt, n):
    return dense_generate(model.params, model.config, prompt, n, eos_token_ids=())


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _assert_blocks_balanced(llm):
    bm = llm.engine.scheduler.block_manager
    bm.check_invariants()
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks - 1  # everything free or evictable


@pytest.mark.parametrize("mode", ["explicit", "auto", "off"])
def test_greedy_matches_dense_with_cache_on_and_off(tiny, mode):
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, tiny.config.vocab_size, 37, [1, 5, 12, 20])
    llm = LLM(tiny, block_size=BS, enable_prefix_caching=mode != "off", num_kv_blocks=128)
    prefix = 37 if mode == "explicit" else None
    for _ in range(2):  # the second round hits the cache filled by the first
        outs = llm.generate(prompts, _greedy(10), prefix_pos=prefix, use_tqdm=False)
        for p, o in zip(prompts, outs, strict=True):
            assert o.token_ids == _dense(tiny, p, 10)
            assert o.finish_reason == "length"
    expect_cached = 0 if mode == "off" else 32
    assert all(o.num_cached_tokens >= expect_cached for o in outs)
    _assert_blocks_balanced(llm)


def test_multi_level_prefixes_share_parent_blocks(tiny):
    rng = np.random.default_rng(2)
    V = tiny.config.vocab_size
    policy = rng.integers(3, V, 24).tolist()
    depts = [policy + rng.integers(3, V, 16).tolist() for _ in range(2)]
    prompts = [d + rng.integers(3, V, 5).tolist() for d in depts for _ in range(2)]
    prompts.append(policy + rng.integers(3, V, 9).tolist())
    prefix_pos = [40, 40, 40, 40, 24]
    llm = LLM(tiny, block_size=BS, num_kv_blocks=128)
    llm.generate(prompts[:1] + prompts[2:3], _greedy(4), prefix_pos=[40, 40], use_tqdm=False)
    outs = llm.generate(prompts, _greedy(6), prefix_pos=prefix_pos, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _dense(tiny, p, 6)
    assert [o.num_cached_tokens for o in outs] == [40, 40, 40, 40, 24]
    _assert_blocks_balanced(llm)


def test_second_batch_computes_only_new_tokens(tiny):
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, tiny.config.vocab_size, 48, [7, 9, 11])
    llm = LLM(tiny, block_size=BS, num_kv_blocks=128)
    llm.generate(prompts[:1], _greedy(1), prefix_pos=48, use_tqdm=False)
    llm.engine.step_stats.clear()
    outs = llm.generate(prompts, _greedy(1), prefix_pos=48, use_tqdm=False)
    computed = sum(s[1] for s in llm.engine.step_stats)
    assert [o.num_cached_tokens for o in outs] == [48, 48, 48]
    assert computed == 7 + 9 + 11


def test_in_batch_sharing_within_one_step(tiny):
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, tiny.config.vocab_size, 32, [3, 4, 5, 6])
    llm = LLM(tiny, block_size=BS, num_kv_blocks=128)
    llm.engine.step_stats.clear()
    outs = llm.generate(prompts, _greedy(1), prefix_pos=32, use_tqdm=False)
    assert len(llm.engine.step_stats) == 1  # one step computed every prompt
    assert llm.engine.step_stats[0][1] == 32 + 3 + 4 + 5 + 6  # the prefix once
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _dense(tiny, p, 1)


def test_eviction_and_preemption_keep_outputs_correct(tiny):
    rng = np.random.default_rng(5)
    V = tiny.config.vocab_size
    prompts = [_prompts(rng, V, 24, [4])[0] for _ in range(6)]  # six distinct prefixes
    # 12 usable blocks of 8: two sequences of 28 + 24 tokens need 14 -> preemption
    llm = LLM(tiny, block_size=BS, num_kv_blocks=13, max_num_seqs=4)
    for _ in range(2):
        outs = llm.generate(prompts, _greedy(24), prefix_pos=24, use_tqdm=False)
        for p, o in zip(prompts, outs, strict=True):
            assert o.token_ids == _dense(tiny, p, 24)
    _assert_blocks_balanced(llm)


def test_chunked_prefill_matches_dense(tiny):
    rng = np.random.default_rng(6)
    prompts = _prompts(rng, tiny.config.vocab_size, 50, [30, 2])
    llm = LLM(tiny, block_size=BS, num_kv_blocks=128, max_num_batched_tokens=16)
    outs = llm.generate(prompts, _greedy(5), prefix_pos=50, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _dense(tiny, p, 5)
    assert max(s[1] for s in llm.engine.step_stats) <= 16


def test_compilations_bounded_by_buckets(tiny):
    rng = np.random.default_rng(7)
    llm = LLM(tiny, block_size=BS, num_kv_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=64, enable_cascade=False)
    for n in (1, 3, 8):
        lens = rng.integers(1, 40, n).tolist()
        llm.generate(_prompts(rng, tiny.config.vocab_size, 8, lens), _greedy(3), use_tqdm=False)
    seen = llm.engine.runner.shapes_seen
    T = {t for t, *_ in seen}
    S = {s for _, s, *_ in seen}
    # (one stream of <= 8 tokens packs into T = 2, 4 or 8 and S = 1 on the CPU:
    # BucketConfig.single_stream)
    assert T <= {2, 4, 8, 16, 32, 64} and S <= {1, 8}
    assert all(s == 1 for t, s, *_ in seen if t < 16)
    assert len(seen) <= 6 * 1 * 4 * 3  # T x S x M buckets x (decode, mixed, prefill)


def test_pallas_backend_matches_xla(tiny):
    rng = np.random.default_rng(8)
    prompts = _prompts(rng, tiny.config.vocab_size, 16, [3, 9])
    outs = {}
    for backend in ("xla", PALLAS):
        llm = LLM(tiny, block_size=BS, num_kv_blocks=32, attention_backend=backend)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, _greedy(3), prefix_pos=16,
                                                           use_tqdm=False)]
    assert outs["xla"] == outs[PALLAS]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])  # qwen2: Q/K/V biases
def test_fused_projections_rotate_and_write_kv_in_one_kernel_and_match_dense(
        tiny, name, monkeypatch):
    """Unrolled layers on one device fuse Q/K/V and gate/up (as on a GPU). With the Pallas
    backend every step's layers rotate Q/K and write the KV cache in one rope_write_kv
    call each (interpreted on CPU, where the 16-row decode steps also run skinny_matmul):
    greedy tokens equal the XLA backend's and the dense model's."""
    import jprefix.worker.step as step_mod

    model = tiny if name == "tiny-llama" else jprefix.load(name, dtype="float32",
                                                           load_format="dummy")
    fused_calls = []
    real = step_mod.rope_write_kv
    monkeypatch.setattr(step_mod, "rope_write_kv",
                        lambda *a, **k: fused_calls.append(k["interpret"]) or real(*a, **k))
    step_mod.step.clear_cache()  # traced anew, so that the count sees every step's layers
    rng = np.random.default_rng(13)
    prompts = _prompts(rng, model.config.vocab_size, 8, [3, 6])
    outs = {}
    for backend in ("xla", PALLAS):
        llm = LLM(model, block_size=BS, num_kv_blocks=32, attention_backend=backend,
                  unroll_layers=True)
        assert llm.engine.runner.params.layers[0].w_up is None  # fused
        outs[backend] = [o.token_ids for o in llm.generate(prompts, _greedy(3),
                                                           use_tqdm=False)]
        if backend == "xla":  # the model's RoPE and write_kv
            assert fused_calls == []
    # one call per layer of every step shape compiled
    assert len(fused_calls) == model.config.num_layers * len(llm.engine.runner.shapes_seen)
    assert set(fused_calls) == {PALLAS == "pallas-interpret"}
    assert outs["xla"] == outs[PALLAS] == [_dense(model, p, 3) for p in prompts]


def test_mixed_steps_decode_rows_first_with_their_own_tiling(sharp_tiny):
    """Steps that mix decodes with prefill chunks (a small token budget) put the one-token
    rows first and attend them with the decode tiling: greedy tokens equal the XLA
    backend's and the dense model's, and such steps did run."""
    tiny = sharp_tiny
    rng = np.random.default_rng(12)
    prompts = _prompts(rng, tiny.config.vocab_size, 0, [5, 30, 21, 3])
    outs, mixed = {}, {}
    for backend in ("xla", PALLAS):
        llm = LLM(tiny, block_size=BS, num_kv_blocks=64, max_num_batched_tokens=16,
                  attention_backend=backend, enable_prefix_caching=False,
                  unroll_layers=True)  # (fused Q/K/V: rope_write_kv with Pallas)
        res = llm.generate(prompts, _greedy(4), use_tqdm=False)
        outs[backend] = [o.token_ids for o in res]
        mixed[backend] = sum(m for *_, m in llm.engine.runner.shapes_seen)
    assert outs["xla"] == outs[PALLAS] == [_dense(tiny, p, 4) for p in prompts]
    assert mixed[PALLAS] >= 1


def test_stop_token_ids_and_max_tokens_finish(tiny):
    rng = np.random.default_rng(9)
    prompt = _prompts(rng, tiny.config.vocab_size, 10, [0])[0]
    ref = _dense(tiny, prompt, 8)
    llm = LLM(tiny, block_size=BS, num_kv_blocks=64)
    stop_at = ref[3]
    sp = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert out.token_ids == ref[: ref.index(stop_at) + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], _greedy(5), use_tqdm=False)[0]
    assert out.token_ids == ref[:5] and out.finish_reason == "length"


def test_async_and_sync_scheduling_give_identical_outputs(tiny):
    """Scheduling step N+1 before step N's tokens arrive changes no output: greedy and
    seeded sampling, with stop tokens, a tiny pool (preemption) and chunked prefill."""
    rng = np.random.default_rng(7)
    prompts = _prompts(rng, tiny.config.vocab_size, 37, [1, 4, 9, 15, 22])
    greedy = _greedy(10)
    sampled = SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=10,
                             ignore_eos=True)
    ref = LLM(tiny, block_size=BS, num_kv_blocks=64, async_scheduling=False)
    stop_at = ref.generate(prompts[:1], greedy, use_tqdm=False)[0].token_ids[3]
    stopping = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at])
    outs = {}
    for mode in (False, True):
        llm = LLM(tiny, block_size=BS, num_kv_blocks=14, max_num_batched_tokens=24,
                  async_scheduling=mode)
        runs = [llm.generate(prompts, sp, prefix_pos=32, use_tqdm=False)
                for sp in (greedy, sampled, stopping)]
        outs[mode] = [[(o.token_ids, o.finish_reason) for o in run] for run in runs]
        _assert_blocks_balanced(llm)
        last = llm.generate(prompts[:1], stopping, use_tqdm=False)[0]
        assert last.finish_reason == "stop"  # its stop was seen one step late
        _assert_blocks_balanced(llm)  # ... and the engine holds no step afterwards
    assert outs[True] == outs[False]
    assert outs[True][0][0][0] == _dense(tiny, prompts[0], 10)
    for (tokens, _), (cut, reason) in zip(outs[True][0], outs[True][2], strict=True):
        if stop_at in tokens:  # cut right after its first stop token, one step late or not
            assert (cut, reason) == (tokens[: tokens.index(stop_at) + 1], "stop")
        else:
            assert (cut, reason) == (tokens, "length")


def test_max_model_len_must_fit_the_kv_cache(tiny):
    from jprefix.engine.args import EngineArgs
    from jprefix.engine.runner_setup import fit_max_model_len

    with pytest.raises(ValueError, match="max_model_len 600 is outside"):
        LLM(tiny, block_size=8, num_kv_blocks=64, max_model_len=600)  # the model's is 512
    with pytest.raises(ValueError, match="max_model_len 510 does not fit .*num_kv_blocks"):
        LLM(tiny, block_size=8, num_kv_blocks=64, max_model_len=510)  # 63 * 8 = 504 tokens
    with pytest.raises(ValueError, match="8192 tokens does not fit .*gpu_memory_utilization"):
        fit_max_model_len(EngineArgs(block_size=16), 8192, 64)  # cache sized from memory
    assert fit_max_model_len(EngineArgs(block_size=16), 8192, 1 + 512) == 8192
    assert fit_max_model_len(EngineArgs(block_size=16, max_model_len=100), 8192, 64) == 100
    llm = LLM(tiny, block_size=8, num_kv_blocks=1 + 16)  # the user sized the cache: capped
    assert llm.engine.max_model_len == 128
    with pytest.raises(ValueError, match="exceeds the model context of 128"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=29), use_tqdm=False)


def test_requests_that_fit_alone_all_complete_by_preempting(tiny):
    """Each request fills the whole cache alone: they take turns (preemption) and every
    one finishes with its full length, none with 'error'."""
    llm = LLM(tiny, block_size=8, num_kv_blocks=1 + 16)
    prompts = [np.random.default_rng(i).integers(3, 200, 40).tolist() for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=88, ignore_eos=True),
                        use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert all(len(o.token_ids) == 88 for o in outs)
    assert llm.scheduler.block_manager.num_used_blocks == 0


def test_engine_stats_count_every_token(tiny):
    """EngineStats after a batch: one TTFT per request, one inter-token latency per later
    token (rows of a step observed together keep their count), histogram totals exact."""
    llm = LLM(tiny, block_size=BS, num_kv_blocks=64)
    rng = np.random.default_rng(7)
    lens = [3, 5, 8]
    llm.generate(_prompts(rng, tiny.config.vocab_size, 12, [4, 6, 9]),
                 [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens])
    stats = llm.engine.stats
    assert stats.generation_tokens == sum(lens)
    assert stats.ttft.count == 3
    assert stats.itl.count == sum(n - 1 for n in lens)
    for hist in (stats.ttft, stats.itl, stats.e2e):
        assert sum(hist.counts) == hist.count
        assert hist.cumulative()[-1] == ("+Inf", hist.count)
    assert 0 < stats.itl.sum < 60 * stats.itl.count
    assert stats.finished["length"] == 3
