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

Each request (one per sample) has a sink: an asyncio queue on its caller's event loop,
which receives every RequestOutput the engine returns for it (a DELTA request's progress,
then its last output), or a sync caller's dict of finished outputs, filled under a
condition variable. The driver reads RequestOutputs only, never the engine's requests.

At interpreter exit every live driver is closed (`close`: its requests aborted, its step
in flight waited for): a daemon thread torn down inside XLA aborts the process.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from jprefix.core.outputs import RequestOutput
from jprefix.engine.front import EngineFront
from jprefix.engine.parallel_sampling import SampleGroup

_SYNC = "sync caller"  # marks the stepping role as held by a sync `run`
EXIT_WAIT_S = 60.0  # at exit, the wait for a driver's step in flight (a first one compiles)
_live: weakref.WeakSet = weakref.WeakSet()  # every driver, for the exit hook


@atexit.register
def _close_all() -> None:
    for driver in list(_live):
        driver.close(EXIT_WAIT_S)


@dataclass
class _Stream:
    """One asyncio caller's request (its samples' outputs share the queue)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its loop is closed: the caller is gone (a server that stopped)
            pass


@dataclass
class _Batch:
    """One sync caller's requests: finished outputs by request id, or the step's error."""

    cond: threading.Condition
    done: dict[str, RequestOutput] = field(default_factory=dict)
    error: BaseException | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        with self.cond:
            if isinstance(item, BaseException):
                self.error = item
            elif item.finished:
                self.done[item.request_id] = item
            self.cond.notify_all()


class EngineDriver:
    def __init__(self, engine: EngineFront):
        self.engine = engine
        self._lock = threading.Lock()
        self._sinks: dict[str, _Stream | _Batch] = {}  # by request id, until finished
        self._stepper: threading.Thread | str | None = None  # who steps now, if anyone
        _live.add(self)

    @property
    def thread(self) -> threading.Thread | None:
        """The background stepping thread, while it runs."""
        s = self._stepper
        return s if isinstance(s, threading.Thread) else None

    def run(self, groups: Iterable[SampleGroup], use_tqdm: bool = False
            ) -> dict[str, RequestOutput]:
        """Queues requests made by the engine's `make_request` and blocks until each of
        their samples has its finished output (by request id). An interrupt or a failed
        step aborts the ones not finished."""
        groups = list(groups)
        ids = [rid for g in groups for rid in g.request_ids]
        batch = _Batch(threading.Condition())
        with self._lock:
            self._add(groups, batch)
            lead = self._stepper is None
            if lead:
                self._stepper = _SYNC
        try:
            with tqdm(total=len(ids), disable=not use_tqdm, desc="Processed prompts") as bar:
                while len(batch.done) < len(ids) and batch.error is None:
                    if lead:
                        self._step()
                    else:
                        with batch.cond:
                            batch.cond.wait_for(
                                lambda: len(batch.done) == len(ids) or batch.error is not None,
                                timeout=0.5)
                        with self._lock:  # the thread ended without our outputs: step here
                            if self._stepper is None:
                                self._stepper, lead = _SYNC, True
                    bar.update(len(batch.done) - bar.n)
        finally:
            with self._lock:
                self._abort_unfinished(ids)
                if lead:
                    self._stepper = None
                    if self.engine.has_unfinished_requests():
                        self._start_thread()  # other callers' requests remain
        if batch.error is not None:
            raise batch.error
        return batch.done

    async def stream(self, group: SampleGroup) -> AsyncIterator[RequestOutput]:
        """Yields every RequestOutput of the request's samples as steps produce them
        (their `request_id`s are `group.request_ids`), until each sample's finished one.
        Leaving the iteration early (or cancelling) aborts every sample."""
        state = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        ids = group.request_ids
        with self._lock:
            self._add([group], state)
            if self._stepper is None:
                self._start_thread()
        left = len(ids)
        try:
            while left:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                left -= item.finished
                yield item
        finally:
            if left:
                with self._lock:
                    self._abort_unfinished(ids)

    async def submit(self, group: SampleGroup) -> list[RequestOutput]:
        """Queues a request and waits for its samples' finished outputs (sample order)."""
        done = {}
        async for out in self.stream(group):
            if out.finished:
                done[out.request_id] = out
        return [done[rid] for rid in group.request_ids]

    def _add(self, groups: list[SampleGroup], sink: _Stream | _Batch) -> None:
        """Registers each sample's sink, then queues the requests (the caller holds the
        lock, so no step runs in between)."""
        for group in groups:
            for rid in group.request_ids:
                if rid in self._sinks:
                    raise ValueError(f"request_id {rid!r} is already in flight")
        for group in groups:
            for rid in group.request_ids:
                self._sinks[rid] = sink
            self.engine.add(group)

    def _abort_unfinished(self, ids: list[str]) -> None:
        """Aborts the requests among `ids` still registered (not finished); caller holds
        the lock."""
        for rid in ids:
            if self._sinks.pop(rid, None) is not None:
                self.engine.abort_request(rid)

    def close(self, timeout: float | None = None) -> bool:
        """Aborts every request in flight (each waiting caller gets a RuntimeError), then
        waits up to `timeout` seconds for the stepping thread to exit; True once no thread
        steps. A process must not exit while that thread is inside XLA: the interpreter's
        teardown of a daemon thread there aborts the process. The driver stays usable."""
        self._fail_all(RuntimeError("the engine was shut down; the request was aborted"))
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return self.thread is None

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
        """One engine step; its outputs go to their callers' sinks (a finished output
        unregisters its request), and a failed step's error to every caller (a device
        failure never kills the stepper)."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._fail_all(exc)
            return
        if not outputs:
            return
        with self._lock:
            sinks = self._sinks
            routed = [(sinks.pop(out.request_id, None) if out.finished
                       else sinks.get(out.request_id), out) for out in outputs]
        for sink, out in routed:
            if sink is not None:
                sink.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            for rid in sinks:
                self.engine.abort_request(rid)
        for sink in {id(s): s for s in sinks.values()}.values():  # (each caller once)
            sink.put(exc)
