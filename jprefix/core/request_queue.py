"""The waiting queue every policy builds on: arrival order, preempted requests first,
and the age bound (see `jprefix.core.policies` for the policies and their specs).

A policy owns the waiting queue. The scheduler calls `begin_round()` once per step before
admitting, then `peek()` for the next request to admit and `remove()` once admitted.

Age bound, on every policy: the head of the queue (preempted requests are prepended there)
is served first if it is a preempted request, or if it has waited longer than `max_wait`
seconds (from `Sequence.arrival_time`, on the policy's clock: time.monotonic). Requests are
queued in arrival order, so the oldest request reaches the head once every earlier arrival
has been served, and then waits at most one round: nothing starves. Seconds rather than
rounds, because a round lasts from one to hundreds of milliseconds depending on the batch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from jprefix.core.prefix_cache import PrefixPool, PrefixTrie
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
