"""A dispatched engine step on the host side: its handle, the state of a step whose
sampling waits for grammar masks, and the helpers that bring its outputs to the host."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np


class StepHandle(NamedTuple):
    """A dispatched step: its launch (resolving to the device output), live rows, the
    device's row order (indices into the scheduled list; None when unchanged), and for an
    extra step (logits processing, logprobs) the (sequence, prompt position) of each
    prompt-logprobs entry (None: a plain step)."""

    tokens: concurrent.futures.Future
    num_rows: int
    order: list[int] | None
    prompt_positions: list[tuple[Any, int]] | None = None
    later: MasksLater | None = None  # (dispatched with masks_later, until `sample`)
    verify_rows: int | None = None  # a verify step: where its verified tokens start


@dataclasses.dataclass
class MasksLater:
    """A step dispatched up to its logits (`step_logits`), its sampling queued by
    `ModelRunner.sample` once the host has its grammar masks."""

    rows: list[Any]  # the ScheduledSeq rows in device order
    num_rows: int  # the logits' rows (bucketed)
    layout: Any
    greedy: bool
    extra: bool
    forward: concurrent.futures.Future | None = None  # -> step_logits' outputs
    result: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future)  # -> what `launch` returns


def to_host(tokens: jax.Array, logprobs: Any) -> Any:
    """A step's output, its copy to the host queued now: the tokens may be on the host
    already when the engine asks (async scheduling fetches a step's tokens after
    dispatching the next one) instead of the copy starting only then."""
    for out in (tokens, *jax.tree.leaves(logprobs)):
        out.copy_to_host_async()
    return tokens if logprobs is None else (tokens, logprobs)


def unorder(device_rows: np.ndarray, order: list[int]) -> np.ndarray:
    """Rows in device order -> rows in scheduled order (device row i is scheduled order[i])."""
    out = np.empty_like(device_rows)
    out[order] = device_rows
    return out
