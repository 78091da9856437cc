"""BlockManager: the null block, ref counts, the free list as LRU order, eviction hooks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jprefix.core.block_manager import NULL_BLOCK, BlockManager


def test_null_block_is_never_allocated():
    bm = BlockManager(5, 4)
    blocks = bm.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4] and NULL_BLOCK not in blocks
    assert bm.num_free_blocks == 0 and not bm.can_allocate(1)
    with pytest.raises(RuntimeError):
        bm.allocate(1)
    bm.check_invariants()


def test_ref_counts_balance_and_double_free_raises():
    bm = BlockManager(4, 2)
    [b] = bm.allocate(1)
    bm.incref(b)
    bm.decref(b)
    assert bm.ref_count(b) == 1 and bm.num_used_blocks == 1
    bm.decref(b)
    assert bm.ref_count(b) == 0 and bm.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        bm.decref(b)
    bm.check_invariants()


def test_plain_free_blocks_are_reused_before_cached_ones_in_lru_order():
    bm = BlockManager(6, 2)
    evicted = []
    bm.set_evictor(evicted.append)
    a, b, c, d, e = bm.allocate(5)
    for blk in (a, b, c):
        bm.mark_cached(blk)
    bm.free([a, b, c])  # reverse: c, b, a go to the tail in that order
    bm.free([d])  # plain: head
    assert bm.num_evictable_blocks == 3
    assert bm.allocate(1) == [d] and evicted == []
    assert bm.allocate(2) == [c, b] and evicted == [c, b]
    assert bm.is_cached(a) and not bm.is_cached(b)
    bm.check_invariants()


def test_incref_of_a_cached_free_block_takes_it_off_the_free_list():
    bm = BlockManager(4, 2)
    [a] = bm.allocate(1)
    bm.mark_cached(a)
    bm.decref(a)
    assert bm.num_free_blocks == 3 and bm.num_evictable_blocks == 1
    bm.incref(a)  # a prefix hit
    assert bm.num_free_blocks == 2 and bm.num_evictable_blocks == 0
    bm.check_invariants()


def test_uncache_moves_a_free_block_to_the_head():
    bm = BlockManager(4, 2)
    a, b, c = bm.allocate(3)
    bm.mark_cached(c)
    bm.free([a, b, c])
    bm.uncache(c)
    assert bm.free_order()[0] == c and bm.num_evictable_blocks == 0
    bm.check_invariants()


def test_blocks_for_rounds_up():
    bm = BlockManager(4, 16)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("aifc"), st.integers(0, 50)), max_size=80))
def test_random_operations_keep_invariants(ops):
    bm = BlockManager(9, 4)
    held: list[int] = []
    for op, k in ops:
        if op == "a" and bm.can_allocate(1 + k % 3):
            held += bm.allocate(1 + k % 3)
        elif op == "i" and held:
            blk = held[k % len(held)]
            bm.incref(blk)
            held.append(blk)
        elif op == "f" and held:
            bm.decref(held.pop(k % len(held)))
        elif op == "c" and held:
            bm.mark_cached(held[k % len(held)])
        bm.check_invariants()
        assert bm.num_used_blocks == len(set(held))
    bm.free(held)
    bm.check_invariants()
    assert bm.num_free_blocks == 8
