"""Drives an LLMEngine for every caller of one LLM: sync `generate`, asyncio callers and the
server, at the same time.

The engine is stepped by one caller at a time (its scheduler and packer are not
thread-safe), and each step's outputs go to whichever caller waits for them. Which thread
steps:
- a sync `run` steps in the calling thread when nothing else is stepping (no thread hop
  on the offline path); when it has what it waited for and other callers' requests
  remain, it hands the stepping to a background thread before it returns;
- otherwise a background thread steps; it runs only while requests are in flight and
  exits when the engine is idle, so an idle LLM holds no thread;
- a sync `run` that arrives while that thread steps waits for its outputs instead.

Each request has a sink: an asyncio queue on its caller's event loop (after every step the
stepper posts a streaming request's new token ids, and finally its RequestOutput), or a
sync caller's dict, filled under a condition variable.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from jprefix.core.outputs import RequestOutput
from jprefix.core.sequence import Sequence
from jprefix.engine.llm_engine import LLMEngine

_SYNC = "sync caller"  # marks the stepping role as held by a sync `run`


@dataclass
class _Stream:
    """One asyncio caller's request."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq: Sequence
    progress: bool  # post new token ids after each step (streaming callers only)
    sent: int = 0  # output tokens already posted

    def put(self, item: list[int] | RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Batch:
    """One sync caller's requests: finished outputs by request id, or the step's error."""

    cond: threading.Condition
    done: dict[str, RequestOutput] = field(default_factory=dict)
    error: BaseException | None = None


@dataclass
class _SyncSink:
    batch: _Batch
    seq: Sequence
    progress: bool = False

    def put(self, item: RequestOutput | BaseException) -> None:
        with self.batch.cond:
            if isinstance(item, BaseException):
                self.batch.error = item
            else:
                self.batch.done[item.request_id] = item
            self.batch.cond.notify_all()


class EngineDriver:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._sinks: dict[str, _Stream | _SyncSink] = {}
        self._streaming: dict[str, _Stream] = {}  # the sinks that take progress
        self._stepper: threading.Thread | str | None = None  # who steps now, if anyone

    @property
    def thread(self) -> threading.Thread | None:
        """The background stepping thread, while it runs."""
        s = self._stepper
        return s if isinstance(s, threading.Thread) else None

    def run(self, seqs: Iterable[Sequence], use_tqdm: bool = False
            ) -> dict[str, RequestOutput]:
        """Queues validated sequences and blocks until each has its finished output
        (by request id). An interrupt or a failed step aborts the ones not finished."""
        seqs = list(seqs)
        batch = _Batch(threading.Condition())
        with self._lock:
            self._add(seqs, lambda seq: _SyncSink(batch, seq))
            lead = self._stepper is None
            if lead:
                self._stepper = _SYNC
        try:
            with tqdm(total=len(seqs), disable=not use_tqdm, desc="Processed prompts") as bar:
                while len(batch.done) < len(seqs) and batch.error is None:
                    if lead:
                        self._step()
                    else:
                        with batch.cond:
                            batch.cond.wait_for(
                                lambda: len(batch.done) == len(seqs) or batch.error is not None,
                                timeout=0.5)
                        with self._lock:  # the thread ended without our outputs: step here
                            if self._stepper is None:
                                self._stepper, lead = _SYNC, True
                    bar.update(len(batch.done) - bar.n)
        finally:
            with self._lock:
                for seq in seqs:  # still registered: not finished (interrupt or error)
                    if self._pop(seq.request_id) is not None:
                        self.engine.abort_request(seq.request_id)
                if lead:
                    self._stepper = None
                    if self.engine.has_unfinished_requests():
                        self._start_thread()  # other callers' requests remain
        if batch.error is not None:
            raise batch.error
        return batch.done

    async def submit(self, seq: Sequence) -> RequestOutput:
        """Queues a validated sequence and waits for its finished output."""
        async for item in self.stream(seq, progress=False):
            return item
        raise RuntimeError(f"request {seq.request_id!r} ended without an output")

    async def stream(self, seq: Sequence, progress: bool = True
                     ) -> AsyncIterator[list[int] | RequestOutput]:
        """Yields lists of new token ids as steps produce them (if `progress`), then the
        RequestOutput. Leaving the iteration early (or cancelling) aborts the request."""
        state = _Stream(asyncio.get_running_loop(), asyncio.Queue(), seq, progress)
        with self._lock:
            self._add([seq], lambda _: state)
            if self._stepper is None:
                self._start_thread()
        finished = False
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, RequestOutput):
                    finished = True
                    return
        finally:
            if not finished:
                with self._lock:
                    self._pop(seq.request_id)
                self.engine.abort_request(seq.request_id)

    def _add(self, seqs: list[Sequence], sink) -> None:
        """Registers each sequence's sink, then adds it to the engine (caller holds the
        lock, so no step runs in between)."""
        for seq in seqs:
            if seq.request_id in self._sinks:
                raise ValueError(f"request_id {seq.request_id!r} is already in flight")
        for seq in seqs:
            self._sinks[seq.request_id] = s = sink(seq)
            if s.progress:
                self._streaming[seq.request_id] = s
            self.engine.add_sequence(seq)

    def _pop(self, request_id: str) -> _Stream | _SyncSink | None:
        self._streaming.pop(request_id, None)
        return self._sinks.pop(request_id, None)

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._run_thread, name="jprefix-engine", daemon=True)
        self._stepper = thread
        thread.start()

    def _run_thread(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self.engine.has_unfinished_requests():
                        self._stepper = None
                        return
                self._step()
        except BaseException as exc:  # (not an Exception: _step passes those on)
            with self._lock:
                self._stepper = None  # a waiting sync caller takes the stepping over
            self._fail_all(exc)
            raise

    def _step(self) -> None:
        """One engine step; its outputs and progress go to their callers' sinks, and a
        failed step's error to every caller (a device failure never kills the stepper)."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._fail_all(exc)
            return
        self._post_progress()
        for out in outputs:
            with self._lock:
                sink = self._pop(out.request_id)
            if sink is not None:
                sink.put(out)

    def _post_progress(self) -> None:
        if not self._streaming:
            return
        with self._lock:
            streams = list(self._streaming.values())
        for s in streams:
            n = s.seq.num_output_tokens
            if n > s.sent:
                start = s.seq.num_prompt_tokens
                s.put(s.seq.all_token_ids[start + s.sent : start + n])  # only the new ids
                s.sent = n

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            sinks, self._sinks, self._streaming = self._sinks, {}, {}
            for rid in sinks:
                self.engine.abort_request(rid)
        for s in sinks.values():
            s.put(exc)
