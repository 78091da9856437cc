"""Speculative decoding on the host: the n-gram proposer, the config, and the scheduler's
verify rows and rollback against a fake model that reads its context back from a
simulated paged KV cache (tests/scheduler_cases.py), over random workloads."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_cases import (
    EOS,
    WORKLOAD,
    FakeRunner,
    V,
    arrive_and_abort,
    check,
    check_workload_outputs,
    reference_output,
)

from jprefix.core.block_manager import BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.ngram_proposer import NgramProposer
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import Scheduler
from jprefix.core.sequence import Sequence
from jprefix.core.spec_config import SpeculativeConfig
from jprefix.core.spec_decode import DRAFT_PLACEHOLDER, Speculator, set_proposals
from jprefix.core.structured_outputs import StructuredOutputsParams


def loop_token(context: list[int]) -> int:
    """A fake model that mostly repeats its context with period 3 (so prompt lookup
    proposes well) and sometimes breaks the loop (so some proposals are rejected)."""
    if len(context) % 7 == 0 or len(context) < 3:
        return (sum(context) * 31 + len(context) * 7) % V
    return context[-3]


def reference(prompt: list[int], sp: SamplingParams) -> list[int]:
    return reference_output(prompt, sp, loop_token)


class VerifyRunner(FakeRunner):
    """FakeRunner whose verify rows write their proposals' K/V too and return the emitted
    tokens (greedy acceptance against `loop_token`), as the engine hands them to update."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.drafted = self.accepted = 0

    def execute(self, out, pending=None) -> list:
        for s in out.scheduled:
            assert s.start + s.num_new_tokens <= s.seq.num_computed_tokens
            ids = (s.seq.all_token_ids + s.seq.spec_token_ids)[: s.start + s.num_new_tokens]
            assert len(ids) == s.start + s.num_new_tokens, s.seq
            for pos in range(s.start, s.start + s.num_new_tokens):
                self.slots[self._slot(s.seq, pos)] = (pos, ids[pos])
        sampled = []
        for s in out.scheduled:
            end, d = s.start + s.num_new_tokens, len(s.seq.spec_token_ids)
            context = [self.slots[self._slot(s.seq, p)][1] for p in range(end)]
            assert context == (s.seq.all_token_ids + s.seq.spec_token_ids)[:end], s.seq
            if not s.sample:
                sampled.append(-1)
                continue
            if not d:
                sampled.append(loop_token(context))
                continue
            known = end - d
            emitted = []
            for j in range(d + 1):
                target = loop_token(context[: known + j])
                emitted.append(target)
                if j == d or target != s.seq.spec_token_ids[j]:
                    break
            self.drafted += d
            self.accepted += len(emitted) - 1
            sampled.append(emitted)
        return sampled


def check_trie(sched: Scheduler, runner: VerifyRunner) -> None:
    """Every trie node's block holds exactly the node's tokens (K/V of known tokens, never
    a rejected proposal's), and a running sequence's registered blocks hold its own."""
    B = sched.block_size
    for node in sched.prefix_pool.trie.nodes():
        held = [runner.slots.get((node.block, o), (None, None))[1] for o in range(B)]
        assert held == list(node.tokens), node.block
    for s in sched.running.values():
        for i in range(s.num_registered_blocks):
            assert list(sched.prefix_pool.trie.node_of(s.block_table[i]).tokens) == \
                s.all_token_ids[i * B : (i + 1) * B]


def make(num_blocks, block_size, k, **cfg) -> tuple[Scheduler, VerifyRunner]:
    cfg.setdefault("eos_token_ids", {EOS})
    bm = BlockManager(num_blocks, block_size)
    spec = Speculator(SpeculativeConfig("ngram", k, prompt_lookup_max=3, prompt_lookup_min=1))
    return (Scheduler(SchedulerConfig(**cfg), bm, PrefixPool(bm), speculator=spec),
            VerifyRunner(block_size))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**WORKLOAD, k=st.sampled_from([1, 3, 5]), chunked=st.booleans())
def test_random_workload_with_speculation_is_exact_and_balanced(
        async_, reqs, block_size, num_blocks, budget, caching, k, chunked):
    sched, runner = make(num_blocks, block_size, k, max_num_batched_tokens=budget,
                         max_num_seqs=4, enable_chunked_prefill=chunked,
                         enable_prefix_caching=caching)
    seqs = []
    for i, r in enumerate(reqs):
        prompt = [5, 6, 7] * (1 + r.prefix) + r.tail
        sp = SamplingParams(temperature=0, max_tokens=r.max_tokens * 2,
                            ignore_eos=r.ignore_eos)
        seqs.append(Sequence(f"r{i}", prompt, sp, cache_salt=r.salt,
                             prefix_len=len(prompt) // 2 if r.explicit else None))
    for t in range(3000):
        arrive_and_abort(sched, reqs, seqs, t)
        if t > max(r.arrive for r in reqs) and not sched.has_unfinished():
            break
        out = sched.schedule()
        check(sched)
        sched.update(out, runner.execute(out))
        check(sched)
        check_trie(sched, runner)
    else:
        raise AssertionError("workload did not finish")
    check_workload_outputs(sched, seqs, reference)  # (every block free: no leak after rollbacks)
    assert runner.accepted <= runner.drafted


def test_speculation_accepts_on_a_looping_model_and_stops_at_max_tokens():
    sched, runner = make(64, 4, 3, max_num_batched_tokens=64)
    s = Sequence("a", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=20,
                                                        ignore_eos=True))
    sched.add(s)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        check(sched)
        steps += 1
    assert s.output_token_ids == reference(s.prompt_token_ids, s.sampling_params)
    assert runner.accepted > 5 and steps < 20  # fewer steps than tokens


def test_sampled_and_processed_rows_speculate_structured_and_stop_string_ones_do_not():
    sched, runner = make(64, 4, 3)
    greedy = Sequence("g", [1, 2, 3] * 3, SamplingParams(temperature=0, max_tokens=8))
    sampled = Sequence("s", [1, 2, 3] * 3, SamplingParams(temperature=0.8, max_tokens=8))
    penal = Sequence("p", [1, 2, 3] * 3, SamplingParams(temperature=0, max_tokens=8,
                                                       repetition_penalty=1.2, logprobs=1))
    structured = Sequence("j", [1, 2, 3] * 3, SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json_object=True)))
    stopped = Sequence("t", [1, 2, 3] * 3, SamplingParams(temperature=0, max_tokens=8,
                                                         stop=["ab"]))
    for s in (greedy, sampled, penal, structured, stopped):
        sched.add(s)
    sched.update(out := sched.schedule(), runner.execute(out))
    out = sched.schedule()
    rows = {sc.seq.request_id: sc.num_new_tokens for sc in out.scheduled}
    assert rows["g"] > 1 and rows["s"] > 1 and rows["p"] > 1
    assert rows["j"] == 1 and rows["t"] == 1


def test_draft_model_rows_reserve_slots_the_drafter_fills():
    """A draft model's proposals come from the device: the scheduler reserves min(k,
    tokens left - 1) slots (blocks allocated for them), which `set_proposals` fills."""
    bm = BlockManager(64, 4)
    spec = Speculator(SpeculativeConfig("draft_model", 3, model="d"))
    sched = Scheduler(SchedulerConfig(eos_token_ids={EOS}), bm, PrefixPool(bm), speculator=spec)
    a = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3))
    sched.add(a)
    sched.update(sched.schedule(), [7])
    (row,) = sched.schedule().scheduled
    assert row.num_new_tokens == 2 and a.spec_token_ids == [DRAFT_PLACEHOLDER]  # 2 left
    assert len(a.block_table) * 4 >= row.start + row.num_new_tokens
    with pytest.raises(ValueError, match="reserved 1"):
        set_proposals(a, [8, 9])
    set_proposals(a, [8])
    assert a.spec_token_ids == [8]


@pytest.mark.parametrize("tokens,k,expected", [
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # suffix [1,2,3] seen at 0: what followed it
    ([1, 2, 3, 9, 8, 2, 3], 3, [9, 8, 2]),  # [2,3] (the longest that recurs)
    ([4, 4, 4, 4], 3, [4]),  # overlapping: the most recent earlier occurrence
    ([1, 2, 3, 4], 3, []),  # nothing recurs
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, [8, 1]),  # the most recent of several
])
def test_ngram_proposer(tokens, k, expected):
    assert NgramProposer(2, 4).propose(tokens, k) == expected


def test_ngram_proposer_respects_min_and_max():
    tokens = [1, 2, 3, 4, 9, 9, 2, 3, 4]
    assert NgramProposer(3, 3).propose(tokens, 2) == [9, 9]
    assert NgramProposer(4, 5).propose(tokens, 2) == []  # [1..4] never recurs whole
    rng = np.random.default_rng(0)
    long = rng.integers(0, 20, 5000).tolist()
    got = NgramProposer(1, 3).propose(long, 4)
    n = next(n for n in (3, 2, 1)  # the brute-force answer
             if any(long[i:i + n] == long[-n:] for i in range(len(long) - n)))
    last = max(i for i in range(len(long) - n) if long[i:i + n] == long[-n:])
    assert got == long[last + n : last + n + 4]


@pytest.mark.parametrize("raw,match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "eagle"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min 5"),
    ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "foo"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ("{not json", "not JSON"),
])
def test_config_refuses_bad_values_by_name(raw, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(raw)


def test_config_parses_vllm_keys():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                  '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 4, 4)
    assert SpeculativeConfig.parse({"model": "x", "num_speculative_tokens": 2}).method == \
        "draft_model"


def test_speculator_keeps_each_sequences_tokens_incrementally():
    """The n-gram search reads a per-sequence int64 copy extended by the tokens appended
    since the last row (not the whole list converted every step): it stays equal to the
    tokens through growth past its buffer, and proposals equal the proposer on the list."""
    spec = Speculator(SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}))
    rng = np.random.default_rng(0)
    seq = Sequence("a", rng.integers(3, 9, 40).tolist(),
                   SamplingParams(temperature=0, max_tokens=500))
    fresh = NgramProposer(1, 3)
    for _ in range(120):  # (grows past the first 80-token buffer)
        arr = spec._token_array(seq)
        assert arr.tolist() == seq.all_token_ids
        assert spec.proposer.propose(arr, 3) == fresh.propose(seq.all_token_ids, 3)
        seq.all_token_ids.append(int(rng.integers(3, 9)))


def test_probe_holds_for_a_few_probes_after_a_proposal_and_reuses_its_lookup():
    """`Speculator.probe` (the async engine's cue to wait for the step in flight): true
    while a running sequence would propose, and for PROBE_HOLD - 1 more probes after the
    last one that did; its lookup serves the `propose` on the same tokens. A seeded
    sampled request pins the engine synchronous, a greedy or unseeded one does not."""
    from jprefix.core.sequence import SequenceStatus
    from jprefix.core.spec_decode import PROBE_HOLD, pins_sync

    spec = Speculator(SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}))
    loop = Sequence("l", [5, 6, 7] * 4, SamplingParams(temperature=0, max_tokens=50))
    plain = Sequence("p", list(range(10, 40)), SamplingParams(temperature=0, max_tokens=50))
    for seq in (loop, plain):
        seq.status = SequenceStatus.RUNNING
    assert spec.probe([plain, loop])
    calls = []
    real = spec.proposer.propose
    spec.proposer.propose = lambda *a: calls.append(a) or real(*a)
    assert spec.propose(loop, 8) == 3 and loop.spec_token_ids == [5, 6, 7]
    assert not calls  # (the probe's lookup, same tokens)
    spec.proposer.propose = real
    held = [spec.probe([plain]) for _ in range(PROBE_HOLD + 2)]
    assert held == [True] * (PROBE_HOLD - 1) + [False] * 3
    assert not spec.probe([])
    loop.status = SequenceStatus.FINISHED_STOPPED
    assert not spec.probe([loop])  # (finished: proposes nothing)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=8)
    assert pins_sync(Sequence("s", [1, 2], seeded))
    assert not pins_sync(Sequence("u", [1, 2], SamplingParams(temperature=0.8, max_tokens=8)))
    assert not pins_sync(Sequence("g", [1, 2], SamplingParams(temperature=0, seed=3,
                                                               max_tokens=8)))
