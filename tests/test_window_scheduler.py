"""The scheduler with a sliding window on every layer: a sequence frees the blocks that
fell out of its window as it advances, and random workloads (prefix caching on and off,
explicit and automatic prefixes, chunked prefill, preemption, aborts, sync and async)
finish with exactly the outputs of a fake windowed model, reading back only the keys in
each query's window, with ref counts balanced at every step.
"""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_cases import (
    EOS,
    WORKLOAD,
    FakeRunner,
    V,
    check_workload_outputs,
    reference_output,
    run_random_workload,
)
from scheduler_cases import step as scheduler_step

from jprefix.core.block_manager import NULL_BLOCK, BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import Scheduler
from jprefix.core.sequence import Sequence


def window_token(context: list[int], window: int) -> int:
    """The fake windowed model: a function of the last `window` tokens and the position."""
    return (sum(context[-window:]) * 31 + len(context) * 7) % V


def window_output(prompt: list[int], sp: SamplingParams, window: int) -> list[int]:
    return reference_output(prompt, sp, lambda context: window_token(context, window))


class WindowRunner(FakeRunner):
    """Writes each scheduled token into its slot, then reads back every key that any row
    of the chunk sees (positions start - window + 1 .. end - 1) through the block table:
    those must be live, non-null blocks holding the right tokens."""

    def __init__(self, block_size: int, window: int):
        super().__init__(block_size)
        self.window = window

    def execute(self, out, pending=None) -> list[int]:
        def tokens(seq: Sequence, end: int) -> list[int]:
            ids = seq.all_token_ids[:end]
            return ids if len(ids) == end else ids + [pending[seq.request_id]]

        for s in out.scheduled:
            ids = tokens(s.seq, s.start + s.num_new_tokens)
            for pos in range(s.start, s.start + s.num_new_tokens):
                self.slots[self._slot(s.seq, pos)] = (pos, ids[pos])
        sampled = []
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            ids = tokens(s.seq, end)
            first = max(0, s.start - self.window + 1)
            assert all(b != NULL_BLOCK for b in s.seq.block_table[first // self.block_size:])
            seen = [self.slots[self._slot(s.seq, p)] for p in range(first, end)]
            assert seen == [(p, ids[p]) for p in range(first, end)], s.seq
            sampled.append(window_token(ids, self.window) if s.sample else -1)
        return sampled


def make(num_blocks, block_size, window, **cfg):
    cfg.setdefault("eos_token_ids", {EOS})
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(**cfg), bm, PrefixPool(bm), sliding_window=window)
    return sched, WindowRunner(block_size, window)


def check(sched: Scheduler) -> None:
    """Ref counts are exactly the running sequences' live blocks; the freed entries of a
    table are a leading run of null blocks."""
    bm, pool = sched.block_manager, sched.prefix_pool
    bm.check_invariants()
    pool.check_invariants(prefix_closed=False)
    owners = Counter(x for s in sched.running.values() for x in s.block_table if x)
    for block in range(1, bm.num_blocks):
        assert bm.ref_count(block) == owners[block], block
    for s in sched.running.values():
        nulls = s.block_table.count(NULL_BLOCK)
        assert s.block_table[:nulls] == [NULL_BLOCK] * nulls, s
    assert all(not s.block_table for s in sched.waiting)


def step(sched, runner):
    return scheduler_step(sched, runner, check)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**WORKLOAD, window=st.integers(1, 9), chunked=st.booleans())
def test_random_window_workload_frees_blocks_and_matches_the_model(
        async_, reqs, block_size, num_blocks, budget, caching, window, chunked):
    sched, runner = make(num_blocks, block_size, window, max_num_batched_tokens=budget,
                         max_num_seqs=4, enable_chunked_prefill=chunked,
                         enable_prefix_caching=caching)
    seqs = run_random_workload(sched, runner, reqs, async_, check)
    check_workload_outputs(sched, seqs, lambda p, sp: window_output(p, sp, window))


def _seq(rid, prompt, max_tokens):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(rid, prompt, sp)


def test_decoding_frees_each_block_once_it_leaves_the_window():
    sched, runner = make(32, 4, 6, max_num_batched_tokens=64)
    s = _seq("a", list(range(1, 11)), 20)  # 10 prompt tokens, blocks of 4, window 6
    sched.add(s)
    held = []
    while sched.has_unfinished():
        out = sched.schedule()
        check(sched)
        (row,) = out.scheduled  # its first query sees keys start - 5 .. start: the blocks
        dead = max(0, row.start - 5) // 4  # wholly before start - 5 are freed, no other
        assert s.block_table[:dead] == [NULL_BLOCK] * dead
        assert NULL_BLOCK not in s.block_table[dead:]
        held.append(sched.block_manager.num_used_blocks)
        sched.update(out, runner.execute(out))
    assert max(held) <= 3  # a 6-key window spans at most 3 blocks of 4 (+ nothing else)
    assert len(held) == 20 and held[-1] == 3  # 29 positions: 8 blocks, never 8 held
    assert s.output_token_ids == window_output(s.prompt_token_ids, s.sampling_params, 6)


def test_cached_prefix_longer_than_the_window_is_hit_and_its_old_blocks_released():
    sched, runner = make(32, 4, 5, max_num_batched_tokens=64)
    prompt = list(range(1, 22))  # 21 tokens: 5 full blocks, window 5
    first = _seq("a", prompt + [30], 3)
    sched.add(first)
    while sched.has_unfinished():
        step(sched, runner)
    second = _seq("b", prompt + [31, 32], 3)
    sched.add(second)
    step(sched, runner)
    assert second.num_cached_tokens == 20  # all 5 prompt blocks from the cache
    # the hit ends at 20, whose query sees keys 16-20: blocks 0-3 are released at once
    assert second.block_table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in second.block_table[4:]
    while sched.has_unfinished():
        step(sched, runner)
    assert second.output_token_ids == window_output(second.prompt_token_ids,
                                                    second.sampling_params, 5)
