"""KVOffloader: the bytes of the prefix cache's host tier (the worker side of
`jprefix.core.host_pool`, which decides what moves where).

The host pool is one `HostRows` per cache component (K, V and, for fp8, their scales) of
`[N_host, L, K, B, D]` rows (scales `[N_host, L, K, B]`): block-major, so one host block
holds all layers contiguously and a save or load of a block is one contiguous row on the
host; the rows live in the device's pinned host memory where it offers that memory kind
on one device (`jprefix.worker.host_rows`). The device cache stays `[L, K, N, B, D]`; each
step's moves are one gather (saves) or one scatter (loads) per component over all of that
step's blocks, padded to a power of two (padding reads and writes the null block 0), so
compiles stay bounded.

Never on the critical path: every device-side move is queued on the runner's launch
thread in dispatch order (`ModelRunner.update_kv_cache`), and every host-side copy runs on
a thread of its own. Saves gather before the step (it may reuse the blocks) into pinned
memory (a DMA the device runs asynchronously) and a writer thread copies the rows into the
pool. Loads copy the rows straight from the pinned pool in the step's stream, before the
step, or are staged through pinned memory and land after a later step
(`jprefix.worker.host_loads`).
Under tensor parallelism the gather and scatter run under the cache's sharding (each
device moves its own kv heads) and the pool is pageable NumPy.
"""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jprefix.worker import host_loads
from jprefix.worker.host_loads import InStreamLoads, StagedLoads, gather_blocks, padded
from jprefix.worker.host_rows import HostRows, pinned_works

KVCache = tuple[jax.Array, ...]
CHUNK_BYTES = 1 << 30  # the pool's pinned allocations (of its largest component)


@dataclass
class OffloadStats:
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    save_copy_s: float = 0.0  # writer-thread seconds copying saves into the host pool
    load_copy_s: float = 0.0  # engine-thread seconds staging loads (host rows -> device)

    @property
    def copy_s(self) -> float:
        return self.save_copy_s + self.load_copy_s


def _moved_sharding(sharding: Any) -> Any:
    """The sharding of a gathered [n, L, K, ...] array from a cache [L, K, N, ...]'s."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * 5
    return NamedSharding(sharding.mesh, PartitionSpec(None, spec[0], spec[1]))


class KVOffloader:
    """Moves blocks between a runner's KV cache and a host pool of `num_slots` blocks."""

    def __init__(self, runner: Any, num_slots: int):
        cache = runner.kv_cache
        self.runner = runner
        self.num_slots = num_slots
        self.device_shardings = tuple(_moved_sharding(c.sharding) for c in cache)
        self.host_shardings = tuple(_pinned(s) for s in self.device_shardings)
        one_device = all(len(c.sharding.device_set) == 1 for c in cache)
        pinned = (self.host_shardings[0] if one_device and pinned_works(
            self.host_shardings[0], self.device_shardings[0]) else None)
        self.pinned = pinned is not None
        shapes = [(c.shape[0], c.shape[1], *c.shape[3:]) for c in cache]
        per_chunk = CHUNK_BYTES // max(int(np.prod(s)) * c.dtype.itemsize
                                       for s, c in zip(shapes, cache, strict=True))
        self.host = tuple(HostRows(num_slots, s, c.dtype, pinned, per_chunk=max(1, per_chunk))
                          for s, c in zip(shapes, cache, strict=True))  # (chunks alike)
        self.block_bytes = sum(int(np.prod(h.row_shape)) * h.dtype.itemsize for h in self.host)
        self.in_stream = (self.pinned and host_loads.IN_STREAM_LOADS and host_loads.
                          in_stream_works(self.host_shardings[0], self.device_shardings[0]))
        self._in_stream, self._staged = InStreamLoads(self), StagedLoads(self)
        # saves being written into the host pool: (their slots, the writer's future)
        self._writes: deque[tuple[set[int], concurrent.futures.Future]] = deque()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "jprefix-offload")
        weakref.finalize(self, self._writer.shutdown, wait=False)
        self.stats = OffloadStats()

    @staticmethod
    def block_bytes_of(runner: Any) -> int:
        """Bytes of one block, all layers and components (and all kv heads)."""
        return sum(c.nbytes // c.shape[2] for c in runner.kv_cache)

    @staticmethod
    def slots_for(runner: Any, size_gib: float) -> int:
        """Host blocks that fit in size_gib GiB (the pool never exceeds it)."""
        return int(size_gib * 2**30) // KVOffloader.block_bytes_of(runner)

    def move(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> Any:
        """Queues a step's saves (block, slot) and its loads (slot, block): in-stream, the
        loads are queued before the step too and None is returned; staged, their copies
        start on the loader thread and `after_step` lands what this returns. Nothing here
        waits: a load that reads a slot whose save is still being written waits for that
        write on the launch (in-stream) or loader (staged) thread."""
        while self._writes and self._writes[0][1].done():
            self._writes.popleft()[1].result()  # (raises a failed write's error)
        if saves:
            self._queue_saves(saves)
        if not loads:
            return None
        slots = {slot for slot, _ in loads}
        pending = [f for written, f in self._writes if written & slots]
        self.stats.bytes_to_device += len(loads) * self.block_bytes
        if self.in_stream:
            return self._in_stream.start(loads, pending)
        return self._staged.start(loads, pending)

    def after_step(self, staged: Any) -> None:
        """Queues a staged load's scatter on the launch thread, after the step (which
        waits there for the loader thread's copies, not on the engine thread)."""
        if staged is not None:
            self._staged.land(staged)

    def _queue_saves(self, saves: list[tuple[int, int]]) -> None:
        """The gather goes on the launch thread (before the step); the bytes are written
        into the host pool by the writer thread, in queue order (a slot reused later is
        written later), off the engine's thread."""
        n = padded(len(saves))
        blocks = np.zeros(n, np.int32)
        blocks[:len(saves)] = [b for b, _ in saves]
        slots = np.array([s for _, s in saves], np.int64)
        gathered: concurrent.futures.Future = concurrent.futures.Future()

        def gather(cache: KVCache) -> KVCache:
            try:
                out = tuple(jax.device_put(x, s) if s is not None else x for x, s in
                            zip(gather_blocks(cache, blocks), self.host_shardings,
                                strict=True))
                for x in out:
                    x.copy_to_host_async()
                gathered.set_result(out)
            except Exception as exc:
                gathered.set_exception(exc)
                raise
            return cache

        def write() -> None:
            data = gathered.result()
            t0 = time.perf_counter()
            for h, x in zip(self.host, data, strict=True):
                h.write_from(slots, np.asarray(x))
            self.stats.save_copy_s += time.perf_counter() - t0

        self.runner.update_kv_cache(gather)
        self._writes.append((set(slots.tolist()), self._writer.submit(write)))
        self.stats.bytes_to_host += len(saves) * self.block_bytes

    def compile_moves(self, max_blocks: int) -> None:
        """Compiles the gather and the loads (of the way in use) for every padded size up
        to `max_blocks` (queued on the launch thread; they write no block's contents), so
        that a measured run does not pay for them mid-step."""
        for n in (1 << i for i in range(padded(max(1, max_blocks)).bit_length())):
            (self._in_stream if self.in_stream else self._staged).compile(n)

    def flush(self) -> None:
        """Waits until every queued save is in the host pool."""
        while self._writes:
            self._writes.popleft()[1].result()

    def read(self, slots: list[int]) -> tuple[np.ndarray, ...]:
        """The host pool's rows for slots (a save to disk), pending saves applied first."""
        self.flush()
        return tuple(h.rows(slots) for h in self.host)

    def write(self, slots: list[int], data: tuple[np.ndarray, ...]) -> None:
        """Fills host slots (a load from disk)."""
        self.flush()
        for h, d in zip(self.host, data, strict=True):
            h.write_from(np.asarray(slots, np.int64), d)


def read_blocks(runner: Any, blocks: list[int]) -> tuple[np.ndarray, ...]:
    """HBM blocks' contents on the host, [n, L, K, B, (D)] per component (a save to disk;
    waits for the steps dispatched so far)."""
    cache = runner.kv_cache
    out = gather_blocks(cache, np.asarray(blocks or [0], np.int32))
    return tuple(np.asarray(x)[:len(blocks)] for x in out)


def _pinned(sharding: Any) -> Any:
    """sharding in the device's pinned host memory, None where that kind is absent."""
    try:
        dev = next(iter(sharding.device_set))
        if "pinned_host" not in {m.kind for m in dev.addressable_memories()}:
            return None
        return sharding.with_memory_kind("pinned_host")
    except (AttributeError, ValueError, NotImplementedError):
        return None
