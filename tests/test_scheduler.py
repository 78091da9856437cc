"""Scheduler: continuous batching, prefix matching (explicit and automatic), in-batch
sharing, chunked prefill, preemption, and a randomized workload checked against a fake
model that reads its context back from a simulated paged KV cache (scheduler_cases)."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_cases import (
    WORKLOAD,
    AsyncStepper,
    arrive_and_abort,
    check_workload_outputs,
    make,
    reference_output,
    run,
    run_random_workload,
    seq,
    step,
    workload_seqs,
)

from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import Scheduler
from jprefix.core.sequence import SequenceStatus

SHARED = list(range(1, 17))  # 4 blocks of 4


def test_second_batch_computes_only_its_new_tokens():
    sched, runner = make()
    first = [seq(f"a{i}", SHARED + [20 + i] * 5) for i in range(4)]
    for s in first:
        sched.add(s)
    run(sched, runner)
    second = [seq(f"b{i}", SHARED + [30 + i] * 5) for i in range(4)]
    for s in second:
        sched.add(s)
    outs = run(sched, runner)
    prompt_work = sum(s.num_new_tokens for o in outs for s in o.scheduled
                      if s.start < s.seq.num_prompt_tokens)
    assert prompt_work == 4 * 5  # the 16 shared tokens are never recomputed
    assert [s.num_cached_tokens for s in second] == [16] * 4
    stats = sched.prefix_pool.stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (8 * 21, 16 * 7)  # a1..a3: in-batch
    assert all(s.output_token_ids == reference_output(s.prompt_token_ids, s.sampling_params)
               for s in first + second)


def test_in_batch_sharing_within_one_schedule():
    sched, runner = make()
    a, b = seq("a", SHARED + [5]), seq("b", SHARED + [6, 7])
    sched.add(a)
    sched.add(b)
    out, _ = step(sched, runner)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(0, 17), (16, 2)]
    assert b.num_cached_tokens == 16 and a.block_table[:4] == b.block_table[:4]


def test_at_least_one_prompt_token_is_computed():
    sched, runner = make()
    sched.add(seq("a", SHARED))
    run(sched, runner)
    b = seq("b", SHARED)  # fully cached prompt: the last block is recomputed
    sched.add(b)
    out, _ = step(sched, runner)
    assert b.num_cached_tokens == 12
    assert (out.scheduled[0].start, out.scheduled[0].num_new_tokens) == (12, 4)


def test_explicit_prefix_len_limits_matching_and_insertion():
    sched, runner = make()
    a = seq("a", SHARED + [9], prefix_len=9)  # 2 shareable blocks
    sched.add(a)
    run(sched, runner)
    assert len(sched.prefix_pool.trie) == 2
    b = seq("b", SHARED + [9])  # automatic mode: matches what is cached
    sched.add(b)
    run(sched, runner)
    assert b.num_cached_tokens == 8 and len(sched.prefix_pool.trie) == 5  # +2 prompt, +1 output
    c = seq("c", SHARED + [9], prefix_len=5)
    sched.add(c)
    run(sched, runner)
    assert c.num_cached_tokens == 4


def test_prefix_caching_off_matches_nothing():
    sched, runner = make(enable_prefix_caching=False)
    seqs = [seq(f"r{i}", SHARED + [i]) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run(sched, runner)
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 0] and len(sched.prefix_pool.trie) == 0
    assert sched.prefix_pool.stats().num_queried_tokens == 0


def test_chunked_prefill_splits_a_long_prompt_and_completes():
    sched, runner = make(max_num_batched_tokens=8)
    long = seq("long", list(range(1, 21)), max_tokens=3)
    sched.add(long)
    outs = run(sched, runner)
    assert [o.scheduled[0].num_new_tokens for o in outs] == [8, 8, 4, 1, 1]
    assert [o.scheduled[0].sample for o in outs] == [False, False, True, True, True]
    assert long.output_token_ids == reference_output(long.prompt_token_ids, long.sampling_params)


def test_without_chunked_prefill_a_prompt_waits_until_it_fits():
    sched, runner = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add(seq("a", [1, 2, 3], max_tokens=3))
    step(sched, runner)
    b = seq("b", list(range(1, 8)), max_tokens=2)  # 7 tokens; a's decode takes 1 of 8
    sched.add(b)
    out, _ = step(sched, runner)
    assert [s.num_new_tokens for s in out.scheduled] == [1, 7]
    too_long = seq("c", list(range(1, 10)))
    sched.add(too_long)
    run(sched, runner)
    assert too_long.finish_reason == "error"


def test_preemption_under_a_tiny_pool_then_completion():
    sched, runner = make(num_blocks=1 + 6, block_size=2)
    seqs = [seq(f"r{i}", [i + 1] * 4, max_tokens=6) for i in range(3)]  # 5 blocks each at the end
    for s in seqs:
        sched.add(s)
    outs = run(sched, runner)
    assert any(o.preempted for o in outs) and sum(s.num_preemptions for s in seqs) > 0
    for s in seqs:
        assert s.finish_reason == "length"
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.sampling_params)
    assert sched.block_manager.num_used_blocks == 0


def test_a_request_that_can_never_fit_finishes_with_an_error():
    sched, runner = make(num_blocks=1 + 2, block_size=2)
    big, small = seq("big", [1] * 5), seq("small", [2, 3], max_tokens=2)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert out.ignored == [big] and [s.seq for s in out.scheduled] == [small]
    finished = out.ignored + sched.update(out, runner.execute(out))
    assert big in finished and big.finish_reason == "error"
    grows = seq("grows", [4, 5, 6], max_tokens=4)  # outgrows the 2 blocks while running
    sched.add(grows)
    run(sched, runner)
    assert grows.finish_reason == "error" and grows.output_token_ids
    assert sched.block_manager.num_used_blocks == 0


def test_stop_conditions():
    sched, runner = make()
    prompt = [3, 4, 5]
    ref = reference_output(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    stop_tok = seq("stop", prompt, max_tokens=8, stop_token_ids=[ref[2]])
    min_tok = seq("min", prompt, max_tokens=8, stop_token_ids=[ref[0]], min_tokens=2)
    for s in (stop_tok, min_tok):
        sched.add(s)
    run(sched, runner)
    assert stop_tok.output_token_ids == ref[:3] and stop_tok.finish_reason == "stop"
    assert len(min_tok.output_token_ids) >= 2


def test_abort_frees_blocks_and_reports_unknown_ids():
    sched, runner = make()
    a = seq("a", SHARED + [1], max_tokens=10)
    sched.add(a)
    step(sched, runner)
    assert sched.abort("a") and not sched.abort("a") and not sched.abort("zz")
    assert a.finish_reason == "abort" and sched.block_manager.num_used_blocks == 0
    assert not sched.has_unfinished()


def test_max_num_seqs_caps_the_batch():
    sched, runner = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(f"r{i}", [i + 1, 2]))
    out, _ = step(sched, runner)
    assert len(out.scheduled) == 2
    run(sched, runner)



@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**WORKLOAD, max_num_seqs=st.integers(1, 6), chunked=st.booleans())
def test_random_workload_completes_with_balanced_refs(
    async_, reqs, block_size, num_blocks, budget, max_num_seqs, chunked, caching
):
    sched, runner = make(num_blocks, block_size, max_num_batched_tokens=budget,
                         max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
                         enable_prefix_caching=caching)
    seqs = run_random_workload(sched, runner, reqs, async_)
    bm = sched.block_manager
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    check_workload_outputs(sched, seqs, reference_output)
    for s in seqs:
        if s.finish_reason == "error":  # only a request that truly cannot fit
            too_big = bm.blocks_for(s.num_tokens) > bm.num_blocks - 1
            assert too_big or (not chunked and s.num_tokens > budget)


def test_async_scheduling_matches_sync_and_stops_on_time():
    """Step N+1 is scheduled before step N's tokens arrive: outputs are unchanged, no
    row is ever scheduled past max_tokens, and a stop token costs at most one extra row."""
    prompt = [3, 4, 5]
    ref = reference_output(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    results = {}
    for mode in ("sync", "async"):
        sched, runner = make(num_blocks=64, block_size=2, max_num_batched_tokens=8)
        reqs = [seq("len", prompt, max_tokens=6),
                seq("stop", prompt, max_tokens=8, stop_token_ids=[ref[2]]),
                seq("chunk", list(range(1, 30)), max_tokens=3)]
        for r in reqs:
            sched.add(r)
        rows = Counter()
        stepper = AsyncStepper(sched, runner) if mode == "async" else None
        while (stepper.busy() if stepper else sched.has_unfinished()):
            out = stepper.step()[0] if stepper else step(sched, runner)[0]
            rows.update(s.seq.request_id for s in out.scheduled if s.sample)
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks - 1
        results[mode] = ({r.request_id: r.output_token_ids for r in reqs}, rows)
    (sync_out, sync_rows), (async_out, async_rows) = results["sync"], results["async"]
    assert async_out == sync_out and sync_out["stop"] == ref[:3]
    assert async_rows["len"] == sync_rows["len"] == 6  # never past max_tokens
    assert async_rows["chunk"] == sync_rows["chunk"] == 3
    assert async_rows["stop"] == sync_rows["stop"] + 1  # the stop is seen one step late


def commit_every_running_row(sched: Scheduler, out, budget: int) -> int:
    """The general path for every running row, as a reference for the scheduler's inline
    one: take the blocks the row needs (preempting as needed), then `_commit` it."""
    for s in list(sched.running.values()):
        if budget == 0:
            break
        if s.status is not SequenceStatus.RUNNING:
            continue
        remaining = s.num_scheduled_tokens - s.num_computed_tokens
        if remaining == 0 or s.num_scheduled_tokens >= s.token_limit:
            continue
        n = min(remaining, budget)
        if s.num_computed_tokens + n > len(s.block_table) * sched.block_size:
            sched._allocate = lambda seq, end: None  # (the old path: `_commit` allocates)
            try:
                n = sched._grow_running(s, n, out)
            finally:
                del sched._allocate
        if n:
            out.scheduled.append(sched._commit(s, n))
            budget -= n
    return budget


def schedule_state(sched: Scheduler, out) -> tuple:
    """A step's schedule and the block bookkeeping after it, by request id."""
    bm = sched.block_manager
    return ([(s.seq.request_id, s.start, s.num_new_tokens, s.sample) for s in out.scheduled],
            [s.request_id for s in out.preempted], [s.request_id for s in out.ignored],
            {s.request_id: (list(s.block_table), s.num_registered_blocks, s.num_pending)
             for s in sched.running.values()},
            [bm.ref_count(b) for b in range(bm.num_blocks)], bm.free_order())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**WORKLOAD)
def test_inline_running_rows_schedule_as_commit_does(async_, reqs, block_size, num_blocks,
                                                      budget, caching):
    """The inline commit of running rows (with the blocks a row needs taken first) gives
    step for step the same rows, preemptions, block tables, ref counts and free order as
    `_commit` for every row, over random workloads with aborts, sync and async."""
    pairs = []
    for reference in (False, True):
        sched, runner = make(num_blocks, block_size, max_num_batched_tokens=budget,
                             max_num_seqs=4, enable_prefix_caching=caching)
        if reference:
            sched._schedule_running = lambda out, b, s=sched: commit_every_running_row(s, out, b)
        pairs.append((sched, AsyncStepper(sched, runner) if async_ else None, runner))
    seqs = [workload_seqs(reqs) for _ in pairs]
    for t in range(2000):
        states = []
        for (sched, stepper, runner), mine in zip(pairs, seqs, strict=True):
            arrive_and_abort(sched, reqs, mine, t)
            out = stepper.step()[0] if stepper else step(sched, runner)[0]
            states.append(schedule_state(sched, out))
        assert states[0] == states[1], f"step {t}"
        for s in pairs[0][0].running.values():  # no row holds a block it does not need
            assert len(s.block_table) == -(-s.num_computed_tokens // block_size), s
        sched, stepper, _ = pairs[0]
        if t > max(r.arrive for r in reqs) and not (
                stepper.busy() if stepper else sched.has_unfinished()):
            break
    assert [s.output_token_ids for s in seqs[0]] == [s.output_token_ids for s in seqs[1]]
