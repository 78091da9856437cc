"""The data-parallel routing policy (jprefix.core.routing), pure Python: prefix affinity
from the replicas' tries and routed requests, least load on ties and misses, the
imbalance bound, cache_salt, round robin, and spec parsing."""

import pytest

from jprefix.core.block_manager import BlockManager
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.routing import Router, TrieView, parse_routing_policy, request_hashes
from jprefix.core.sequence import Sequence

B = 4


def tokens(group: int, n_blocks: int, own: int = 0) -> list[int]:
    """n_blocks whole blocks of group's prefix, then `own` tokens of its own."""
    return [1000 * (group + 1) + i for i in range(n_blocks * B)] + [7] * own


def cache_in(pool: PrefixPool, ids: list[int], salt: str | None = None) -> None:
    """Computes `ids` on a replica: its whole blocks become trie nodes (then released)."""
    seq = Sequence("warm", ids, None, cache_salt=salt)
    seq.block_table = pool.block_manager.allocate(len(ids) // B)
    pool.register_blocks(seq, len(ids), len(ids) // B)
    pool.block_manager.free(seq.block_table)


def pools(n: int) -> list[PrefixPool]:
    return [PrefixPool(BlockManager(64, B)) for _ in range(n)]


def router(ps: list[PrefixPool], policy: str = "prefix") -> Router:
    return Router([TrieView(p.trie) for p in ps], B, policy)


class _View:  # a remote replica's hash set, as the router sees it
    def __init__(self, hashes=()):
        self.hashes = set(hashes)

    def __contains__(self, h):
        return h in self.hashes


def test_request_hashes_are_the_trie_nodes_hashes():
    (pool,) = pools(1)
    ids = tokens(0, 3, own=2)
    cache_in(pool, ids, salt="t")
    want = [n.prefix_hash for n in pool.trie.match(ids, 3, "t")]
    assert request_hashes(ids, 3, B, "t") == want and len(want) == 3
    assert request_hashes(ids, 9, B, "t") == want  # only whole blocks
    assert request_hashes(ids, 3, B, None)[0] != want[0]  # the salt is in every hash


def test_longest_cached_match_wins_over_load():
    ps = [_View(), _View(), _View()]
    r = Router(ps, B)
    h = request_hashes(tokens(0, 4), 4, B, None)
    ps[1].hashes |= set(h[:2])
    ps[2].hashes |= set(h[:3])
    # replica 2 holds 3 blocks, more loaded than 1 (2 blocks) and 0 (none): still chosen
    assert r.choose(h, [0, 50, 100]) == (2, 3)
    assert r.matched_blocks(h) == [0, 2, 3]
    ps[0].hashes.add(h[1])  # a block without its parent is no match
    assert r.matched_blocks(h)[0] == 0


def test_ties_and_misses_go_to_the_least_loaded_then_lowest_index():
    ps = pools(3)
    r = router(ps)
    h = request_hashes(tokens(0, 2), 2, B, None)
    assert r.choose(h, [30, 10, 20])[0] == 1
    assert r.choose(h, [10, 10, 10])[0] == 0
    for p in ps[1:]:
        cache_in(p, tokens(0, 2))
    assert r.choose(h, [0, 20, 10]) == (2, 2)  # equal matches: the less loaded of them


def test_requests_of_one_prefix_meet_before_any_is_cached():
    """Requests routed together (nothing in any trie yet) follow the first of their
    prefix; groups go to the least loaded replica."""
    r = router(pools(2))
    loads = [0, 0]
    placed = {}
    for i in range(12):
        g = (i // 4 + i) % 4  # 4 groups, rotated every round
        ids = tokens(g, 3, own=1)
        rep = r.route(f"r{i}", ids, 3, None, loads)
        loads[rep] += len(ids)
        placed.setdefault(g, set()).add(rep)
    assert all(len(v) == 1 for v in placed.values()), placed
    assert {next(iter(v)) for v in placed.values()} == {0, 1}  # two groups per replica
    assert [c.affinity for c in r.counters] == [4, 4]  # all but each group's first
    assert sum(c.requests for c in r.counters) == 12


def test_finish_forgets_the_routed_blocks_and_load():
    r = router(pools(2))
    ids = tokens(0, 2, own=1)
    assert r.route("a", ids, 2, None, [0, 0]) == 0
    assert r.matched_blocks(request_hashes(ids, 2, B, None)) == [2, 0]
    assert r.counters[0].prompt_tokens == len(ids) and r.counters[0].in_flight == 1
    with pytest.raises(ValueError, match="already in flight"):
        r.route("a", ids, 2, None, [0, 0])
    assert r.finish("a") == 0 and r.finish("a") is None
    assert r.matched_blocks(request_hashes(ids, 2, B, None)) == [0, 0]
    assert r.counters[0].prompt_tokens == 0 and r.counters[0].in_flight == 0


def test_salts_never_meet():
    ps = pools(2)
    cache_in(ps[1], tokens(0, 3), salt="tenant-a")
    r = router(ps)
    ids = tokens(0, 3, own=1)
    assert r.choose(request_hashes(ids, 3, B, "tenant-a"), [0, 5]) == (1, 3)
    assert r.choose(request_hashes(ids, 3, B, "tenant-b"), [0, 5]) == (0, 0)
    assert r.choose(request_hashes(ids, 3, B, None), [0, 5]) == (0, 0)


def test_a_replica_over_its_share_gets_no_affinity_and_the_hot_prefix_is_copied():
    ps = pools(2)
    cache_in(ps[0], tokens(0, 3))
    r = router(ps, "prefix:balance_rel=0.25,balance_abs=10")
    h = request_hashes(tokens(0, 3, own=1), 3, B, None)
    # bound: mean * 1.25 + 10; replica 0 at 70 of 100 (bound 72.5): still its share
    assert r.over_share([70, 30]) == [False, False] and r.choose(h, [70, 30])[0] == 0
    assert r.over_share([80, 20]) == [True, False] and r.choose(h, [80, 20]) == (1, 0)
    # routed there, replica 1 holds the prefix too: both match, the less loaded wins
    r.route("copy", tokens(0, 3, own=1), 3, None, [80, 20])
    assert r.matched_blocks(h) == [3, 3]
    assert r.choose(h, [60, 40])[0] == 1 and r.choose(h, [40, 60])[0] == 0


def test_a_hot_prefix_alone_spreads_over_both_replicas():
    r = router(pools(2), "prefix:balance_abs=0")
    loads = [0, 0]
    for i in range(10):
        ids = tokens(0, 4, own=2)
        loads[r.route(f"hot{i}", ids, 4, None, loads)] += len(ids)
    assert loads == [90, 90] and [c.requests for c in r.counters] == [5, 5]
    unbounded = router(pools(2), "prefix:balance_rel=100,balance_abs=0")
    loads = [0, 0]
    for i in range(10):
        loads[unbounded.route(f"hot{i}", tokens(0, 4, own=2), 4, None, loads)] += 18
    assert loads == [180, 0]  # affinity alone would starve replica 1


def test_round_robin_ignores_the_cache():
    ps = pools(2)
    cache_in(ps[0], tokens(0, 2))
    r = router(ps, "round_robin")
    got = [r.route(f"r{i}", tokens(0, 2, own=1), 2, None, [0, 0]) for i in range(5)]
    assert got == [0, 1, 0, 1, 0]
    # matched where it landed: replica 0 had it cached, replica 1 from its second on
    assert [c.affinity for c in r.counters] == [3, 1]


def test_no_shareable_blocks_is_least_loaded():
    r = router(pools(2))
    assert r.route("a", tokens(0, 2), 0, None, [5, 3]) == 1


@pytest.mark.parametrize("spec, message", [
    ("lpm", "routing policy 'lpm' is not one of"),
    ("prefix:balance=1", "expected key=value"),
    ("prefix:balance_rel", "expected key=value"),
    ("round_robin:balance_rel=1", "policy 'prefix' only"),
    ("prefix:balance_abs=x", "balance_abs=x"),
    ("prefix:balance_rel=-1", "must be >= 0"),
    (3, "routing policy 3"),
])
def test_bad_specs_raise_naming_them(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_routing_policy(spec)


def test_spec_options_parse():
    assert parse_routing_policy("prefix:balance_rel=0.5,balance_abs=64") == (
        "prefix", {"balance_rel": 0.5, "balance_abs": 64})
    r = Router([_View()], B, "prefix:balance_rel=0.5,balance_abs=64")
    assert (r.balance_rel, r.balance_abs) == (0.5, 64)
    with pytest.raises(ValueError, match="at least one replica"):
        Router([], B)


# -- the data-parallel front over stub replicas (no model, no device) ---------------------

def _front(n: int = 2):
    from jprefix.engine.args import EngineArgs
    from jprefix.engine.dp_engine import DataParallelEngine
    from scripts.bench_host import stub_engine

    args = EngineArgs(num_kv_blocks=256, data_parallel_size=n)
    return DataParallelEngine(None, args, replicas=[stub_engine(args) for _ in range(n)])


def test_front_counts_a_request_until_its_route_is_forgotten():
    from jprefix.core.sampling_params import SamplingParams

    front = _front()
    seq = front.make_request(list(range(10, 50)),
                             SamplingParams(max_tokens=3, ignore_eos=True)).seqs[0]
    r = front._queue(seq, None)
    replica = front.replicas[r]
    while replica.has_unfinished_requests():  # the replica finishes it, the front not yet
        replica.step()
    # (another thread may look here, between a replica's step and the front's forgetting)
    assert front.has_unfinished_requests() and front.replica_of(seq.request_id) == r
    front.router.finish(seq.request_id)
    assert not front.has_unfinished_requests()
    seq = front.add_request(None, list(range(10, 50)),
                            SamplingParams(max_tokens=3, ignore_eos=True)).seqs[0]
    while front.has_unfinished_requests():
        front.step()
    assert front.replica_of(seq.request_id) is None


def test_front_forgets_the_route_of_a_sequence_its_replica_refuses():
    from jprefix.core.sampling_params import SamplingParams

    front = _front()

    def refuse(seq, prompt):
        raise ValueError(f"request_id {seq.request_id!r} refused")

    for replica in front.replicas:
        replica._queue = refuse
    seq = front.make_request(list(range(10, 50)), SamplingParams(max_tokens=3)).seqs[0]
    with pytest.raises(ValueError, match="refused"):
        front._queue(seq, None)
    assert not front.has_unfinished_requests() and front.replica_of(seq.request_id) is None
    assert front.router.num_in_flight == 0


def test_front_keeps_the_route_of_a_streamed_request_until_it_finishes():
    from jprefix.core.outputs import RequestOutputKind
    from jprefix.core.sampling_params import SamplingParams

    front = _front()
    sp = SamplingParams(max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    group = front.add_request(None, list(range(10, 50)), sp)
    rid, seen = group.request_id, []
    while front.has_unfinished_requests():
        outs = front.step()
        seen += [o.finished for o in outs]
        if front.has_unfinished_requests() and not any(seen[-len(outs):] or [False]):
            assert front.replica_of(rid) is not None  # progress, not the end: still routed
    assert seen.count(True) == 1 and len(seen) > 1 and front.replica_of(rid) is None
