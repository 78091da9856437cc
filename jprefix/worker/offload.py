"""KVOffloader: the bytes of the prefix cache's host tier (the worker side of
`jprefix.core.host_pool`, which decides what moves where).

The host pool is one numpy array per cache component (K, V and, for fp8, their scales),
`[N_host, L, K, B, D]` (scales `[N_host, L, K, B]`): block-major, so one host block holds
all layers contiguously and a save or load of a block is one contiguous row on the host.
The device cache stays `[L, K, N, B, D]`; each step's moves are one gather (saves) or one
scatter (loads) per component over all of that step's blocks, padded to a power of two
(padding reads and writes the null block 0), so compiles stay bounded.

Never on the critical path: every move is queued on the runner's launch thread in
dispatch order (`ModelRunner.update_kv_cache`), so nothing on the host waits for the
device. Saves gather before the step (it may reuse the blocks) into `pinned_host` memory
where the device offers that memory kind (a DMA the device runs asynchronously; JAX
cannot update a pinned host buffer in place, so the host pool itself is pageable numpy),
and a writer thread copies the bytes into the pool (off the engine's thread; a load or a
save to disk of a slot still being written waits for it). Loads are put
on the device as soon as they are decided and scattered into the cache after the step,
which the sequence waits for in the scheduler. Under tensor parallelism the gather and
scatter run under the cache's sharding: each device moves its own kv heads.
"""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

KVCache = tuple[jax.Array, ...]


@dataclass
class OffloadStats:
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    save_copy_s: float = 0.0  # writer-thread seconds copying saves into the host pool
    load_copy_s: float = 0.0  # engine-thread seconds staging loads (host rows -> device)

    @property
    def copy_s(self) -> float:
        return self.save_copy_s + self.load_copy_s


@partial(jax.jit, static_argnums=())
def gather_blocks(cache: KVCache, blocks: jax.Array) -> KVCache:
    """Per component, the blocks `blocks` [n] as [n, L, K, B, (D)]."""
    return tuple(jnp.moveaxis(c[:, :, blocks], 2, 0) for c in cache)


@partial(jax.jit, donate_argnums=0)
def scatter_blocks(cache: KVCache, blocks: jax.Array, data: KVCache) -> KVCache:
    """Writes data [n, L, K, B, (D)] per component into blocks `blocks` [n] of cache."""
    return tuple(c.at[:, :, blocks].set(jnp.moveaxis(d, 0, 2).astype(c.dtype))
                 for c, d in zip(cache, data, strict=True))


def _padded(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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
        self.host = tuple(np.zeros((num_slots, c.shape[0], c.shape[1], *c.shape[3:]), c.dtype)
                          for c in cache)
        self.block_bytes = sum(h[0].nbytes for h in self.host)
        self._device_shardings = tuple(_moved_sharding(c.sharding) for c in cache)
        self._host_shardings = tuple(_pinned(s) for s in self._device_shardings)
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
        """Queues a step's saves (block, slot) now and returns the loads' scatter, to be
        queued after the step (`after_step`). Waits only when a load reads a slot whose
        save is still being written (evicted and matched again within a step or two)."""
        while self._writes and self._writes[0][1].done():
            self._writes.popleft()[1].result()  # (raises a failed write's error)
        if saves:
            self._queue_saves(saves)
        if not loads:
            return None
        if any(slot in slots for slots, _ in self._writes for slot, _ in loads):
            self.flush()
        return self._stage_loads(loads)

    def after_step(self, staged: Any) -> None:
        if staged is None:
            return
        blocks, data = staged
        self.runner.update_kv_cache(lambda cache: scatter_blocks(cache, blocks, data))

    def _queue_saves(self, saves: list[tuple[int, int]]) -> None:
        """The gather goes on the launch thread (before the step); the bytes are written
        into the host pool by the writer thread, in queue order (a slot reused later is
        written later), off the engine's thread."""
        n = _padded(len(saves))
        blocks = np.zeros(n, np.int32)
        blocks[:len(saves)] = [b for b, _ in saves]
        slots = np.array([s for _, s in saves], np.int64)
        gathered: concurrent.futures.Future = concurrent.futures.Future()

        def gather(cache: KVCache) -> KVCache:
            try:
                out = tuple(jax.device_put(x, s) if s is not None else x for x, s in
                            zip(gather_blocks(cache, blocks), self._host_shardings,
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
                h[slots] = np.asarray(x)[:len(slots)]
            self.stats.save_copy_s += time.perf_counter() - t0

        self.runner.update_kv_cache(gather)
        self._writes.append((set(slots.tolist()), self._writer.submit(write)))
        self.stats.bytes_to_host += len(saves) * self.block_bytes

    def flush(self) -> None:
        """Waits until every queued save is in the host pool."""
        while self._writes:
            self._writes.popleft()[1].result()

    def _stage_loads(self, loads: list[tuple[int, int]]) -> tuple[np.ndarray, KVCache]:
        t0 = time.perf_counter()
        n = _padded(len(loads))
        slots = np.array([s for s, _ in loads] + [loads[0][0]] * (n - len(loads)), np.int64)
        blocks = np.zeros(n, np.int32)  # padding rewrites the null block
        blocks[:len(loads)] = [b for _, b in loads]
        data = tuple(jax.device_put(h[slots], s)
                     for h, s in zip(self.host, self._device_shardings, strict=True))
        self.stats.load_copy_s += time.perf_counter() - t0
        self.stats.bytes_to_device += len(loads) * self.block_bytes
        return blocks, data

    def read(self, slots: list[int]) -> tuple[np.ndarray, ...]:
        """The host pool's rows for slots (a save to disk), pending saves applied first."""
        self.flush()
        return tuple(h[slots] for h in self.host)

    def write(self, slots: list[int], data: tuple[np.ndarray, ...]) -> None:
        """Fills host slots (a load from disk)."""
        self.flush()
        for h, d in zip(self.host, data, strict=True):
            h[slots] = d



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
