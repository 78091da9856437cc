"""The hybrid KV cache (a full group and window groups, one pool of pages): the layer
grouping; window-group pages freed as sequences advance; prefix hits longer than the
window and hits cut short where a needed window page was evicted; and random workloads
(caching on/off, explicit and automatic prefixes, chunked prefill, preemption, aborts,
sync and async) finishing with exactly the outputs of a fake hybrid model that reads
every key of its full groups and the window's keys of its window groups back through
each group's table, with ref counts balanced and no page in two groups at every step.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_cases import (
    EOS,
    WORKLOAD,
    V,
    check_workload_outputs,
    reference_output,
    run_random_workload,
)
from scheduler_cases import step as scheduler_step

from jprefix.core.block_manager import NULL_BLOCK, BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.hybrid_cache import HybridPrefixPool
from jprefix.core.hybrid_scheduler import HybridScheduler
from jprefix.core.kv_groups import kv_cache_groups
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.sequence import Sequence


def gemma_windows(num_layers: int, window: int, period: int = 6) -> list:
    return [None if i % period == period - 1 else window for i in range(num_layers)]


def test_groups_split_layers_by_kind_in_pages_of_equal_layers():
    g12 = kv_cache_groups(gemma_windows(48, 1024))  # gemma-3-12b
    assert g12.page_layers == 8 and g12.windows == (None,) + (1024,) * 5
    assert [g12.layer_group[i] for i in (5, 11, 47)] == [0, 0, 0]
    assert g12.layer_slot[47] == 7 and g12.layer_group[0] == 1 and g12.layer_group[46] == 5
    g1 = kv_cache_groups(gemma_windows(26, 512))  # gemma-3-1b: 4 full, 22 window
    assert g1.page_layers == 2 and g1.windows == (None, None) + (512,) * 11
    places = {(g1.layer_group[i], g1.layer_slot[i]) for i in range(26)}
    assert len(places) == 26  # every layer has its own (group, slot)
    assert kv_cache_groups([None] * 4) is None and kv_cache_groups([8] * 4) is None
    with pytest.raises(ValueError, match="0"):
        kv_cache_groups([None, 0])


def hybrid_token(context: list[int], window: int) -> int:
    """The fake hybrid model: its full layers see the whole context, its window layers
    the last `window` tokens."""
    return (sum(context) * 31 + sum(context[-window:]) * 17 + len(context) * 7) % V


def hybrid_output(prompt: list[int], sp: SamplingParams, window: int) -> list[int]:
    return reference_output(prompt, sp, lambda context: hybrid_token(context, window))


class HybridRunner:
    """Writes each scheduled token into its page of every group, then reads back each
    group's keys that the chunk sees (full: all; window: start - w + 1 ..) through that
    group's table: live, non-null pages holding the right tokens."""

    def __init__(self, block_size: int, groups):
        self.B, self.groups = block_size, groups
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}  # (page, off) -> (pos, tok)

    def table(self, seq: Sequence, g: int) -> list[int]:
        return seq.block_table if g == 0 else seq.group_tables[g - 1]

    def execute(self, out, pending=None) -> list[int]:
        def tokens(seq, end):
            ids = seq.all_token_ids[:end]
            return ids if len(ids) == end else ids + [pending[seq.request_id]]

        G = self.groups.num_groups
        for s in out.scheduled:
            ids = tokens(s.seq, s.start + s.num_new_tokens)
            for g in range(G):
                for pos in range(s.start, s.start + s.num_new_tokens):
                    page = self.table(s.seq, g)[pos // self.B]
                    assert page != NULL_BLOCK
                    self.slots[page, pos % self.B] = (pos, ids[pos])
        sampled = []
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            ids = tokens(s.seq, end)
            for g in range(G):
                first = self.groups.first_needed_block(g, s.start, 1)  # (first key)
                table = self.table(s.seq, g)
                seen = [self.slots.get((table[p // self.B], p % self.B)) for p in range(first, end)]
                assert seen == [(p, ids[p]) for p in range(first, end)], (g, s.seq)
            sampled.append(hybrid_token(ids, self.groups.min_window) if s.sample else -1)
        return sampled


def make(num_blocks, block_size, window, num_layers=6, **cfg):
    cfg.setdefault("eos_token_ids", {EOS})
    groups = kv_cache_groups(gemma_windows(num_layers, window, period=3))  # 1 full : 2
    bm = BlockManager(num_blocks, block_size)
    sched = HybridScheduler(SchedulerConfig(**cfg), bm, HybridPrefixPool(bm, groups))
    return sched, HybridRunner(block_size, groups)


def check(sched: HybridScheduler) -> None:
    """Ref counts are exactly the running sequences' live pages; a page serves one group;
    full tables have no null entry, window tables only a leading run."""
    bm, pool, groups = sched.block_manager, sched.prefix_pool, sched.groups
    bm.check_invariants()
    pool.check_invariants()
    owners, group_of = Counter(), dict(pool.owner.items())
    for s in sched.running.values():
        tables = [s.block_table, *s.group_tables]
        assert len(tables) == groups.num_groups and len({len(t) for t in tables}) == 1, s
        for g, table in enumerate(tables):
            nulls = table.count(NULL_BLOCK)
            assert table[:nulls] == [NULL_BLOCK] * nulls and (nulls == 0 or g > 0), s
            for page in table[nulls:]:
                owners[page] += 1
                assert group_of.setdefault(page, (None, g))[1] == g, (page, g)
    for page in range(1, bm.num_blocks):
        assert bm.ref_count(page) == owners[page], page
    assert all(not s.block_table and not s.group_tables for s in sched.waiting)


def step(sched, runner):
    return scheduler_step(sched, runner, check)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**WORKLOAD, window=st.integers(1, 9), chunked=st.booleans())
def test_random_hybrid_workload_frees_window_pages_and_matches_the_model(
        async_, reqs, block_size, num_blocks, budget, caching, window, chunked):
    sched, runner = make(num_blocks * 3, block_size, window, max_num_batched_tokens=budget,
                         max_num_seqs=4, enable_chunked_prefill=chunked,
                         enable_prefix_caching=caching)
    seqs = run_random_workload(sched, runner, reqs, async_, check)
    check_workload_outputs(sched, seqs, lambda p, sp: hybrid_output(p, sp, window))


def _seq(rid, prompt, max_tokens):
    return Sequence(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))


def test_decoding_frees_window_pages_once_they_leave_the_window():
    sched, runner = make(64, 4, 6, max_num_batched_tokens=64)
    s = _seq("a", list(range(1, 11)), 20)  # 10 prompt tokens, blocks of 4, window 6
    sched.add(s)
    held = []
    while sched.has_unfinished():
        out = sched.schedule()
        check(sched)
        (row,) = out.scheduled
        dead = max(0, row.start - 5) // 4
        for table in s.group_tables:  # the two window groups: freed exactly up to dead
            assert table[:dead] == [NULL_BLOCK] * dead and NULL_BLOCK not in table[dead:]
        assert NULL_BLOCK not in s.block_table
        held.append(sched.block_manager.num_used_blocks)
        sched.update(out, runner.execute(out))
    # 29 positions: 8 blocks; the full group holds all 8, each window group at most 3
    assert held[-1] == 8 + 2 * 3 and max(held) <= 8 + 2 * 3
    assert s.output_token_ids == hybrid_output(s.prompt_token_ids, s.sampling_params, 6)


def _finish_first(prompt, num_blocks=64):
    sched, runner = make(num_blocks, 4, 5, max_num_batched_tokens=64)
    sched.add(_seq("a", prompt + [30], 3))
    while sched.has_unfinished():
        step(sched, runner)
    return sched, runner


def _run_second(sched, runner, prompt):
    second = _seq("b", prompt + [31, 32], 3)
    sched.add(second)
    step(sched, runner)
    hit = second.num_cached_tokens
    tables = [list(t) for t in second.group_tables]
    while sched.has_unfinished():
        step(sched, runner)
    assert second.output_token_ids == hybrid_output(second.prompt_token_ids,
                                                    second.sampling_params, 5)
    return hit, tables


def test_cached_prefix_longer_than_the_window_is_hit_with_only_the_window_pages_held():
    prompt = list(range(1, 22))  # 21 tokens: 5 full blocks, window 5
    sched, runner = _finish_first(prompt)
    hit, tables = _run_second(sched, runner, prompt)
    assert hit == 20  # all 5 prompt blocks; the query at 20 sees keys 16-20: block 4 on
    for table in tables:
        assert table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in table[4:]


def evict_only(bm: BlockManager, pages: list[int]) -> None:
    """Makes the block manager reuse exactly `pages` of its cached free pages (the others
    are held meanwhile, as a pin would)."""
    keep = [p for p in bm.free_order() if bm.is_cached(p) and p not in pages]
    for page in keep:
        bm.incref(page)
    order = bm.free_order()
    bm.free(bm.allocate(max(order.index(p) for p in pages) + 1))
    bm.free(keep)


def test_old_window_pages_are_not_needed_but_a_needed_one_cuts_the_hit():
    prompt = list(range(1, 22))
    sched, runner = _finish_first(prompt)
    pool, bm = sched.prefix_pool, sched.block_manager
    parts = [pool.parts[n.block] for n in pool.trie.match(prompt, 5, None)]
    evict_only(bm, parts[3][1:])  # block 3's window pages
    assert parts[3][1:] == [NULL_BLOCK] * 2 and all(p[1] for p in parts[:3] + parts[4:])
    pool.check_invariants()
    hit, _ = _run_second(sched, runner, prompt)
    assert hit == 20  # the query at 20 reads block 4 only: the hit is whole

    parts = [pool.parts[n.block] for n in pool.trie.match(prompt, 5, None)]
    evict_only(bm, parts[4][1:])  # block 4's window pages, needed by the query at 20
    assert parts[4][1:] == [NULL_BLOCK] * 2 and all(p[1] for p in parts[:3])
    pool.check_invariants()
    third = _seq("c", prompt + [33, 34], 3)
    sched.add(third)
    while sched.has_unfinished():
        step(sched, runner)
    # a hit of 20 needs block 4's window pages, one of 16 block 3's (both gone now), one
    # of 12 only block 2's: the longest prefix valid for every group
    assert third.num_cached_tokens == 12
    assert third.output_token_ids == hybrid_output(third.prompt_token_ids,
                                                   third.sampling_params, 5)


def test_preemption_releases_every_group_and_recomputes_exactly():
    sched, runner = make(3 * 6 + 1, 4, 5, max_num_batched_tokens=64)  # 6 blocks' pages
    seqs = [_seq(f"r{i}", [i + 1] * 9, 8) for i in range(3)]
    for s in seqs:
        sched.add(s)
    preempted = 0
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        preempted += len(out.preempted)
    assert preempted > 0
    for s in seqs:
        assert s.output_token_ids == hybrid_output(s.prompt_token_ids, s.sampling_params, 5)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks - 1
