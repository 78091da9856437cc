"""Grammar masks filled while the next step runs its model (`LLMEngine._masks_later`),
with a stand-in grammar whose mask depends on each row's previous token
(tests/fake_grammar.py): every output keeps the rule, and the tokens equal the
synchronous engine's, greedy and seeded, with logprobs, on one device and under tensor
parallelism over two."""

import textwrap

import numpy as np
import pytest
from fake_grammar import NextResidue, follows
from subprocess_checks import assert_check, check_names
from test_tensor_parallel import PRELUDE, two_device_run

import jprefix
from jprefix import LLM, SamplingParams


def _params():
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True,
                           logprobs=2)]


def test_masks_later_keep_the_rule_and_equal_the_sync_engine():
    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (9, 14, 20)]
    outs, sampled = {}, []
    for async_scheduling in (True, False):
        llm = LLM(tiny, block_size=8, num_kv_blocks=64, async_scheduling=async_scheduling)
        llm.engine.structured = NextResidue(tiny.config.vocab_size)
        llm.engine.runner.sample = lambda *a, f=llm.engine.runner.sample, tag=async_scheduling: (
            sampled.append(tag), f(*a))
        outs[async_scheduling] = llm.generate(prompts, _params(), use_tqdm=False)
    assert sampled and all(sampled)  # the async engine sampled later; the sync one never
    for p, a, s in zip(prompts, outs[True], outs[False], strict=True):
        assert follows(p, a.token_ids) and a.token_ids == s.token_ids
    got, want = outs[True][2].logprobs, outs[False][2].logprobs
    assert [d.keys() for d in got] == [d.keys() for d in want]


TP_SCRIPT = PRELUDE + textwrap.dedent("""
    sys.path.insert(0, "tests")
    from fake_grammar import NextResidue, follows
    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    prompts = shared_prompts(2)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True,
                             logprobs=1)]
    out = {}
    for tp, async_scheduling in ((1, False), (2, True)):
        llm = LLM(tiny, tensor_parallel_size=tp, block_size=8, num_kv_blocks=64,
                  attention_backend=backend, async_scheduling=async_scheduling)
        llm.engine.structured = NextResidue(tiny.config.vocab_size)
        calls, sample = [], llm.engine.runner.sample
        llm.engine.runner.sample = lambda *a: (calls.append(1), sample(*a))
        out[tp] = [o.token_ids for o in llm.generate(prompts, params[:1] * 2 + params[1:],
                                                     prefix_pos=24, use_tqdm=False)]
        assert bool(calls) == async_scheduling, calls  # (the sync engine never samples later)
    assert all(follows(p, o) for p, o in zip(prompts, out[2])), out
    assert out[1] == out[2], out
""")


@pytest.mark.parametrize("check", check_names(TP_SCRIPT))
def test_masks_later_under_tensor_parallelism_equal_one_device(check):
    # (one subprocess on 2 devices; each assertion in it is a test here, by name)
    assert_check(two_device_run(TP_SCRIPT, "xla"), check)
