"""Scheduler: continuous batching, prefix matching (explicit and automatic), in-batch
sharing, chunked prefill, preemption, and a randomized workload checked against a fake
model that reads its context back from a simulated paged KV cache."""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jprefix.core.block_manager import BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import Scheduler
from jprefix.core.sequence import Sequence, SequenceStatus

V, EOS = 50, 0


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    return (sum(context) * 31 + len(context) * 7) % V


def reference_output(prompt: list[int], sp: SamplingParams,
                     model: Callable[[list[int]], int] = next_token) -> list[int]:
    """The fake `model`'s greedy output for the prompt, with sp's stop rules."""
    out: list[int] = []
    while True:
        out.append(model(prompt + out))
        stop = out[-1] in sp.stop_token_ids or (not sp.ignore_eos and out[-1] == EOS)
        if (stop and len(out) >= sp.min_tokens) or len(out) >= sp.max_tokens:
            return out


class FakeRunner:
    """Writes each scheduled token into its slot, then reads every context back through
    the block table: a wrong shared block or slot shows up as a wrong token."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}  # (block, off) -> (pos, tok)

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.block_size], pos % self.block_size

    def execute(self, out, pending: dict[str, int] | None = None) -> list[int]:
        """Each row's sampled token (-1 where it does not sample), as the runner returns
        them. `pending` holds the tokens sampled by the step before, not yet appended on
        the host (async scheduling), by request id; the device reads them from that
        step's output."""

        def tokens(seq: Sequence, end: int) -> list[int]:
            ids = seq.all_token_ids[:end]
            if len(ids) < end:
                assert len(ids) == end - 1, seq  # only the newest token may be pending
                ids = ids + [pending[seq.request_id]]
            return ids

        for s in out.scheduled:  # write then attend, as the runner does per layer
            assert s.start + s.num_new_tokens <= s.seq.num_computed_tokens
            assert 0 not in s.seq.block_table
            ids = tokens(s.seq, s.start + s.num_new_tokens)
            for pos in range(s.start, s.start + s.num_new_tokens):
                self.slots[self._slot(s.seq, pos)] = (pos, ids[pos])
        sampled = []
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            context = [self.slots[self._slot(s.seq, p)] for p in range(end)]
            assert context == list(enumerate(tokens(s.seq, end))), s.seq
            sampled.append(next_token([t for _, t in context]) if s.sample else -1)
        return sampled


class AsyncStepper:
    """Drives the scheduler as the engine does with async scheduling: step N+1 is
    scheduled and run before step N's tokens are applied. `invariants` (default `check`)
    runs after every schedule and update."""

    def __init__(self, sched: Scheduler, runner: FakeRunner, invariants=None):
        self.sched, self.runner, self.inflight = sched, runner, None
        self.check = invariants or check

    def busy(self) -> bool:
        return self.sched.has_unfinished() or self.inflight is not None

    def step(self):
        out = self.sched.schedule()
        self.check(self.sched)
        pending = {} if self.inflight is None else {
            s.seq.request_id: t for s, t in zip(self.inflight[0].scheduled, self.inflight[1],
                                                strict=True) if s.sample}
        sampled = self.runner.execute(out, pending)
        finished = list(out.ignored)
        if self.inflight is not None:
            finished += self.sched.update(*self.inflight)
            self.check(self.sched)
        self.inflight = (out, sampled) if out.scheduled else None
        return out, finished


def make(num_blocks=64, block_size=4, **cfg) -> tuple[Scheduler, FakeRunner]:
    cfg.setdefault("eos_token_ids", {EOS})
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**cfg), bm, PrefixPool(bm)), FakeRunner(block_size)


def seq(rid, prompt, max_tokens=4, prefix_len=None, **sp) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sp)
    return Sequence(rid, prompt, params, prefix_len=prefix_len)


def check(sched: Scheduler) -> None:
    bm, pool = sched.block_manager, sched.prefix_pool
    bm.check_invariants()
    pool.check_invariants()
    owners = Counter(b for s in sched.running.values() for b in s.block_table)
    for block in range(1, bm.num_blocks):  # refs are exactly the live owners (no pins)
        assert bm.ref_count(block) == owners[block], block
        assert owners[block] <= 1 or bm.is_cached(block), block
    assert all(not s.block_table for s in sched.waiting)
    cached_free = bm.num_evictable_blocks
    plain_free = bm.num_free_blocks - cached_free
    assert plain_free + cached_free + bm.num_used_blocks == bm.num_blocks - 1


def step(sched: Scheduler, runner: FakeRunner, invariants=check):
    out = sched.schedule()
    invariants(sched)
    finished = out.ignored + sched.update(out, runner.execute(out))
    invariants(sched)
    return out, finished


def run(sched: Scheduler, runner: FakeRunner, max_steps=1000) -> list:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "scheduler did not finish"
        outs.append(step(sched, runner)[0])
    return outs


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


@dataclass
class Request:
    prefix: int
    tail: list[int]
    max_tokens: int
    explicit: bool
    salt: str | None
    arrive: int
    abort: int | None
    ignore_eos: bool


PREFIXES = [[], [7] * 6, [7] * 6 + [8, 9, 10, 11, 12]]  # nested: shared parents

requests = st.lists(
    st.builds(
        Request,
        prefix=st.integers(0, 2),
        tail=st.lists(st.integers(1, V - 1), min_size=1, max_size=8),
        max_tokens=st.integers(1, 8),
        explicit=st.booleans(),
        salt=st.sampled_from([None, None, "t"]),
        arrive=st.integers(0, 6),
        abort=st.one_of(st.none(), st.integers(0, 12)),
        ignore_eos=st.booleans(),
    ),
    min_size=1,
    max_size=10,
)


# a random workload's scheduler settings (and its requests)
WORKLOAD = dict(async_=st.booleans(), reqs=requests, block_size=st.sampled_from([2, 4]),
                num_blocks=st.integers(4, 32), budget=st.integers(1, 32),
                caching=st.booleans())


def workload_seqs(reqs: list[Request]) -> list[Sequence]:
    seqs = []
    for i, r in enumerate(reqs):
        prompt = PREFIXES[r.prefix] + r.tail
        sp = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
        prefix_len = len(PREFIXES[r.prefix]) if r.explicit else None
        seqs.append(Sequence(f"r{i}", prompt, sp, prefix_len=prefix_len, cache_salt=r.salt))
    return seqs


def arrive_and_abort(sched: Scheduler, reqs: list[Request], seqs: list[Sequence], t: int):
    for r, s in zip(reqs, seqs, strict=True):
        if r.arrive == t:
            sched.add(s)
        if r.abort == t and r.arrive < t:
            sched.abort(s.request_id)


def run_workload(sched: Scheduler, runner: FakeRunner, reqs: list[Request],
                 seqs: list[Sequence], stepper=None, step_fn=None) -> None:
    """Steps (with `stepper`, else `step_fn`, default `step`) until every request arrived
    and finished; AssertionError if 2,000 steps do not finish the workload."""
    step_fn = step_fn or step
    for t in range(2000):
        arrive_and_abort(sched, reqs, seqs, t)
        busy = stepper.busy() if stepper else sched.has_unfinished()
        if t > max(r.arrive for r in reqs) and not busy:
            return
        if stepper:
            stepper.step()
        else:
            step_fn(sched, runner)
    raise AssertionError("workload did not finish")


def run_random_workload(sched: Scheduler, runner: FakeRunner, reqs: list[Request],
                        async_: bool, invariants=check) -> list[Sequence]:
    """The requests' sequences run to the end, with async scheduling or without,
    `invariants` checked after every schedule and update; returns the sequences."""
    stepper = AsyncStepper(sched, runner, invariants) if async_ else None
    seqs = workload_seqs(reqs)
    run_workload(sched, runner, reqs, seqs, stepper,
                 lambda s, r: step(s, r, invariants))
    return seqs


def check_workload_outputs(sched: Scheduler, seqs: list[Sequence], reference) -> None:
    """After a workload: every block free; every sequence finished, its output a prefix
    of reference(prompt, sampling_params), all of it unless aborted or refused."""
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks - 1
    for s in seqs:
        assert s.is_finished()
        ref = reference(s.prompt_token_ids, s.sampling_params)
        assert s.output_token_ids == ref[: s.num_output_tokens]
        assert s.finish_reason in ("abort", "error") or s.num_output_tokens == len(ref)


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
