"""PrefixTrie and PrefixPool: exact block matching, salts, multi-level sharing, LRU
eviction leaves first, delete_prefix, pinning and reset."""

import pytest

from jprefix.core.block_manager import BlockManager
from jprefix.core.prefix_cache import PrefixPool, prefix_hash_of, root_hash
from jprefix.core.sequence import Sequence

B = 4
POLICY = list(range(100, 108))  # 2 blocks
DEPT1 = POLICY + list(range(200, 208))  # +2 blocks
DEPT2 = POLICY + list(range(300, 308))  # +2 blocks
CASE = DEPT1 + list(range(400, 404))  # +1 block


def make(num_blocks: int = 32) -> PrefixPool:
    return PrefixPool(BlockManager(num_blocks, B))


def compute(pool: PrefixPool, tokens, salt=None, share=True) -> Sequence:
    """What the scheduler does for a request computing `tokens`: match, allocate, insert."""
    bm = pool.block_manager
    seq = Sequence(f"r{len(tokens)}", tokens, None, cache_salt=salt)
    max_blocks = len(tokens) // B if share else 0
    seq.block_table = pool.acquire(tokens, max_blocks, salt)
    seq.num_registered_blocks = len(seq.block_table)
    seq.block_table += bm.allocate(bm.blocks_for(len(tokens)) - len(seq.block_table))
    pool.register_blocks(seq, len(tokens), len(tokens) // B)
    check(pool)
    return seq


def release(pool: PrefixPool, *seqs: Sequence) -> None:
    for seq in seqs:
        pool.block_manager.free(seq.block_table)
    check(pool)


def check(pool: PrefixPool) -> None:
    pool.block_manager.check_invariants()
    pool.check_invariants()


def cached(pool: PrefixPool, tokens, salt=None) -> int:
    return len(pool.trie.match(tokens, len(tokens) // B, salt))


def test_match_is_exact_per_whole_block():
    pool = make()
    release(pool, compute(pool, list(range(14))))  # 3 full blocks + 2 tokens
    assert cached(pool, list(range(14))) == 3
    assert cached(pool, list(range(12))) == 3
    assert cached(pool, [0, 1, 2, 3, 4, 99, 6, 7, 8]) == 1  # differs inside block 1
    assert len(pool.trie.match(list(range(12)), 2)) == 2  # max_blocks caps


def test_salts_isolate_tenants():
    pool = make()
    a = compute(pool, POLICY, salt="a")
    assert cached(pool, POLICY, None) == 0 and cached(pool, POLICY, "b") == 0
    b = compute(pool, POLICY, salt="b")
    assert not set(a.block_table) & set(b.block_table)
    hashes = {pool.trie.node_of(s.block_table[-1]).prefix_hash for s in (a, b)}
    assert len(hashes) == 2
    release(pool, a, b)


def test_multi_level_prefixes_share_parent_nodes():
    pool = make()
    seqs = [compute(pool, t) for t in (POLICY, DEPT1, DEPT2, CASE)]
    assert len(pool.trie) == 2 + 2 + 2 + 1  # not 2 + 4 + 4 + 5
    assert pool.block_manager.num_used_blocks == 7
    assert seqs[3].block_table[:4] == seqs[1].block_table
    release(pool, *seqs)
    assert pool.block_manager.num_evictable_blocks == 7


def test_prefix_hash_is_chained_over_blocks_and_salt():
    pool = make()
    seq = compute(pool, DEPT1)
    node = pool.trie.node_of(seq.block_table[-1])
    assert node.prefix_hash == prefix_hash_of(DEPT1, B) == prefix_hash_of(DEPT1 + [1, 2], B)
    assert prefix_hash_of(DEPT1, B, "s") != node.prefix_hash
    assert prefix_hash_of([], B) == root_hash(None)
    assert pool.trie.find(node.prefix_hash) is node
    release(pool, seq)


def test_eviction_takes_leaves_before_parents():
    pool = make(num_blocks=1 + 6)
    x, y = compute(pool, DEPT1), compute(pool, DEPT2)  # policy shared: 6 blocks
    release(pool, x, y)
    # LRU order: dept1's tail (released first, deepest first), dept2's tail, then policy.
    for dept1_left, dept2_left in [(3, 4), (2, 4), (2, 3), (2, 2), (1, 1), (0, 0)]:
        pool.block_manager.allocate(1)
        check(pool)
        assert (cached(pool, DEPT1), cached(pool, DEPT2)) == (dept1_left, dept2_left)
    assert len(pool.trie) == 0


def test_blocks_in_use_are_never_evicted():
    pool = make(num_blocks=1 + 4)
    seq = compute(pool, DEPT1)
    assert not pool.block_manager.can_allocate(1)
    release(pool, seq)
    assert pool.block_manager.can_allocate(4)


def test_a_duplicate_block_stays_private():
    pool = make()
    first = compute(pool, POLICY)
    second = compute(pool, POLICY, share=False)  # computed on its own, same tokens
    assert len(pool.trie) == 2 and second.num_registered_blocks == 0
    assert not any(pool.block_manager.is_cached(b) for b in second.block_table)
    release(pool, first, second)


def test_delete_prefix_frees_exactly_its_unshared_blocks():
    pool = make()
    hashes = [pool.add_or_get_prefix(t).prefix_hash for t in (DEPT1, DEPT2)]
    release(pool, compute(pool, DEPT1), compute(pool, DEPT2))
    bm = pool.block_manager
    free_before = bm.num_free_blocks - bm.num_evictable_blocks
    assert pool.delete_prefix(hashes[0]) == 2  # dept1's own blocks; policy is dept2's too
    check(pool)
    assert bm.num_free_blocks - bm.num_evictable_blocks == free_before + 2
    assert (cached(pool, DEPT1), cached(pool, DEPT2)) == (2, 4)
    assert pool.delete_prefix(hashes[1]) == 4
    assert len(pool.trie) == 0 and bm.num_evictable_blocks == 0
    with pytest.raises(ValueError, match=str(hashes[1])):
        pool.delete_prefix(hashes[1])


def test_delete_prefix_keeps_a_registered_descendant_and_drops_unregistered_ones():
    pool = make()
    parent = pool.add_or_get_prefix(POLICY)
    pool.add_or_get_prefix(DEPT1)
    release(pool, compute(pool, DEPT1), compute(pool, DEPT2))
    assert pool.delete_prefix(parent.hash) == 0  # every policy block is dept1's too
    assert len(pool.trie) == 6
    running = compute(pool, DEPT2)  # automatic mode: cached but never registered
    node = pool.trie.node_of(running.block_table[-1])
    assert pool.delete_prefix(node.prefix_hash) == 0  # in use: detached, not freed yet
    assert (cached(pool, DEPT1), cached(pool, DEPT2)) == (4, 2)
    bm, evictable = pool.block_manager, pool.block_manager.num_evictable_blocks
    free_before = bm.num_free_blocks
    release(pool, running)
    assert bm.num_free_blocks == free_before + 4
    assert bm.num_evictable_blocks == evictable + 2  # policy is cached, dept2's tail is not


def test_delete_prefix_detaches_blocks_in_use_and_frees_them_on_release():
    pool = make()
    h = pool.add_or_get_prefix(CASE).hash
    running = compute(pool, CASE)
    assert pool.delete_prefix(h) == 0
    assert len(pool.trie) == 0 and cached(pool, CASE) == 0
    release(pool, running)
    bm = pool.block_manager
    assert bm.num_evictable_blocks == 0 and bm.num_free_blocks == bm.num_blocks - 1


def test_pinned_prefix_survives_memory_pressure_until_deleted():
    pool = make(num_blocks=1 + 6)
    release(pool, compute(pool, DEPT1))
    prefix = pool.add_or_get_prefix(DEPT1, pin=True)
    assert prefix.pinned and pool.cached_blocks(prefix.hash) == prefix.pinned_blocks
    bm = pool.block_manager
    assert bm.num_free_blocks == 2 and bm.allocate(2) and not bm.can_allocate(1)
    assert cached(pool, DEPT1) == 4
    assert pool.delete_prefix(prefix.hash) == 4
    check(pool)


def test_add_or_get_prefix_rounds_down_and_dedups():
    pool = make()
    p = pool.add_or_get_prefix(DEPT1 + [7, 7], prefix_len=10)
    assert p.length == 8 and p.token_ids == tuple(POLICY)
    assert pool.add_or_get_prefix(POLICY) is p
    assert pool.add_or_get_prefix(POLICY, salt="t") is not p
    with pytest.raises(ValueError, match="prefix_len 99"):
        pool.add_or_get_prefix(POLICY, prefix_len=99)


def test_reset_refuses_while_in_use_then_drops_everything():
    pool = make()
    seq = compute(pool, DEPT1)
    assert pool.reset() is False and len(pool.trie) == 4
    release(pool, seq)
    pinned = pool.add_or_get_prefix(POLICY, pin=True)
    assert pool.reset() is False
    pool.unpin(pinned.hash)
    assert pool.reset() is True
    check(pool)
    assert len(pool.trie) == 0 and pool.block_manager.num_evictable_blocks == 0
    assert pool.get_prefix(pinned.hash) is pinned  # registration survives a reset


def test_stats_count_queried_and_hit_tokens():
    pool = make()
    pool.record_query(20, 0)
    pool.record_query(20, 16)
    stats = pool.stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens, stats.hit_rate) == (40, 16, 0.4)
    seq = compute(pool, DEPT1)
    pool.num_host_hit_tokens = 8
    pool.reset_counters()  # (after a warm-up: the counters restart, the cache stays)
    stats = pool.stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens, stats.num_host_hit_tokens) == (
        0, 0, 0) and len(pool.trie) == 4
    release(pool, seq)
    check(pool)
