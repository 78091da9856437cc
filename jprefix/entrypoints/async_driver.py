"""Drives an LLMEngine from a background thread for asyncio callers.

The thread runs only while requests are in flight and exits when the engine is idle, so
an idle LLM holds no thread. Each request has a queue on its caller's event loop: after
every step the thread posts the request's new token ids, and finally its RequestOutput.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from jprefix.core.outputs import RequestOutput
from jprefix.core.sequence import Sequence
from jprefix.engine.llm_engine import LLMEngine


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq: Sequence
    progress: bool  # post new token ids after each step (streaming callers only)
    sent: int = 0  # output tokens already posted


class AsyncDriver:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None

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
            if seq.request_id in self._streams:
                raise ValueError(f"request_id {seq.request_id!r} is already in flight")
            self._streams[seq.request_id] = state
            self.engine.add_sequence(seq)
            self._ensure_thread()
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
                self.engine.abort_request(seq.request_id)

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
            except Exception as exc:  # a device failure reaches every caller, not a dead thread
                self._fail_all(exc)
                continue
            self._post_progress()
            for out in outputs:
                self._finish(out)

    def _post_progress(self) -> None:
        with self._lock:
            streams = [s for s in self._streams.values() if s.progress]
        for s in streams:
            n = s.seq.num_output_tokens
            if n > s.sent:
                start = s.seq.num_prompt_tokens
                new = s.seq.all_token_ids[start + s.sent : start + n]  # only the new ids
                s.loop.call_soon_threadsafe(s.queue.put_nowait, new)
                s.sent = n

    def _finish(self, out: RequestOutput) -> None:
        with self._lock:
            s = self._streams.pop(out.request_id, None)
        if s is not None:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, out)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            for rid in streams:
                self.engine.abort_request(rid)
        for s in streams.values():
            s.loop.call_soon_threadsafe(s.queue.put_nowait, exc)
