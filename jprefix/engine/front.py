"""The request surface of an engine, one construction path for the single engine and the
data-parallel front: a request is validated and tokenised (`InputProcessor`), fanned
out into its samples' sequences, its grammar compiled (`StructuredOutputManager`), and
then queued (`_queue`: one engine queues it, the front routes it to a replica first).
"""

from __future__ import annotations

import abc
from typing import Any

from jprefix.core.outputs import RequestOutput
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.sequence import Sequence
from jprefix.engine.input_processor import InputProcessor
from jprefix.engine.parallel_sampling import SampleGroup
from jprefix.engine.structured_output import StructuredOutputManager


class EngineFront(abc.ABC):
    """`make_request` / `add` / `add_request` / `abort` for an engine that provides
    `inputs`, `structured`, `_queue(seq, prompt)`, `abort_request(request_id)` and
    `step()`."""

    inputs: InputProcessor
    structured: StructuredOutputManager

    def make_request(self, prompt: Any, sampling_params: SamplingParams | None = None,
                     prefix_len: int | None = None, request_id: str | None = None,
                     cache_salt: str | None = None) -> SampleGroup:
        """Validates one request (ValueError naming a bad value) and builds the sequences
        of its samples, each with its grammar compiled if it has one; queues nothing.
        Thread-safe: the server calls it off the event loop."""
        group = self.inputs.make_request(prompt, sampling_params, prefix_len, request_id,
                                         cache_salt)
        for seq in group.seqs:  # each sample follows its own grammar state
            self.structured.prepare(seq)
        return group

    def add(self, group: SampleGroup) -> None:
        """Queues a request made by `make_request`; thread-safe, takes effect at the next
        step. Its outputs carry the ids `group.request_ids` (one per sample)."""
        for seq in group.seqs:
            self._queue(seq, group.prompt)

    def add_request(self, request_id: str | None, prompt: Any,
                    sampling_params: SamplingParams | None = None,
                    prefix_len: int | None = None, cache_salt: str | None = None
                    ) -> SampleGroup:
        """`make_request` then `add`; returns the request's handle."""
        group = self.make_request(prompt, sampling_params, prefix_len, request_id, cache_salt)
        self.add(group)
        return group

    def abort(self, group: SampleGroup) -> None:
        """Aborts every sample of a request at the next step."""
        for rid in group.request_ids:
            self.abort_request(rid)

    @abc.abstractmethod
    def _queue(self, seq: Sequence, prompt: str | None) -> Any:
        """Queues one validated sequence (`prompt`: the request's text, if any)."""

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> None:
        """Aborts one sequence (by its request id) at the next step."""

    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """One step; the outputs it produced (finished ones, and DELTA / CUMULATIVE
        requests' progress)."""
