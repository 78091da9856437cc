"""The scheduler's output: a step's rows (`ScheduledSeq`), the preempted and ignored
sequences (`SchedulerOutput`), and the one definition of a decode step. `core.scheduler`
re-exports them (the names vLLM's `core/sched/output.py` holds)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

from jprefix.core.sequence import Sequence


class ScheduledSeq(NamedTuple):
    """Compute the tokens at positions start..start+num_new_tokens-1 of `seq` (the last
    may be pending, or they end with its proposals); `sample`: the step samples the
    token after them. (A NamedTuple: one is made per row per step.)"""

    seq: Sequence
    start: int
    num_new_tokens: int
    sample: bool


def is_decode_step(num_new_tokens: Seq[int]) -> bool:
    """Whether a step whose rows compute these token counts is a decode step: every row
    computes exactly one token (the decode-tiled kernels, cascade and repacking apply).
    The one definition of a decode step; the others derive from it."""
    return num_new_tokens.count(1) == len(num_new_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # back to waiting, blocks freed
    ignored: list[Sequence] = field(default_factory=list)  # finished 'error': can never fit

    @property
    def num_batched_tokens(self) -> int:
        return sum(map(attrgetter("num_new_tokens"), self.scheduled))
