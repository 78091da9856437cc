"""What a served request waits on besides its outputs: its client leaving, and the
server's shutdown (`Shutdown`: new requests refused while draining, running ones aborted
when the drain time is over)."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request

from jprefix.core.outputs import RequestOutput
from jprefix.engine.parallel_sampling import SampleGroup
from jprefix.entrypoints.llm import LLM

ABORTED = object()  # until_done's answer when the server aborted the request


class Shutdown:
    """The server's shutdown state: `draining` once a stop signal came (new requests get
    503); `abort()` (from any thread) when the drain time is over sets the `aborted()`
    event of every event loop serving the app (running requests are aborted)."""

    def __init__(self) -> None:
        self.draining = self.is_aborted = False
        self._events: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def aborted(self) -> asyncio.Event:
        """The running loop's event (an asyncio.Event belongs to one loop)."""
        loop = asyncio.get_running_loop()
        event = self._events.get(loop)
        if event is None:
            event = self._events[loop] = asyncio.Event()
            if self.is_aborted:
                event.set()
        return event

    def abort(self) -> None:
        self.is_aborted = True
        for loop, event in list(self._events.items()):
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)


async def until_done(request: Request, work: Awaitable[Any],
                     aborted: asyncio.Event | None = None) -> Any:
    """`work`'s result; None after cancelling it when the client disconnects first, or
    ABORTED when `aborted` is set first (cancelling a generation aborts its request and
    frees its blocks)."""
    task = asyncio.ensure_future(work)
    watches = [asyncio.ensure_future(_disconnected(request))]
    if aborted is not None:
        watches.append(asyncio.ensure_future(aborted.wait()))
    try:
        await asyncio.wait({task, *watches}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watch in watches:
            watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if not task.cancelled():
        return task.result()
    return ABORTED if aborted is not None and aborted.is_set() else None



async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read by now, so the server's next
    message for this request is its disconnect, sent once the client goes away)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def interleaved(llm: LLM, groups: list[SampleGroup], aborted: asyncio.Event
                       ) -> AsyncIterator[RequestOutput]:
    """Every output of the groups' samples as steps produce them, until each has its last
    one or `aborted` is set (then the rest are aborted: leaving aborts them)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(group: SampleGroup) -> None:
        try:
            async for out in llm.stream_group(group):
                queue.put_nowait(out)
        except Exception as exc:  # (to the reader)
            queue.put_nowait(exc)
        queue.put_nowait(None)

    pumps = [asyncio.ensure_future(pump(g)) for g in groups]
    stop = asyncio.ensure_future(aborted.wait())
    left = len(pumps)
    try:
        while left:
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return
            item = get.result()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        stop.cancel()
        for task in pumps:
            task.cancel()
