"""Speculative decoding in the engine (n-gram): greedy outputs equal to speculation off
across prefix-cache modes, k, preemption, penalties, logit bias and logprobs (the
target's); sampled speculation reproducible by seed; blocks balance and the trie holds
accepted tokens only; a next turn's prefix hit is the same as without speculation;
metrics are consistent."""

import numpy as np
import pytest

import jprefix
from jprefix import LLM, SamplingParams

BS = 8


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama", dtype="float32", load_format="dummy")


@pytest.fixture(scope="module")
def prompts(tiny):
    """Prompts that repeat themselves (so prompt lookup proposes) with distinct tails."""
    rng = np.random.default_rng(1)
    V = tiny.config.vocab_size
    base = rng.integers(3, V, 12).tolist()
    return [base * 3 + rng.integers(3, V, n).tolist() for n in (1, 4, 9, 15)]


def _greedy(n=24):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _spec(k):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    llm = LLM(tiny, block_size=BS, num_kv_blocks=128)
    return [o.token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


def check_trie_holds_outputs(llm, outputs):
    """Every cached block's tokens (with the blocks before it) are a prefix of some
    request's prompt + accepted output: no rejected proposal entered the trie."""
    seqs = [tuple(o.prompt_token_ids) + tuple(o.token_ids) for o in outputs]
    nodes = llm.engine.prefix_pool.trie.nodes()
    for node in nodes:
        path = tuple(t for n in node.path() for t in n.tokens)
        assert any(s[: len(path)] == path for s in seqs), path
    return len(nodes)


def _check_balanced_and_stats(llm):
    eng = llm.engine
    bm = eng.scheduler.block_manager
    bm.check_invariants()
    eng.scheduler.prefix_pool.check_invariants()
    assert not eng.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks - 1
    s = eng.stats.spec
    assert 0 < s.num_accepted_tokens <= s.num_draft_tokens  # (some drafts were accepted)
    per_pos = s.accepted_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert sum(per_pos) == s.num_accepted_tokens and per_pos[0] <= s.num_drafts


@pytest.mark.parametrize("k,mode", [(1, "auto"), (3, "off"), (3, "explicit"), (5, "auto")])
def test_greedy_ngram_speculation_equals_speculation_off(tiny, prompts, reference, k, mode):
    llm = LLM(tiny, block_size=BS, num_kv_blocks=128, speculative_config=_spec(k),
              enable_prefix_caching=mode != "off")
    prefix = 36 if mode == "explicit" else None
    for _ in range(2):  # the second round hits the cache the first filled
        outs = llm.generate(prompts, _greedy(), prefix_pos=prefix, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
    _check_balanced_and_stats(llm)
    assert (check_trie_holds_outputs(llm, outs) > 0) == (mode != "off")


def test_async_scheduling_overlaps_the_steps_without_proposals(tiny, prompts, reference):
    """With async scheduling (the default) a step is dispatched while the one before it
    runs unless that one verifies proposals (its rows' next positions depend on what is
    accepted) or a sequence would propose; outputs stay equal to speculation off."""
    llm = LLM(tiny, block_size=BS, num_kv_blocks=128, speculative_config=_spec(3))
    eng, in_flight = llm.engine, []
    dispatch = eng.runner.dispatch

    def spy(*args, **kwargs):  # the step in flight when each step is dispatched
        in_flight.append(eng._inflight)
        return dispatch(*args, **kwargs)

    eng.runner.dispatch = spy
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert not any(f is not None and f.verifies for f in in_flight)
    assert any(f is not None for f in in_flight)  # some steps overlapped
    _check_balanced_and_stats(llm)


def test_speculation_under_preemption(tiny, prompts, reference):
    llm = LLM(tiny, block_size=BS, num_kv_blocks=16, speculative_config=_spec(3))
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.stats.num_preemptions > 0
    _check_balanced_and_stats(llm)
    _check_metrics(llm)


def test_next_turns_hit_the_accepted_output_blocks_as_without_speculation(tiny, prompts):
    """The prefix-cache hit of a conversation's next turn (prompt + reply + new text) is
    the same with speculation on as off: every full block of accepted output is cached
    (no hit lost to rollback) and holds the accepted tokens (the replies are equal)."""
    hits, replies = {}, {}
    for name, spec in (("off", None), ("on", _spec(3))):
        rng = np.random.default_rng(9)
        llm = LLM(tiny, block_size=BS, num_kv_blocks=128, speculative_config=spec)
        first = llm.generate(prompts, _greedy(), use_tqdm=False)
        turns = [p + o.token_ids + rng.integers(3, 100, 5).tolist()
                 for p, o in zip(prompts, first, strict=True)]
        second = llm.generate(turns, _greedy(8), use_tqdm=False)
        hits[name] = [o.num_cached_tokens for o in second]
        replies[name] = [o.token_ids for o in first + second]
    assert replies["on"] == replies["off"]
    assert hits["on"] == hits["off"]
    # (the reply's last token has no K/V yet: its block fills in the next turn)
    assert all(h == (len(p) + 23) // BS * BS for h, p in zip(hits["on"], prompts, strict=True))


def _check_metrics(llm):
    """/stats and /metrics report the engine's counters under vLLM's names."""
    from jprefix.entrypoints.metrics import engine_snapshot, metrics_registry, render_metrics

    spec = engine_snapshot(llm)["spec_decode"]
    stats = llm.engine.stats.spec
    assert spec["num_draft_tokens"] == stats.num_draft_tokens > 0
    assert spec["mean_accepted_length"] == 1 + stats.num_accepted_tokens / stats.num_drafts
    text = render_metrics(metrics_registry(llm, "m")).decode()
    assert (f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f'{float(stats.num_accepted_tokens)}') in text
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {float(stats.num_drafts)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text


def _logprob_entries(out):
    return [[(t, lp.rank, lp.logprob) for t, lp in d.items()] for d in out.logprobs]


def test_penalised_logprob_and_sampled_rows_speculate_exactly(tiny, prompts):
    """Every kind of row speculates in one batch: greedy ones with a repetition and a
    frequency penalty or a logit bias equal speculation off (each verify position counts
    the proposals before it), logprobs are the target's at each emitted token, and the
    sampled rows (rejection sampling, with penalties, min-p and top-p too) draw the same
    tokens on every run with their seeds, alone or batched."""
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24,
                             ignore_eos=True)
    processed = SamplingParams(temperature=0.7, seed=9, max_tokens=24, min_p=0.05,
                               presence_penalty=0.5, logit_bias={5: 3.0}, ignore_eos=True)
    params = [_greedy(), sampled,
              SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3,
                             frequency_penalty=0.3, logit_bias={7: 0.5}, logprobs=1,
                             ignore_eos=True)]
    base = LLM(tiny, block_size=BS, num_kv_blocks=128)
    spec = LLM(tiny, block_size=BS, num_kv_blocks=128, speculative_config=_spec(3))
    want = base.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for i in (0, 2, 3):
        assert got[i].token_ids == want[i].token_ids
    for i in (2, 3):
        g, w = _logprob_entries(got[i]), _logprob_entries(want[i])
        assert [[e[:2] for e in d] for d in g] == [[e[:2] for e in d] for d in w]
        np.testing.assert_allclose([e[2] for d in g for e in d],
                                   [e[2] for d in w for e in d], rtol=1e-4, atol=1e-5)
    params[3] = processed
    first = spec.generate(prompts, params, use_tqdm=False)
    again = spec.generate(prompts, params, use_tqdm=False)
    alone = spec.generate(prompts[1::2], params[1::2], use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert [first[1].token_ids, first[3].token_ids] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 24 for o in first)
    _check_balanced_and_stats(spec)


def test_engine_refuses_a_bad_speculative_config(tiny):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny, block_size=BS, num_kv_blocks=32,
            speculative_config={"method": "ngram", "num_speculative_tokens": -1})
