"""Routing requests over data-parallel replicas (pure Python, no jax).

`Router.route` picks the replica for one request:

- policy "prefix" (the default): the replica whose cache holds the longest run of the
  request's leading shareable blocks. A replica's holdings are what its prefix trie holds
  now (a `CacheView`: exact chained block hashes, salt included, read from the trie itself
  in one process) plus the blocks of the requests already routed to it and not finished
  (they will be in its trie by the time a later request is scheduled there, so requests
  of one prefix that arrive together still meet). Ties and misses go to the least loaded
  replica (load: running + waiting tokens, `loads`), then the lowest index.
  Imbalance bound: a replica whose load exceeds its share of the total,
  `load > total / N * (1 + balance_rel) + balance_abs`, gets no affinity traffic; such a
  request goes to the best match among the others, or the least loaded one, which then
  computes (copies) the hot prefix, and later requests of that prefix split between the
  replicas holding it by load.
- policy "round_robin": replica i mod N, for comparison.

Block hashes are `prefix_trie.block_hash` chains from `root_hash(cache_salt)`: two requests
meet only if every token up to a block and the salt are equal (up to a 64-bit hash
collision, which can only misroute a request: the replica's scheduler matches by tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Protocol

from jprefix.core.host_pool import HostPool
from jprefix.core.policies import parse_options
from jprefix.core.prefix_trie import PrefixTrie, block_hash, root_hash

ROUTING_POLICIES = ("prefix", "round_robin")
# option name -> type, for "prefix:balance_rel=0.5,balance_abs=4096"
_OPTIONS = {"balance_rel": float, "balance_abs": int}


class CacheView(Protocol):
    """What a replica's cache holds: `prefix_hash in view` for a trie node's chained hash.
    One process: the replica's `PrefixTrie` (its hash table, read as it changes); a remote
    replica: a set the front keeps from the replica's trie insert/evict events."""

    def __contains__(self, prefix_hash: object) -> bool: ...


class TrieView:
    """A replica's `PrefixTrie` (and host tier: a host-resident prefix is brought back
    far cheaper than recomputed) as a `CacheView` (one or two dict lookups per block:
    safe to read from another thread while the replica's scheduler changes them)."""

    def __init__(self, trie: PrefixTrie, host: HostPool | None = None):
        self.trie, self.host = trie, host  # host: the replica's host tier, if any

    def __contains__(self, prefix_hash: object) -> bool:
        return self.trie.find(prefix_hash) is not None or (
            self.host is not None and self.host.holds(prefix_hash))


@dataclasses.dataclass
class ReplicaCounters:
    """Per replica: requests routed, of which by a prefix match (`affinity`), and in flight."""

    requests: int = 0
    affinity: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0  # prompt tokens of the requests in flight


def parse_routing_policy(spec: str) -> tuple[str, dict[str, float | int]]:
    """"prefix", "round_robin" or "prefix:balance_rel=0.25,balance_abs=2048"."""
    if not isinstance(spec, str):
        raise ValueError(f"routing policy {spec!r} is not one of {list(ROUTING_POLICIES)}")
    name, _, opts = spec.partition(":")
    if name not in ROUTING_POLICIES:
        raise ValueError(f"routing policy {name!r} is not one of {list(ROUTING_POLICIES)}")
    if name != "prefix" and opts:
        raise ValueError(f"routing options in {spec!r}: policy 'prefix' only takes options")
    kwargs = parse_options("routing", spec, opts, _OPTIONS)
    for key, value in kwargs.items():
        if value < 0:
            raise ValueError(f"routing option {key}={value} in {spec!r} must be >= 0")
    return name, kwargs


def request_hashes(token_ids: Seq[int], num_blocks: int, block_size: int,
                   salt: str | None) -> list[int]:
    """The chained hashes of the first `num_blocks` whole blocks of token_ids (the
    prefix_hash each block's trie node carries under `salt`)."""
    h, out = root_hash(salt), []
    for i in range(min(num_blocks, len(token_ids) // block_size)):
        h = block_hash(h, token_ids[i * block_size:(i + 1) * block_size])
        out.append(h)
    return out


class Router:
    """Chooses a replica per request and keeps the routed requests' blocks and counters.

    Not thread-safe: the front calls it under its own lock."""

    def __init__(self, views: Seq[CacheView], block_size: int, policy: str = "prefix"):
        if not views:
            raise ValueError("a router needs at least one replica")
        self.policy, options = parse_routing_policy(policy)
        self.balance_rel = float(options.get("balance_rel", 0.25))
        self.balance_abs = int(options.get("balance_abs", 2048))
        self.views, self.block_size = list(views), block_size
        self.counters = [ReplicaCounters() for _ in self.views]
        self._routed: list[dict[int, int]] = [{} for _ in self.views]  # hash -> requests
        self._requests: dict[str, tuple[int, list[int], int]] = {}  # id -> (replica, hashes, n)
        self._next = 0  # round robin

    @property
    def num_replicas(self) -> int:
        return len(self.views)

    def matched_blocks(self, hashes: Seq[int]) -> list[int]:
        """Per replica: how many leading blocks of `hashes` it holds or will hold."""
        out = []
        for view, routed in zip(self.views, self._routed, strict=True):
            n = 0
            for h in hashes:
                if h not in routed and h not in view:
                    break
                n += 1
            out.append(n)
        return out

    def over_share(self, loads: Seq[int]) -> list[bool]:
        """Which replicas are over their share of the load (no affinity traffic for them)."""
        bound = sum(loads) / len(loads) * (1 + self.balance_rel) + self.balance_abs
        return [load > bound for load in loads]

    def choose(self, hashes: Seq[int], loads: Seq[int]) -> tuple[int, int]:
        """(replica, its matched blocks) for a request with these block hashes."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"{len(loads)} loads for {self.num_replicas} replicas")
        if self.policy == "round_robin":
            r, self._next = self._next, (self._next + 1) % self.num_replicas
            return r, self.matched_blocks(hashes)[r]
        matched, over = self.matched_blocks(hashes), self.over_share(loads)
        # within their share: longest match, then least loaded, then lowest index (the
        # least loaded replica is never over its share, so one always qualifies)
        r = min((r for r in range(self.num_replicas) if not over[r]),
                key=lambda r: (-matched[r], loads[r], r))
        return r, matched[r]

    def route(self, request_id: str, token_ids: Seq[int], shareable_blocks: int,
              salt: str | None, loads: Seq[int]) -> int:
        """Routes one request and records it until `finish(request_id)`;
        `shareable_blocks`: how many of its leading blocks the replica may match and
        cache (as its scheduler decides: the explicit prefix or every full block, short of
        the last token)."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        hashes = request_hashes(token_ids, shareable_blocks, self.block_size, salt)
        replica, matched = self.choose(hashes, loads)
        routed = self._routed[replica]
        for h in hashes:
            routed[h] = routed.get(h, 0) + 1
        self._requests[request_id] = (replica, hashes, len(token_ids))
        c = self.counters[replica]
        c.requests += 1
        c.affinity += matched > 0
        c.in_flight += 1
        c.prompt_tokens += len(token_ids)
        return replica

    @property
    def num_in_flight(self) -> int:
        """Requests routed and not yet finished."""
        return len(self._requests)

    def replica_of(self, request_id: str) -> int | None:
        entry = self._requests.get(request_id)
        return None if entry is None else entry[0]

    def finish(self, request_id: str) -> int | None:
        """Forgets a finished (or aborted) request; returns its replica (None: unknown)."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        replica, hashes, num_tokens = entry
        routed = self._routed[replica]
        for h in hashes:
            if routed[h] == 1:
                del routed[h]
            else:
                routed[h] -= 1
        c = self.counters[replica]
        c.in_flight -= 1
        c.prompt_tokens -= num_tokens
        return replica
