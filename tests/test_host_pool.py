"""The prefix cache's host tier on the host side (no jax): HostPool's LRU, bound and exact
keys; the scheduler with the tier over random workloads against the fake model of
scheduler_cases, with a fake host pool that moves the simulated blocks as the worker
would (saves before the step, loads after it or, in-stream, before it): outputs equal
the reference, ref counts and both pools' invariants hold every step, no block is both
free and referenced."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_cases import FakeRunner, reference_output, seq

from jprefix.core.block_manager import BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.host_pool import HostPool
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import Scheduler
from jprefix.core.sequence import Sequence

# long shared histories (several blocks) that come back after others evicted them
BASES = [list(range(1, 21)), list(range(21, 37)), [7] * 6 + [8, 9, 10, 11, 12]]
requests = st.lists(st.tuples(
    st.integers(0, len(BASES) - 1),  # base
    st.lists(st.integers(1, 49), max_size=3),  # tail
    st.integers(1, 4),  # max_tokens
    st.booleans(),  # explicit prefix_pos (the base) or automatic
    st.sampled_from([None, None, "t"]),  # cache salt
    st.integers(0, 60),  # arrival step
    st.one_of(st.none(), st.none(), st.integers(0, 60)),  # abort step
), min_size=1, max_size=10)


def workload_seqs(reqs) -> list[Sequence]:
    out = []
    for i, (base, tail, max_tokens, explicit, salt, _, _) in enumerate(reqs):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out.append(Sequence(f"r{i}", BASES[base] + tail, sp, cache_salt=salt,
                            prefix_len=len(BASES[base]) if explicit else None))
    return out


class TieredRunner(FakeRunner):
    """FakeRunner plus a host pool of simulated blocks: saves copy a block's slots to a
    host slot before the step, loads copy them back after it (the engine's order)."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.host: dict[int, dict[int, tuple[int, int]]] = {}
        self.in_flight: list[list] = []  # [loads, steps until they land]

    def save(self, saves):
        for block, slot in saves:
            self.host[slot] = {off: self.slots[(block, off)] for off in range(self.block_size)}

    def load(self, loads):
        for slot, block in loads:
            for off, value in self.host[slot].items():
                self.slots[(block, off)] = value


def make(num_blocks, block_size, host_slots, **cfg):
    cfg.setdefault("eos_token_ids", {0})
    bm = BlockManager(num_blocks, block_size)
    pool = PrefixPool(bm, HostPool(host_slots, block_size))
    return Scheduler(SchedulerConfig(**cfg), bm, pool), TieredRunner(block_size)


def step(sched, runner, delay=0):
    """One step; a step's loads land `delay` steps later (at once when a step runs
    nothing: the engine then waits for the oldest copy), in order, as KVTier lands them;
    with in-stream loads (`loads_in_step`) before the step runs, which lands them."""
    out = sched.schedule()
    check(sched)
    saves, loads = sched.prefix_pool.take_moves()
    runner.save(saves)
    if loads and sched.prefix_pool.loads_land_in_step():
        runner.load(loads)
        sched.prefix_pool.land_oldest()
        loads = []
    finished = out.ignored + sched.update(out, runner.execute(out))
    if loads:
        runner.in_flight.append([loads, delay])
    wait = not out.scheduled
    while runner.in_flight and (runner.in_flight[0][1] <= 0 or wait):
        runner.load(runner.in_flight.pop(0)[0])
        sched.prefix_pool.land_oldest()
        wait = False
    for f in runner.in_flight:
        f[1] -= 1
    check(sched)
    return out, finished


def check(sched):
    bm, pool = sched.block_manager, sched.prefix_pool
    bm.check_invariants()
    pool.check_invariants()
    pool.host.check_invariants()
    holders = list(sched.running.values()) + [s for s in sched.waiting if s.block_table]
    owners = Counter(b for s in holders for b in s.block_table)
    owners.update(b for blocks in pool.moves.orphans.values() for b in blocks)  # in flight
    for block in range(1, bm.num_blocks):  # refs are exactly the live owners
        assert bm.ref_count(block) == owners[block], block
        assert (bm.ref_count(block) > 0) != (block in bm.free_order()), block
    loading = pool.moves.busy
    assert all(id(s) in loading or s.num_registered_blocks == len(s.block_table)
               or len(s.block_table) * sched.block_size >= s.num_computed_tokens
               for s in sched.waiting if s.block_table)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, block_size=st.sampled_from([2, 4]), num_blocks=st.integers(4, 16),
       budget=st.integers(1, 32), host_slots=st.integers(1, 24),
       max_num_seqs=st.integers(1, 4), delay=st.integers(-1, 3))
def test_random_workload_with_host_tier_matches_reference(reqs, block_size, num_blocks,
                                                          budget, host_slots, max_num_seqs,
                                                          delay):
    """delay -1: in-stream loads (a sequence runs in the step that copies its blocks)."""
    sched, runner = make(num_blocks, block_size, host_slots, max_num_batched_tokens=budget,
                         max_num_seqs=max_num_seqs)
    sched.prefix_pool.host.loads_in_step = delay < 0
    seqs = workload_seqs(reqs)
    for t in range(2000):
        for r, s in zip(reqs, seqs, strict=True):
            if r[5] == t:
                sched.add(s)
            if r[6] == t and r[5] < t:
                sched.abort(s.request_id)
        if t > max(r[5] for r in reqs) and not sched.has_unfinished():
            break
        step(sched, runner, delay)
    else:
        raise AssertionError("workload did not finish")
    bm = sched.block_manager
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert sched.prefix_pool.host.num_used_slots <= host_slots
    for s in seqs:
        assert s.is_finished()
        ref = reference_output(s.prompt_token_ids, s.sampling_params)
        assert s.output_token_ids == ref[: s.num_output_tokens]
        assert s.finish_reason in ("abort", "error") or s.num_output_tokens == len(ref)


def _run_all(sched, runner, seqs):
    for s in seqs:
        sched.add(s)
        while sched.has_unfinished():
            step(sched, runner)


def test_evicted_prefix_comes_back_from_the_host_and_counts_as_host_hits():
    sched, runner = make(num_blocks=9, block_size=4, host_slots=16,
                         max_num_batched_tokens=64)
    a, b = list(range(1, 17)), list(range(20, 36))  # 4 blocks each: the pool holds 8
    _run_all(sched, runner, [seq("a", a + [40], 2), seq("b", b + [41], 2)])
    pool = sched.prefix_pool
    assert pool.host.num_used_slots > 0  # b evicted a's blocks into the host tier
    again = seq("a2", a + [42], 3)
    _run_all(sched, runner, [again])
    assert again.num_cached_tokens == 16
    assert pool.num_host_hit_tokens >= 4
    assert again.output_token_ids == reference_output(again.prompt_token_ids,
                                                      again.sampling_params)


def _two_back_from_the_host(budget: int, in_step: bool):
    """A scheduler whose 4 histories (4 blocks each) went through a 12-block pool into
    the host tier, and two of them asked again (added, not yet scheduled)."""
    sched, runner = make(num_blocks=13, block_size=4, host_slots=32,
                         max_num_batched_tokens=budget)
    sched.prefix_pool.host.loads_in_step = in_step
    hist = [list(range(1 + 20 * i, 17 + 20 * i)) for i in range(4)]
    _run_all(sched, runner, [seq(f"h{i}", h + [90], 2) for i, h in enumerate(hist)])
    again = [seq("a", hist[0] + [91], 3), seq("b", hist[1] + [92], 3)]
    for s in again:
        sched.add(s)
    return sched, runner, again


def _finish_with_host_hits(sched, runner, again) -> None:
    """Runs to the end: both came back whole from the host and equal the reference."""
    while sched.has_unfinished():
        step(sched, runner)
    for s in again:
        assert s.num_cached_tokens == 16
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.sampling_params)
    assert sched.prefix_pool.num_host_hit_tokens == 32


@pytest.mark.parametrize("budget, together", [(64, 2), (16, 1)])
def test_waiting_sequences_start_their_host_copies_in_one_step(budget, together):
    """Two waiting histories on the host: both copies start in the first step when the
    token budget covers them (one per step when it covers one), neither runs until its
    copy is done, and the outputs equal the reference."""
    sched, runner, again = _two_back_from_the_host(budget, in_step=False)
    out, _ = step(sched, runner)
    started = [s for s in again if s.block_table and s.request_id not in sched.running]
    assert len(started) == together and not out.scheduled
    assert [s.request_id for s in sched.waiting][:together] == ["a", "b"][:together]
    _finish_with_host_hits(sched, runner, again)


def test_in_stream_copies_run_their_sequences_in_the_same_step():
    """With loads copied before the step (in-stream), two waiting histories on the host
    run in the step that copies them back: each row starts after its 16 host-hit tokens,
    none waits a step, the outputs equal the reference and every block is freed."""
    sched, runner, again = _two_back_from_the_host(64, in_step=True)
    out, _ = step(sched, runner)
    assert {(sc.seq.request_id, sc.start) for sc in out.scheduled} == {("a", 16), ("b", 16)}
    _finish_with_host_hits(sched, runner, again)
    bm = sched.block_manager
    assert all(bm.ref_count(x) == 0 for x in range(bm.num_blocks))


def test_copies_in_flight_hold_their_sequences_and_an_aborted_ones_blocks():
    """Copies that land two steps after they start (another sequence decoding meanwhile):
    their sequences are not scheduled before, an aborted one's blocks stay out of the free
    list until its copy lands, and everything balances at the end."""
    sched, runner = make(num_blocks=17, block_size=4, host_slots=32,
                         max_num_batched_tokens=64)
    hist = [list(range(1 + 20 * i, 17 + 20 * i)) for i in range(5)]  # 4 blocks each
    _run_all(sched, runner, [seq(f"h{i}", h + [90], 2) for i, h in enumerate(hist)])
    c = seq("c", [7, 8, 9], 8)
    a, b = seq("a", hist[0] + [91], 3), seq("b", hist[1] + [92], 3)
    sched.add(c)
    step(sched, runner)
    pool = sched.prefix_pool
    sched.add(a)
    sched.add(b)
    step(sched, runner, delay=2)
    assert pool.is_loading(a) and pool.is_loading(b)
    held = list(a.block_table)
    sched.abort("a")
    assert held and all(sched.block_manager.ref_count(x) == 1 for x in held)
    for _ in range(2):  # the copies land at the end of the second of these steps
        out, _ = step(sched, runner)
        assert {sc.seq.request_id for sc in out.scheduled} == {"c"}
    assert all(sched.block_manager.ref_count(x) == 0 for x in held)
    out, _ = step(sched, runner)
    assert "b" in {sc.seq.request_id for sc in out.scheduled}
    while sched.has_unfinished():
        step(sched, runner)
    assert b.num_cached_tokens == 16
    assert b.output_token_ids == reference_output(b.prompt_token_ids, b.sampling_params)
    bm = sched.block_manager
    assert all(bm.ref_count(x) == 0 for x in range(bm.num_blocks))


def test_cache_salt_isolation_across_tiers():
    sched, runner = make(num_blocks=9, block_size=4, host_slots=16,
                         max_num_batched_tokens=64)
    a, b = list(range(1, 17)), list(range(20, 36))
    _run_all(sched, runner, [seq("a", a + [40], 2), seq("b", b + [41], 2)])
    other = seq("x", a + [42], 2)
    other.cache_salt = "tenant-2"
    _run_all(sched, runner, [other])
    assert other.num_cached_tokens == 0
    assert sched.prefix_pool.num_host_hit_tokens == 0


def test_host_pool_lru_bound_and_references():
    pool = HostPool(2, 2)
    a, b, c = (1, 2), (3, 4), (5, 6)
    sa = pool.store(None, [a])
    sb = pool.store(None, [a, b])
    assert {sa, sb} == {0, 1} and pool.store(None, [a]) is None  # already there
    pool.incref(pool.match([1, 2, 3, 4], 0, 2))  # both referenced: nothing can be dropped
    assert pool.store(None, [c]) is None and pool.num_rejected_blocks == 1
    pool.decref([pool.find(None, [a]), pool.find(None, [a, b])])
    assert pool.store(None, [c]) is not None  # the LRU one (a, touched first) is dropped
    assert pool.num_used_slots == 2 and pool.num_dropped_blocks == 1
    assert pool.match([1, 2, 3, 4], 0, 2) == []  # a's slot is gone: b is unreachable
    pool.check_invariants()
    assert pool.find("s", [c]) is None  # salts are separate roots
    assert pool.clear() and pool.num_free_slots == 2
    with pytest.raises(ValueError, match="num_slots"):
        HostPool(0, 2)


def test_delete_prefix_and_reset_act_on_the_host_tier():
    sched, runner = make(num_blocks=9, block_size=4, host_slots=16,
                         max_num_batched_tokens=64)
    a, b = list(range(1, 17)), list(range(20, 36))
    _run_all(sched, runner, [seq("a", a + [40], 2), seq("b", b + [41], 2)])
    pool = sched.prefix_pool
    def a_on_host():
        return [p for _, p, _ in pool.host.entries() if p[0] == tuple(a[:4])]

    assert a_on_host()
    prefix = pool.add_or_get_prefix(a)
    pool.delete_prefix(prefix.prefix_hash)
    assert not a_on_host() and not pool.trie.match(a, 4)
    pool.host.check_invariants()
    assert pool.reset() and pool.host.num_used_slots == 0


def test_pinned_prefix_keeps_its_host_blocks():
    pool = PrefixPool(BlockManager(4, 2), HostPool(2, 2))
    host = pool.host
    host.store(None, [(1, 2)])
    host.store(None, [(1, 2), (3, 4)])
    prefix = pool.add_or_get_prefix([1, 2, 3, 4], pin=True)
    assert len(prefix.pinned_host) == 2
    assert host.store(None, [(9, 9)]) is None  # every slot is held by the pin
    pool.unpin(prefix.prefix_hash)
    assert host.store(None, [(9, 9)]) is not None
