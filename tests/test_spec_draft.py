"""Speculative decoding with a draft model in the engine: greedy outputs equal to
speculation off (k 1/3/5, prefix cache off/automatic/explicit, preemption, batches
mixing speculating and non-speculating rows); the draft's cache is trusted only where the
draft was fed (a draft identical to the target accepts every proposal even after
non-speculating rows filled the prefix cache), and a prefix the draft computed once is
reused; sampled draft speculation is reproducible by seed; unsupported setups refused."""

import dataclasses

import numpy as np
import pytest

import jprefix
from jprefix import LLM, SamplingParams
from jprefix.engine.args import EngineArgs
from jprefix.engine.drafter import load_draft
from jprefix.worker.pack import BucketConfig
from tests.test_fp8_checkpoint import _write as write_fp8_checkpoint
from tests.test_spec_engine import check_trie_holds_outputs

BS = 8


@pytest.fixture(scope="module")
def tiny():
    """The target and (loaded again by name, the same dummy weights) the draft."""
    return jprefix.load("tiny-llama", dtype="float32", load_format="dummy")


@pytest.fixture(scope="module")
def prompts(tiny):
    rng = np.random.default_rng(2)
    base = rng.integers(3, tiny.config.vocab_size, 20).tolist()  # a shared prefix
    return [base + rng.integers(3, tiny.config.vocab_size, n).tolist() for n in (3, 7, 12)]


def _greedy(n=20):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _draft(k, model="tiny-llama"):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def _llm(target, spec=None, blocks=96, **kw):
    return LLM(target, block_size=BS, num_kv_blocks=blocks, load_format="dummy",
               speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def sharp_reference(sharp_tiny, prompts):
    return [o.token_ids for o in _llm(sharp_tiny).generate(prompts, _greedy(), use_tqdm=False)]


def _check_blocks(llm):
    eng = llm.engine
    bm = eng.scheduler.block_manager
    bm.check_invariants()
    eng.prefix_pool.check_invariants()
    assert not eng.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks - 1


@pytest.mark.parametrize("k,mode", [(1, "auto"), (3, "off"), (3, "explicit"), (5, "auto")])
def test_greedy_draft_speculation_equals_speculation_off(sharp_tiny, prompts,
                                                         sharp_reference, k, mode):
    """A draft that differs from the target (tiny-llama drafting for its sharpened
    copy): some proposals rejected, the outputs exactly the target's."""
    llm = _llm(sharp_tiny, _draft(k), enable_prefix_caching=mode != "off")
    for _ in range(2):  # the second round reuses both caches' prefix blocks
        outs = llm.generate(prompts, _greedy(), prefix_pos=16 if mode == "explicit" else None,
                            use_tqdm=False)
        assert [o.token_ids for o in outs] == sharp_reference
    _check_blocks(llm)
    assert (check_trie_holds_outputs(llm, outs) > 0) == (mode != "off")
    s = llm.engine.stats.spec
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens


def test_draft_under_preemption_and_mixed_rows(sharp_tiny, prompts, sharp_reference):
    llm = _llm(sharp_tiny, _draft(3), blocks=12)
    params = [_greedy(), _greedy(),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2,
                             ignore_eos=True)]
    want = _llm(sharp_tiny, blocks=12).generate(prompts, params, use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs[:2]] == sharp_reference[:2]
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert llm.engine.stats.num_preemptions > 0
    _check_blocks(llm)


def test_draft_cache_trusted_only_where_fed_and_shared_prefix_reused(tiny, prompts):
    """The draft is the target itself, so with a correct draft cache every proposal is
    accepted. Non-speculating rows (max_tokens 1: nothing to propose) first fill the prefix cache
    with blocks whose draft K/V were never written: a drafter trusting them would propose
    from zeros. Then a second round of the same prompts feeds the draft fewer tokens: the
    prefix blocks the first round fed are reused."""
    llm = _llm(tiny, _draft(3))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert llm.engine.stats.spec.num_drafts == 0 and llm.engine.prefix_pool.trie.nodes()
    drafter = llm.engine.drafter
    llm.generate(prompts, _greedy(), use_tqdm=False)
    fed_first = drafter.num_fed_tokens
    llm.generate(prompts, _greedy(), use_tqdm=False)
    s = llm.engine.stats.spec
    assert s.num_accepted_tokens == s.num_draft_tokens > 0
    assert drafter.num_fed_tokens - fed_first < fed_first - 20  # the shared 20 not re-fed
    _check_blocks(llm)


def test_sampled_draft_speculation_is_seed_reproducible(tiny, prompts):
    llm = _llm(tiny, _draft(3))
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=16, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    again = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert first == again and all(len(t) == 16 for t in first)
    assert llm.engine.stats.spec.num_drafts > 0
    _check_blocks(llm)


@pytest.mark.parametrize("field,value", [("tensor_parallel_size", 2),
                                         ("data_parallel_size", 2)])
def test_draft_refuses_parallel_setups_by_name(field, value):
    with pytest.raises(ValueError, match=f"draft_model with {field} {value}"):
        EngineArgs(speculative_config=_draft(2), **{field: value})


def test_draft_refuses_a_sliding_window_target_and_an_fp8_draft(tiny, tmp_path):
    args = EngineArgs(speculative_config=_draft(2), load_format="dummy")
    windowed = dataclasses.replace(tiny, config=dataclasses.replace(
        tiny.config, sliding_window=8), name="windowed")
    with pytest.raises(ValueError, match="sliding-window target 'windowed'"):
        load_draft(args, windowed, BucketConfig())
    write_fp8_checkpoint(tmp_path, "channel")  # (a tiny-llama with fp8 projections)
    args = EngineArgs(speculative_config=_draft(2, str(tmp_path)), dtype="float32")
    with pytest.raises(ValueError, match="an fp8 draft is not supported"):
        load_draft(args, tiny, BucketConfig())
