"""Waiting-queue policies: each policy's order on crafted queues, the age bound (no
starvation under an adversarial stream), bounded per-round cost, and equal greedy tokens
from every policy at engine level."""

import random
import time

import numpy as np
import pytest
from scheduler_cases import FakeRunner, reference_output, run, step

import jprefix
from jprefix import LLM, SamplingParams
from jprefix.core.block_manager import BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.policies import (
    GreedyPolicy,
    LPMPolicy,
    common_blocks,
    make_policy,
    parse_policy,
)
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.request_queue import FCFSPolicy
from jprefix.core.scheduler import Scheduler
from jprefix.core.sequence import Sequence, SequenceStatus

B = 4  # block size


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sq(rid, prompt, prefix_len=None, arrival=0.0, max_tokens=2) -> Sequence:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(rid, prompt, sp, prefix_len=prefix_len, arrival_time=arrival)


def scheduler(policy: str, num_blocks=64, clock=None, **cfg) -> tuple[Scheduler, FakeRunner]:
    bm = BlockManager(num_blocks, B)
    sched = Scheduler(SchedulerConfig(policy=policy, **cfg), bm, PrefixPool(bm))
    sched.waiting.clock = clock or Clock()  # arrival times below are on this clock
    return sched, FakeRunner(B)


def warm(sched, runner, *prompts) -> None:
    """Runs prompts to completion so their whole blocks are cached."""
    for i, p in enumerate(prompts):
        sched.add(sq(f"warm{i}-{len(sched.prefix_pool.trie)}", p))
    run(sched, runner)


def round_order(policy) -> list[str]:
    """The admission order of one round, admitting everything."""
    policy.begin_round()
    order = []
    while (s := policy.peek()) is not None:
        order.append(s.request_id)
        policy.remove(s.request_id)
    return order


P1 = list(range(100, 116))  # 4 blocks
P2 = list(range(200, 208))  # 2 blocks


def test_lpm_orders_by_longest_cached_prefix_then_arrival():
    sched, runner = scheduler("lpm")
    warm(sched, runner, P1 + [1], P2 + [2])
    pol = sched.waiting
    for s in [sq("none", [9] * 9), sq("p2", P2 + [3, 4]), sq("p1", P1 + [5]),
              sq("p1-3", P1[:12] + [7] * 5), sq("p2b", P2 + [6])]:
        pol.add(s)
    assert round_order(pol) == ["p1", "p1-3", "p2", "p2b", "none"]


def test_lpm_falls_back_to_fcfs_over_the_threshold():
    sched, runner = scheduler("lpm:fcfs_threshold=2")
    warm(sched, runner, P1 + [1])
    pol = sched.waiting
    for s in [sq("a", [9] * 9), sq("b", [8] * 9), sq("c", P1 + [5])]:
        pol.add(s)
    assert round_order(pol) == ["a", "b", "c"]


def test_greedy_runs_larger_and_more_frequent_prefixes_first_grouped():
    pool = PrefixPool(BlockManager(64, B))
    pol = GreedyPolicy(pool, clock=Clock())
    small = [sq(f"s{i}", P2 + [i], prefix_len=8) for i in range(3)]  # value 2 * 2
    big = [sq(f"b{i}", P1 + [i], prefix_len=16) for i in range(3)]  # value 4 * 2
    lone = sq("lone", [7, 7])  # no whole block: a group of its own, value 0
    for s in [small[0], lone, big[0], small[1], big[1], small[2], big[2]]:
        pol.add(s)
    assert round_order(pol) == ["b0", "b1", "b2", "s0", "s1", "s2", "lone"]


def test_greedy_prefers_a_cached_prefix_and_groups_automatic_requests():
    sched, runner = scheduler("greedy", clock=Clock())
    warm(sched, runner, P2 + [1])
    pol = sched.waiting
    # cached P2 (2 blocks) x 3: value 6; cold P1 (4 blocks) x 2: value 4.
    for s in [sq("c0", P1 + [1]), sq("w0", P2 + [2]), sq("c1", P1 + [3]), sq("w1", P2 + [4]),
              sq("w2", P2 + [5])]:
        pol.add(s)
    assert round_order(pol) == ["w0", "w1", "w2", "c0", "c1"]


def test_greedy_puts_groups_that_fit_in_free_memory_first():
    big_prefix = list(range(300, 340))  # 10 blocks
    sched, runner = scheduler("greedy", num_blocks=1 + 12, clock=Clock())
    pol = sched.waiting
    for s in [sq("big0", big_prefix + [1], 40), sq("big1", big_prefix + [2], 40),
              sq("p0", P2 + [1], 8), sq("p1", P2 + [2], 8)]:
        pol.add(s)
    sched.block_manager.allocate(4)  # 8 free: the big group (11 to start) cannot start now
    assert round_order(pol) == ["p0", "p1", "big0", "big1"]


@pytest.mark.parametrize("policy", ["fcfs", "greedy", "lpm"])
def test_preempted_and_aged_requests_go_first(policy):
    clock = Clock()
    sched, runner = scheduler(f"{policy}:max_wait=5", clock=clock)
    warm(sched, runner, P1 + [1])
    pol = sched.waiting
    old, new = sq("old", [9] * 9, arrival=0.0), sq("new", P1 + [2], arrival=4.0)
    pol.add(old)
    pol.add(new)
    clock.t = 4.0
    if policy != "fcfs":
        assert round_order(pol) == ["new", "old"]  # old is not urgent yet
        pol.add(old)
        pol.add(new)
    clock.t = 5.5
    assert round_order(pol) == ["old", "new"]
    pre = sq("pre", [8] * 9, arrival=5.0)
    pre.status = SequenceStatus.PREEMPTED
    pol.add(new)
    pol.prepend(pre)
    assert round_order(pol)[0] == "pre"


@pytest.mark.parametrize("policy", ["greedy", "lpm"])
def test_no_starvation_under_a_stream_of_better_matching_requests(policy):
    """One request at a time runs; every step brings a request that shares the cached
    prefix. Without the age bound the unmatched old request waits for ever; with it, it
    is admitted within max_wait seconds (plus the round in flight)."""

    def admitted_at(max_wait: float) -> float | None:
        clock = Clock()
        sched, runner = scheduler(f"{policy}:max_wait={max_wait}", clock=clock, max_num_seqs=1)
        warm(sched, runner, P1 + [0])
        old = sq("old", [9] * 9, arrival=0.0, max_tokens=1)
        sched.add(old)
        for t in range(60):
            clock.t = float(t)
            sched.add(sq(f"r{t}", P1 + [t % 50 + 1, 2], arrival=clock.t, max_tokens=3))
            step(sched, runner)
            if old.is_finished():
                return clock.t
        return None

    assert admitted_at(max_wait=1e9) is None
    t = admitted_at(max_wait=10.0)
    assert t is not None and t <= 10.0 + 3  # one running request finishes every 3 steps


def test_round_cost_is_bounded_on_a_long_queue():
    rng = random.Random(0)
    for spec in ("greedy", "lpm", "fcfs"):
        sched, runner = scheduler(spec, num_blocks=256)
        warm(sched, runner, P1 + [1])
        pol = sched.waiting
        for i in range(5000):  # 500 prefix groups, automatic mode
            g = rng.randrange(500)
            pol.add(sq(f"r{i}", [g + 1000] * 8 + [i % 97] * 6))
        start = time.perf_counter()
        for _ in range(50):
            pol.begin_round()
            pol.remove(pol.peek().request_id)
        assert time.perf_counter() - start < 2.0, spec


@pytest.mark.parametrize("policy", ["greedy", "lpm"])
def test_random_workloads_complete_with_right_outputs(policy):
    rng = random.Random(1)
    prefixes = [[], [7] * 6, [7] * 6 + [8, 9, 10, 11, 12], list(range(20, 33))]
    for trial in range(30):
        sched, runner = scheduler(f"{policy}:max_wait=3", num_blocks=rng.randint(6, 24),
                                  clock=Clock(), max_num_batched_tokens=rng.randint(4, 24),
                                  max_num_seqs=rng.randint(1, 5))
        seqs = []
        for i in range(rng.randint(1, 12)):
            pre = rng.choice(prefixes)
            prompt = pre + [rng.randint(1, 49) for _ in range(rng.randint(1, 6))]
            explicit = len(pre) if pre and rng.random() < 0.5 else None
            seqs.append(sq(f"t{trial}r{i}", prompt, explicit, max_tokens=rng.randint(1, 6)))
        for s in seqs:
            sched.add(s)
        run(sched, runner, max_steps=2000)
        for s in seqs:
            if s.finish_reason != "error":
                assert s.output_token_ids == reference_output(s.prompt_token_ids,
                                                              s.sampling_params)
        assert sched.block_manager.num_used_blocks == 0


def test_policy_specs_are_checked():
    assert parse_policy("lpm:fcfs_threshold=64,max_wait=2.5") == (
        "lpm", {"fcfs_threshold": 64, "max_wait": 2.5})
    pool = PrefixPool(BlockManager(8, B))
    assert isinstance(make_policy("fcfs", pool), FCFSPolicy)
    assert isinstance(make_policy("greedy:window=4", pool), GreedyPolicy)
    assert isinstance(make_policy("lpm", pool), LPMPolicy)
    for bad in ("sjf", "lpm:window=3", "greedy:max_wait", "lpm:max_wait=x", "fcfs:max_wait=0"):
        with pytest.raises(ValueError):
            make_policy(bad, pool)


def test_common_blocks():
    assert common_blocks(P1, P1[:8] + [0] * 8, 4, B) == 2
    assert common_blocks(P1, P1, 3, B) == 3
    assert common_blocks(P1, P1[:6], 4, B) == 1


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama", dtype="float32", load_format="dummy")


def test_every_policy_generates_the_same_greedy_tokens(tiny):
    rng = np.random.default_rng(3)
    V = tiny.config.vocab_size
    groups = [rng.integers(3, V, n).tolist() for n in (40, 24, 9)]
    prompts = [groups[i % 3] + rng.integers(3, V, 1 + i % 5).tolist() for i in range(12)]
    rng.shuffle(prompts)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for policy in ("fcfs", "greedy", "lpm"):  # 40 blocks of 8: forces eviction and waiting
        llm = LLM(tiny, block_size=8, num_kv_blocks=40, max_num_seqs=4, policy=policy)
        outs[policy] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks - 1
    assert outs["greedy"] == outs["fcfs"] and outs["lpm"] == outs["fcfs"]
