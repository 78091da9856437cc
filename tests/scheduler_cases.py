"""The scheduler tests' fake model and its runner, the drivers (sync steps and the async
stepper, each checking the invariants after every schedule and update) and the random
workloads (hypothesis requests with arrivals, aborts, salts and nested prefixes): shared
by test_scheduler and the window, hybrid, speculation, policy and host-pool scheduler
tests. The fake runner writes each scheduled token into its slot and reads every context
back through the block table, so a wrong shared block or slot shows up as a wrong token."""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from jprefix.core.block_manager import BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import Scheduler
from jprefix.core.sequence import Sequence

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
