"""Waiting-queue policies: `fcfs`, `greedy` (the original's prefix-group scheduler) and
`lpm` (longest cached prefix match first, as SGLang orders its queue), over the queue and
age bound of `jprefix.core.request_queue`.

The order is built once per round: lpm sorts at most `fcfs_threshold` requests, greedy sorts
at most `window` prefix groups, so a queue of thousands costs O(window log window) per step.

A policy is named by a spec: a name, optionally with options, e.g. "lpm",
"greedy:max_wait=60", "lpm:fcfs_threshold=256,max_wait=5".
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from jprefix.core.prefix_cache import PrefixPool, prefix_hash_of
from jprefix.core.request_queue import FCFSPolicy, Policy, PrefixMatch
from jprefix.core.sequence import Sequence


class LPMPolicy(Policy):
    """Longest cached prefix match first (ties in queue order); plain fcfs while more than
    `fcfs_threshold` requests wait, since sorting a long queue every step costs too much."""

    OPTIONS = {**Policy.OPTIONS, "fcfs_threshold": int}

    def __init__(self, prefix_pool: PrefixPool, fcfs_threshold: int = 128, **kw: Any):
        super().__init__(prefix_pool, **kw)
        if fcfs_threshold < 0:
            raise ValueError(f"fcfs_threshold must be >= 0, got {fcfs_threshold}")
        self.fcfs_threshold = fcfs_threshold
        self._matches: dict[str, PrefixMatch] = {}
        self._order: list[Sequence] = []
        self._cursor = 0

    def _on_add(self, seq: Sequence) -> None:
        self._matches.setdefault(seq.request_id, PrefixMatch())

    def _on_remove(self, seq: Sequence) -> None:
        del self._matches[seq.request_id]

    def matched_blocks(self, seq: Sequence) -> int:
        trie = self.prefix_pool.trie
        n = seq.num_matchable_blocks(trie.block_size)
        return self._matches[seq.request_id].blocks(trie, seq.all_token_ids, n, seq.cache_salt)

    def _build(self) -> None:
        self._cursor = 0
        if len(self._queue) > self.fcfs_threshold:
            self._order = []
            return
        keyed = [(-self.matched_blocks(s), i, s) for i, s in enumerate(self._queue.values())]
        keyed.sort(key=lambda k: k[:2])
        self._order = [s for _, _, s in keyed]

    def _next(self) -> Sequence | None:
        while self._cursor < len(self._order):
            seq = self._order[self._cursor]
            if self._queue.get(seq.request_id) is seq:
                return seq
            self._cursor += 1
        return self._head()  # fcfs: over the threshold, or requests added mid-round


@dataclass(eq=False)
class PrefixGroup:
    """Waiting requests that share a prefix: `blocks` whole blocks of `tokens`.

    Explicit prefix_len: the group key is the hash of the first prefix_len // B blocks and
    `blocks` is that count. Automatic mode: the key is the first block, and `blocks` is the
    longest run of whole blocks every member has shared with the first (it only shrinks).
    """

    tokens: list[int]
    blocks: int
    salt: str | None
    explicit: bool
    members: OrderedDict[str, Sequence] = field(default_factory=OrderedDict)
    total_blocks: int = 0  # sum over members of the blocks their tokens fill
    match: PrefixMatch = field(default_factory=PrefixMatch)

    def admit(self, seq: Sequence, block_size: int) -> None:
        if not self.explicit and self.members:
            self.blocks = common_blocks(self.tokens, seq.all_token_ids, self.blocks, block_size)
        self.members[seq.request_id] = seq
        self.total_blocks += -(-seq.num_tokens // block_size)


def common_blocks(a: list[int], b: list[int], limit: int, block_size: int) -> int:
    """How many leading whole blocks (at most limit) a and b have in common."""
    B, n = block_size, 0
    limit = min(limit, len(a) // B, len(b) // B)
    while n < limit and a[n * B : (n + 1) * B] == b[n * B : (n + 1) * B]:
        n += 1
    return n


class GreedyPolicy(Policy):
    """The original's greedy scheduler. Requests are grouped by prefix; each round the
    groups are valued by the prefill blocks they save, `cached * count + uncached *
    (count - 1)` (prefixes already cached and larger, more frequent prefixes first), and
    packed in that order into the blocks free now: a group whose prefix plus its first
    request fits goes ahead of all that do not, and reserves its estimated need (uncached
    prefix blocks plus every member's own blocks). A group runs its members in arrival
    order; its first member warms the prefix, and the others share its blocks in the same
    step (blocks are registered at schedule time) or hit the cache in later steps.

    Only the `window` oldest groups are sorted each round; later ones follow in arrival
    order, which bounds the per-step cost on very long queues.
    """

    OPTIONS = {**Policy.OPTIONS, "window": int}

    def __init__(self, prefix_pool: PrefixPool, window: int = 256, **kw: Any):
        super().__init__(prefix_pool, **kw)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.block_size = prefix_pool.block_size
        self._groups: dict[tuple, PrefixGroup] = {}  # in order of creation
        self._group_of: dict[str, tuple] = {}
        self._empty: set[tuple] = set()
        self._order: Iterator[PrefixGroup] = iter(())
        self._current: PrefixGroup | None = None

    def group_key(self, seq: Sequence) -> tuple:
        """(explicit?, hash of the shared blocks), or a key of its own if none is whole."""
        B = self.block_size
        n = seq.prefix_len // B if seq.prefix_len is not None else min(1, seq.num_tokens // B)
        if n == 0:
            return ("own", seq.request_id)
        h = prefix_hash_of(seq.all_token_ids[: n * B], B, seq.cache_salt)
        return (seq.prefix_len is not None, h)

    def _on_add(self, seq: Sequence) -> None:
        key = self.group_key(seq)
        group = self._groups.get(key)
        if group is None:
            group = PrefixGroup(seq.all_token_ids, seq.num_shareable_blocks(self.block_size),
                                seq.cache_salt, seq.prefix_len is not None)
            self._groups[key] = group
        group.admit(seq, self.block_size)
        self._group_of[seq.request_id] = key
        self._empty.discard(key)

    def _on_remove(self, seq: Sequence) -> None:
        key = self._group_of.pop(seq.request_id)
        group = self._groups[key]
        del group.members[seq.request_id]
        group.total_blocks -= -(-seq.num_tokens // self.block_size)
        if not group.members:
            self._empty.add(key)  # dropped at the next round: no dict change mid-round

    def value_and_needs(self, group: PrefixGroup) -> tuple[int, int, int]:
        """(prefill blocks saved, blocks to start its first member, blocks for all)."""
        trie, B = self.prefix_pool.trie, self.block_size
        cached = group.match.blocks(trie, group.tokens, group.blocks, group.salt)
        count = len(group.members)
        value = cached * count + (group.blocks - cached) * (count - 1)
        head = next(iter(group.members.values()))
        start = group.blocks - cached + max(0, -(-head.num_tokens // B) - group.blocks)
        total = group.blocks - cached + max(0, group.total_blocks - count * group.blocks)
        return value, start, total

    def _build(self) -> None:
        for key in self._empty:
            if not self._groups[key].members:
                del self._groups[key]
        self._empty.clear()
        window = list(itertools.islice(self._groups.values(), self.window))
        ranked = sorted(((*self.value_and_needs(g), i, g) for i, g in enumerate(window)),
                        key=lambda r: (-r[0], r[3]))
        room = self.prefix_pool.block_manager.num_free_blocks
        fits, later = [], []
        for _, start, total, _, group in ranked:
            if start <= room:
                fits.append(group)
                room -= min(total, room)
            else:
                later.append(group)
        rest = itertools.islice(self._groups.values(), self.window, None)
        self._order = itertools.chain(fits, later, rest)
        self._current = None

    def _next(self) -> Sequence | None:
        while True:
            if self._current is None:
                self._current = next(self._order, None)
                if self._current is None:
                    return self._head()
            head = next(iter(self._current.members.values()), None)
            if head is not None:
                return head
            self._current = None


POLICIES: dict[str, type[Policy]] = {"fcfs": FCFSPolicy, "greedy": GreedyPolicy,
                                     "lpm": LPMPolicy}


def parse_policy(spec: str) -> tuple[str, dict[str, Any]]:
    """"name" or "name:key=value,...", checked against the policy's OPTIONS."""
    name, _, opts = spec.partition(":")
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is not one of {sorted(POLICIES)}")
    return name, parse_options("policy", spec, opts, POLICIES[name].OPTIONS)


def parse_options(what: str, spec: str, opts: str, allowed: dict[str, Any]) -> dict[str, Any]:
    """The "key=value,..." part `opts` of a `spec`: each value converted by `allowed[key]`;
    ValueError naming the bad item (`what` names the kind of spec in the message)."""
    kwargs: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise ValueError(f"{what} option {item!r} in {spec!r}: expected key=value with key "
                             f"one of {sorted(allowed)}")
        try:
            kwargs[key] = allowed[key](value)
        except ValueError as e:
            raise ValueError(f"{what} option {item!r} in {spec!r}: {e}") from e
    return kwargs


def make_policy(spec: str, prefix_pool: PrefixPool) -> Policy:
    """The waiting-queue policy for a spec ("fcfs", "greedy", "lpm", "lpm:max_wait=5")."""
    name, kwargs = parse_policy(spec)
    return POLICIES[name](prefix_pool, **kwargs)
