"""Waiting-queue policies: `fcfs`, `greedy` (the original's prefix-group scheduler) and
`lpm` (longest cached prefix match first, as SGLang orders its queue).

A policy owns the waiting queue. The scheduler calls `begin_round()` once per step before
admitting, then `peek()` for the next request to admit and `remove()` once admitted. The
order is built once per round: lpm sorts at most `fcfs_threshold` requests, greedy sorts at
most `window` prefix groups, so a queue of thousands costs O(window log window) per step.

Age bound, on every policy: the head of the queue (preempted requests are prepended there)
is served first if it is a preempted request, or if it has waited longer than `max_wait`
seconds (from `Sequence.arrival_time`, on the policy's clock: time.monotonic). Requests are
queued in arrival order, so the oldest request reaches the head once every earlier arrival
has been served, and then waits at most one round: nothing starves. Seconds rather than
rounds, because a round lasts from one to hundreds of milliseconds depending on the batch.

A policy is named by a spec: a name, optionally with options, e.g. "lpm",
"greedy:max_wait=60", "lpm:fcfs_threshold=256,max_wait=5".
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jprefix.core.prefix_cache import PrefixPool, PrefixTrie, prefix_hash_of
from jprefix.core.sequence import Sequence, SequenceStatus

DEFAULT_MAX_WAIT = 30.0  # seconds


class Policy:
    """The waiting queue in arrival order (preempted requests prepended); a subclass
    decides the order of admission in `_next` and may keep per-request state."""

    OPTIONS: dict[str, Callable[[str], Any]] = {"max_wait": float}

    def __init__(self, prefix_pool: PrefixPool | None = None, max_wait: float = DEFAULT_MAX_WAIT,
                 clock: Callable[[], float] = time.monotonic):
        if max_wait <= 0:
            raise ValueError(f"max_wait must be > 0 seconds, got {max_wait}")
        self.prefix_pool = prefix_pool
        self.max_wait = max_wait
        self.clock = clock
        self._queue: OrderedDict[str, Sequence] = OrderedDict()
        self._now = clock()
        self._stale = True  # the round's order must be rebuilt before use

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queue

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue.values())

    def add(self, seq: Sequence) -> None:
        """A new request."""
        self._queue[seq.request_id] = seq
        self._on_add(seq)
        self._stale = True

    def prepend(self, seq: Sequence) -> None:
        """A preempted request: it goes first."""
        self.add(seq)
        self._queue.move_to_end(seq.request_id, last=False)

    def remove(self, request_id: str) -> Sequence | None:
        seq = self._queue.pop(request_id, None)
        if seq is not None:
            self._on_remove(seq)
        return seq

    def begin_round(self) -> None:
        """A scheduling round starts: read the clock and rebuild the order."""
        self._now = self.clock()
        self._build()
        self._stale = False

    def peek(self) -> Sequence | None:
        """The next request to admit, or None."""
        head = self._head()
        if head is None or self.is_urgent(head):
            return head
        if self._stale:
            self.begin_round()
        return self._next()

    def is_urgent(self, seq: Sequence) -> bool:
        """Preempted, or waiting longer than max_wait at the start of this round."""
        return seq.status is SequenceStatus.PREEMPTED or (
            self._now - seq.arrival_time > self.max_wait)

    def _head(self) -> Sequence | None:
        return next(iter(self._queue.values()), None)

    # Subclass hooks.
    def _on_add(self, seq: Sequence) -> None:
        pass

    def _on_remove(self, seq: Sequence) -> None:
        pass

    def _build(self) -> None:
        pass

    def _next(self) -> Sequence | None:
        return self._head()


class FCFSPolicy(Policy):
    """First come, first served (preempted requests first): age-ordered by construction."""


class PrefixMatch:
    """The cached blocks matching a token run, kept across rounds: while the deepest
    matched node stays in the trie (so do its ancestors), a round only tries to extend the
    match by one child lookup; if it was evicted or deleted, the run is matched again."""

    __slots__ = ("path",)

    def __init__(self) -> None:
        self.path: list = []

    def blocks(self, trie: PrefixTrie, tokens: list[int], max_blocks: int,
               salt: str | None) -> int:
        path, B = self.path, trie.block_size
        if path and trie.node_of(path[-1].block) is not path[-1]:
            path.clear()
        if not path:
            path.extend(trie.match(tokens, max_blocks, salt))
            return len(path)
        del path[max_blocks:]
        while len(path) < max_blocks:
            i = len(path)
            child = path[-1].children.get(tuple(tokens[i * B : (i + 1) * B]))
            if child is None:
                break
            path.append(child)
        return len(path)


def matchable_blocks(seq: Sequence, block_size: int) -> int:
    """Blocks of seq the scheduler may take from the cache (as Scheduler._match caps it)."""
    shareable = seq.num_tokens if seq.prefix_len is None else seq.prefix_len
    return min(shareable // block_size, (seq.num_tokens - 1) // block_size)


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
        n = matchable_blocks(seq, trie.block_size)
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
            explicit = seq.prefix_len is not None
            n = seq.prefix_len if explicit else seq.num_tokens
            group = PrefixGroup(seq.all_token_ids, n // self.block_size, seq.cache_salt, explicit)
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
    allowed, kwargs = POLICIES[name].OPTIONS, {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise ValueError(f"policy option {item!r} in {spec!r}: expected key=value with key "
                             f"one of {sorted(allowed)}")
        try:
            kwargs[key] = allowed[key](value)
        except ValueError as e:
            raise ValueError(f"policy option {item!r} in {spec!r}: {e}") from e
    return name, kwargs


def make_policy(spec: str, prefix_pool: PrefixPool) -> Policy:
    """The waiting-queue policy for a spec ("fcfs", "greedy", "lpm", "lpm:max_wait=5")."""
    name, kwargs = parse_policy(spec)
    return POLICIES[name](prefix_pool, **kwargs)
