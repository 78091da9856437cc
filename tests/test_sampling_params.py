"""vLLM's sampling features through the engine, against independent references: logprobs
and prompt logprobs equal log_softmax of the dense reference model's logits; penalties,
logit bias and min_p equal a numpy reference of the processed distribution; n > 1 and
best_of are reproducible by seed, rank by cumulative logprob and share the prompt's
blocks through the prefix cache; LLM.chat renders the chat template; cache_salt
isolates."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jprefix
from jprefix import LLM, SamplingParams
from jprefix.core.sequence import Sequence
from jprefix.engine.input_processor import render_chat
from jprefix.worker.logits_processing import process_logits
from jprefix.worker.pack import BucketConfig, pack_step
from jprefix.worker.pack_sampling import pack_sampling
from jprefix.worker.request_rows import RequestRows
from jprefix.worker.sampler import sample
from models.reference import dense_forward

RNG = np.random.default_rng(0)
PROMPT = RNG.integers(3, 200, 21).tolist()
OTHER = RNG.integers(3, 200, 13).tolist()


@pytest.fixture(scope="module")
def llm(sharp_tiny):
    # small token budget: the 21-token prompts prefill in chunks (prompt logprobs span them)
    return LLM(sharp_tiny, block_size=8, num_kv_blocks=96, max_num_batched_tokens=16)


def _dense_logprobs(model, tokens: list[int]) -> np.ndarray:
    """float64 [len(tokens), V]: log_softmax of the dense model's logits at each position."""
    logits = dense_forward(model.params, model.config, jnp.asarray([tokens], jnp.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), np.float64)


def _processed(logits: np.ndarray, prompt: list[int], output: list[int],
               sp: SamplingParams) -> np.ndarray:
    """numpy reference of vLLM's logits processing: bias, repetition (prompt and output
    tokens), frequency and presence (output tokens)."""
    x = np.array(logits, np.float64)
    for token, bias in (sp.logit_bias or {}).items():
        x[token] += bias
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x))
    seen = (counts > 0) | np.isin(np.arange(len(x)), prompt)
    r = sp.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


def test_logprobs_and_prompt_logprobs_equal_the_dense_log_softmax(llm, sharp_tiny):
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=5,
                        prompt_logprobs=4)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]  # (its prompt is cached: ignored)
    ref = _dense_logprobs(sharp_tiny, PROMPT + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 6
    total = 0.0
    for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + i]
        assert list(position)[0] == token
        np.testing.assert_allclose(position[token].logprob, row[token], atol=2e-4)
        assert position[token].rank == 1 + int((row > row[token] + 1e-6).sum())
        top5 = [t for t, lp in position.items() if lp.rank <= 5]
        assert set(top5) == set(np.argsort(-row)[:5].tolist())
        for t in top5:
            np.testing.assert_allclose(position[t].logprob, row[t], atol=2e-4)
        total += row[token]
    np.testing.assert_allclose(out.cumulative_logprob, total, atol=1e-3)
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for p in range(1, len(PROMPT)):
        position, row = out.prompt_logprobs[p], ref[p - 1]
        np.testing.assert_allclose(position[PROMPT[p]].logprob, row[PROMPT[p]], atol=2e-4)
        assert {t for t, lp in position.items() if lp.rank <= 4} == \
            set(np.argsort(-row)[:4].tolist())
    assert out.num_cached_tokens == 0  # prompt logprobs need every prompt position


def test_penalties_and_logit_bias_follow_the_numpy_reference(llm, sharp_tiny):
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                               repetition_penalty=1.6, frequency_penalty=0.4,
                               presence_penalty=0.3, logit_bias={7: 0.5, 9: -3.0})
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # one batch mixing a penalised row with plain ones (per-row parameters on device)
    outs = llm.generate([PROMPT, OTHER, PROMPT], [penalized, plain, plain], use_tqdm=False)
    tokens = outs[0].token_ids
    assert tokens != outs[2].token_ids  # the penalties changed the greedy path
    logits = np.asarray(dense_forward(sharp_tiny.params, sharp_tiny.config,
                                      jnp.asarray([PROMPT + tokens], jnp.int32))[0])
    for i, token in enumerate(tokens):
        x = _processed(logits[len(PROMPT) - 1 + i], PROMPT, tokens[:i], penalized)
        assert x[token] >= x.max() - 1e-4, (i, token, int(x.argmax()))


def test_process_logits_of_packed_rows_equals_numpy():
    rng = np.random.default_rng(1)
    V = 64
    sps = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.2,
                          logit_bias={3: 4.0, 60: -1.5}),
           SamplingParams(),
           SamplingParams(frequency_penalty=1.5, min_p=0.2)]
    rows = []
    for i, sp in enumerate(sps):
        seq = Sequence(f"r{i}", rng.integers(0, V, 9).tolist(), sp, seed=i)
        for t in rng.integers(0, 8, 6 + i).tolist():  # repeats: counts > 1
            seq.append_token(t)
        seq.block_table = [1 + 3 * i, 2 + 3 * i, 3 + 3 * i]
        rows.append((seq, seq.num_tokens - 1, 1, True))
    batch = pack_step(rows, 8, BucketConfig())
    extra, _ = pack_sampling(rows, len(batch["kv_lens"]), batch["cu_q_lens"], RequestRows())
    batch |= extra
    logits = rng.normal(size=(len(batch["kv_lens"]), V)).astype(np.float32) * 3
    got = np.asarray(process_logits(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in
                                                          batch.items()},
                                    jnp.asarray(batch["token_ids"])))
    for i, (seq, *_rest) in enumerate(rows):
        want = _processed(logits[i], seq.prompt_token_ids, seq.output_token_ids,
                          seq.sampling_params)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


def test_min_p_keeps_tokens_above_its_share_of_the_top_probability():
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    n = 3000
    logits = jnp.asarray(np.tile(np.log(probs), (n, 1)))
    out = np.asarray(sample(logits, jnp.ones(n), jnp.full(n, -1), jnp.ones(n),
                            jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32),
                            jnp.full(n, 0.35, jnp.float32)))
    assert set(np.unique(out)) == {0, 1}  # 0.15 < 0.35 * 0.5
    np.testing.assert_allclose(np.bincount(out, minlength=4)[:2] / n, [0.625, 0.375], atol=0.03)


def test_n_samples_are_seeded_distinct_and_share_the_prompt_blocks(llm):
    llm.reset_prefix_cache()
    prompt = RNG.integers(3, 200, 40).tolist()  # 4 full blocks of 8 are shareable
    sp = SamplingParams(temperature=1.0, n=4, seed=11, max_tokens=5, ignore_eos=True)
    before = llm.prefix_pool.stats()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    after = llm.prefix_pool.stats()
    # the first sample computes the prompt; the other three hit its 4 blocks
    assert after.num_queried_tokens - before.num_queried_tokens == 4 * 40
    assert after.num_hit_tokens - before.num_hit_tokens == 3 * 32
    samples = [o.token_ids for o in out.outputs]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples}) == 4
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == samples
    # sample i is the request of seed + i
    single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=13, max_tokens=5,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert single.token_ids == samples[2]


def test_best_of_returns_the_highest_cumulative_logprobs(llm, sharp_tiny):
    base = dict(temperature=1.0, seed=5, max_tokens=4, ignore_eos=True)
    every = llm.generate([OTHER], SamplingParams(n=5, logprobs=0, **base), use_tqdm=False)[0]
    best = llm.generate([OTHER], SamplingParams(n=2, best_of=5, **base), use_tqdm=False)[0]
    ranked = sorted(every.outputs, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked]
    assert best.outputs[0].logprobs is None  # not asked for
    ref = _dense_logprobs(sharp_tiny, OTHER + best.token_ids)
    want = sum(ref[len(OTHER) - 1 + i][t] for i, t in enumerate(best.token_ids))
    np.testing.assert_allclose(best.cumulative_logprob, want, atol=1e-3)


def test_cache_salt_isolates_generate_calls(llm):
    llm.reset_prefix_cache()
    prompt = RNG.integers(3, 200, 33).tolist()
    sp = SamplingParams(temperature=0, max_tokens=1)
    assert llm.generate([prompt], sp, cache_salt="a", use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([prompt], sp, cache_salt="b", use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([prompt], sp, cache_salt="a", use_tqdm=False)[0].num_cached_tokens == 32
    outs = jprefix.generate(llm.engine.model, [prompt, prompt], sampling_params=sp,
                            cache_salt=["x", "y"], block_size=8, num_kv_blocks=32)
    assert [o.num_cached_tokens for o in outs] == [0, 0]


@pytest.mark.parametrize("kwargs, match", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias[5]"),
])
def test_bad_sampling_values_raise_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        SamplingParams(**kwargs)


def test_logit_bias_ids_are_checked_against_the_vocabulary(llm):
    with pytest.raises(ValueError, match="logit_bias token id 999"):
        llm.generate([PROMPT], SamplingParams(logit_bias={999: 1.0}), use_tqdm=False)


def test_chat_uses_the_shared_chat_template(smollm2_gguf):
    llm = LLM(jprefix.load(smollm2_gguf, dtype="float32"), num_kv_blocks=64)
    conv = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello."}]
    sp = SamplingParams(temperature=0, max_tokens=5)
    out = llm.chat(conv, sp, use_tqdm=False)[0]
    ids = render_chat(llm.tokenizer, conv)
    assert out.prompt_token_ids == ids
    assert out.token_ids == llm.generate([ids], sp, use_tqdm=False)[0].token_ids
    both = llm.chat([conv, conv[1:]], sp, use_tqdm=False)
    assert both[0].token_ids == out.token_ids
    assert both[1].prompt_token_ids == render_chat(llm.tokenizer, conv[1:])


def test_logprobs_and_penalties_survive_preemption(sharp_tiny, monkeypatch):
    # 11 usable blocks of 8 tokens; four 40-token requests need 20: some are preempted
    llm = LLM(sharp_tiny, block_size=8, num_kv_blocks=12)
    preempted = []
    original = llm.scheduler._preempt
    monkeypatch.setattr(llm.scheduler, "_preempt",
                        lambda seq, out: (preempted.append(seq.request_id), original(seq, out)))
    prompts = [RNG.integers(3, 200, 20).tolist() for _ in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1,
                        prompt_logprobs=1, repetition_penalty=1.3)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert preempted
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.token_ids
        ref = _dense_logprobs(sharp_tiny, prompt + tokens)
        assert len(out.logprobs) == len(tokens) == 20
        assert len(out.prompt_logprobs) == len(prompt)
        got = [out.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        np.testing.assert_allclose(got, [ref[len(prompt) - 1 + i][t]
                                         for i, t in enumerate(tokens)], atol=2e-4)
        logits = np.asarray(dense_forward(sharp_tiny.params, sharp_tiny.config,
                                          jnp.asarray([prompt + tokens], jnp.int32))[0])
        for i, token in enumerate(tokens):
            x = _processed(logits[len(prompt) - 1 + i], prompt, tokens[:i], sp)
            assert x[token] >= x.max() - 1e-4
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks - 1


def test_plain_requests_run_the_plain_step_and_feature_requests_the_extra_one():
    """A batch without penalties, bias or logprobs packs no extra arrays and traces no
    logits processing (its program is the one from before the sampling features); one
    row with logprobs switches the whole step to the extra variant."""
    from jprefix import LLM
    from jprefix.worker import step as step_mod
    from scripts.memcheck import synthetic_rows

    llm = LLM("tiny-llama3", dtype="float32", load_format="dummy", block_size=8,
              num_kv_blocks=32, attention_backend="xla")
    runner = llm.engine.runner
    rows = synthetic_rows([list(range(3, 15))] * 2, [[1, 2], [3, 4]], [6, 1])

    def traced(rows):
        _, (flat, layout, batch), _, kind, _ = runner.packer.pack(rows, None)
        text = str(step_mod.step.trace(
            runner.params, runner.kv_cache, flat, runner._last_tokens, layout=layout,
            cfg=runner.cfg, backend=runner.backend, decode=kind.decode, greedy=True,
            cascade=kind.cascade, extra=kind.extra).jaxpr)
        return kind.extra, set(batch), text

    extra, names, text = traced(rows)
    assert not extra and "plp_idx" not in names
    assert "top_k" not in text  # (the logprobs' top-k, the extra stage's mark)
    seq = rows[0].seq
    seq.sampling_params = SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    seq.num_logprobs, seq.sampling_extra = 2, True
    extra, names, text = traced(rows)
    assert extra and "plp_idx" in names and "top_k" in text
