"""Drives an LLMEngine from a background thread for asyncio callers.

The thread runs only while requests are in flight and exits when the engine is idle, so
an idle LLM holds no thread. Results are handed back to each caller's event loop.
"""

from __future__ import annotations

import asyncio
import threading

from jprefix.engine import LLMEngine
from jprefix.outputs import RequestOutput
from jprefix.sequence import Sequence


class AsyncDriver:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._thread: threading.Thread | None = None

    async def submit(self, seq: Sequence) -> RequestOutput:
        """Queues a validated sequence and waits for its finished output."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._lock:
            if seq.request_id in self._waiters:
                raise ValueError(f"request_id {seq.request_id!r} is already in flight")
            self._waiters[seq.request_id] = (loop, future)
            self.engine.add_sequence(seq)
            self._ensure_thread()
        try:
            return await future
        except asyncio.CancelledError:
            self.engine.abort_request(seq.request_id)
            raise

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jprefix-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self.engine.has_unfinished_requests():
                    self._thread = None
                    return
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a device failure reaches every waiter, not a dead thread
                self._fail_all(exc)
                continue
            for out in outputs:
                self._resolve(out)

    def _resolve(self, out: RequestOutput) -> None:
        with self._lock:
            loop, future = self._waiters.pop(out.request_id, (None, None))
        if loop is not None:
            loop.call_soon_threadsafe(_set_result, future, out)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, {}
            for rid in waiters:
                self.engine.abort_request(rid)
        for loop, future in waiters.values():
            loop.call_soon_threadsafe(_set_exception, future, exc)


def _set_result(future: asyncio.Future, value: RequestOutput) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
