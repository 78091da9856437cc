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
pool. Loads are gathered on a loader thread into pinned staging arrays in up to
`LOAD_PIECES` pieces (one staging array per piece shape, piece index and component, reused
once its last copy has finished; outside the tier's size, bounded by the largest step's
loads), each piece put on the device (one DMA per component) as soon as it is gathered, so
that the host gather of a piece, the slower side, runs while the previous piece's DMA does;
the pieces are joined and scattered into the cache after a step (the engine's KVTier
queues the scatter once the copy is done). The sequence waits in the scheduler
meanwhile, and a load reading a slot whose save is still being written waits for it on
the loader thread.
Under tensor parallelism the gather and scatter run under the cache's sharding (each
device moves its own kv heads) and the pool is pageable NumPy.
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

from jprefix.worker.host_rows import HostRows, pinned_array, pinned_works

KVCache = tuple[jax.Array, ...]
# A load's pieces (at most; a padded load of n blocks, a power of two, splits into
# min(LOAD_PIECES, n) equal pieces): more pieces overlap more of the host gather with the
# DMAs, at one more staging array, DMA and scatter operand per piece (chosen with
# `scripts/bench_offload.py --load-pieces`; docs/PERF.md).
LOAD_PIECES = 2


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
def scatter_blocks(cache: KVCache, blocks: jax.Array, data: tuple[Any, ...]) -> KVCache:
    """Writes data per component into blocks `blocks` [n] of cache: one array
    [n, L, K, B, (D)], or a tuple of pieces [n_i, L, K, B, (D)] (sum n_i = n, rows in
    order) joined here, so the compile is keyed on n and the piece count."""
    return tuple(c.at[:, :, blocks].set(jnp.moveaxis(_joined(d), 0, 2).astype(c.dtype))
                 for c, d in zip(cache, data, strict=True))


def _joined(d: Any) -> jax.Array:
    return jnp.concatenate(d, axis=0) if isinstance(d, (tuple, list)) else d


def _pieces(n: int) -> tuple[int, int]:
    """A padded load of n blocks as (pieces, blocks per piece)."""
    pieces = min(LOAD_PIECES, n)
    return pieces, n // pieces


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
        self._device_shardings = tuple(_moved_sharding(c.sharding) for c in cache)
        self._host_shardings = tuple(_pinned(s) for s in self._device_shardings)
        one_device = all(len(c.sharding.device_set) == 1 for c in cache)
        pinned = (self._host_shardings[0] if one_device and pinned_works(
            self._host_shardings[0], self._device_shardings[0]) else None)
        self.pinned = pinned is not None
        self.host = tuple(HostRows(num_slots, (c.shape[0], c.shape[1], *c.shape[3:]), c.dtype,
                                   pinned) for c in cache)
        self.block_bytes = sum(int(np.prod(h.row_shape)) * h.dtype.itemsize for h in self.host)
        # saves being written into the host pool: (their slots, the writer's future)
        self._writes: deque[tuple[set[int], concurrent.futures.Future]] = deque()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "jprefix-offload")
        self._loader = concurrent.futures.ThreadPoolExecutor(1, "jprefix-onload")
        weakref.finalize(self, self._writer.shutdown, wait=False)
        weakref.finalize(self, self._loader.shutdown, wait=False)
        # per (rows of a piece, piece index): pinned staging arrays, their views, the last
        # copy out of them (loads of different sizes share those of the same piece shape)
        self._staging: dict[tuple[int, int],
                            tuple[tuple[jax.Array, ...], tuple[np.ndarray, ...]]] = {}
        self._staged_last: dict[tuple[int, int], Any] = {}
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
        """Queues a step's saves (block, slot) now and starts its loads' host -> device
        copies on the loader thread; returns what `after_step` scatters after the step.
        Nothing here waits: a load that reads a slot whose save is still being written
        waits for that write on the loader thread."""
        while self._writes and self._writes[0][1].done():
            self._writes.popleft()[1].result()  # (raises a failed write's error)
        if saves:
            self._queue_saves(saves)
        if not loads:
            return None
        slots = {slot for slot, _ in loads}
        pending = [f for written, f in self._writes if written & slots]
        return self._stage_loads(loads, pending)

    def after_step(self, staged: Any) -> None:
        """Queues the loads' scatter on the launch thread, after the step (which waits
        there for the loader thread's copies, not on the engine thread)."""
        if staged is None:
            return
        blocks, data = staged
        self.runner.update_kv_cache(lambda cache: scatter_blocks(cache, blocks, data.result()))

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
                h.write_from(slots, np.asarray(x))
            self.stats.save_copy_s += time.perf_counter() - t0

        self.runner.update_kv_cache(gather)
        self._writes.append((set(slots.tolist()), self._writer.submit(write)))
        self.stats.bytes_to_host += len(saves) * self.block_bytes

    def compile_moves(self, max_blocks: int) -> None:
        """Compiles the gather and the scatter (of a load's pieces, as `_load` puts them)
        for every padded size up to `max_blocks` (queued on the launch thread; they move
        the null block 0 onto itself), so that a measured run or a server's first requests
        do not pay for them mid-step."""
        def move(cache: KVCache, blocks: np.ndarray) -> KVCache:
            pieces, m = _pieces(len(blocks))
            data = tuple(tuple(jax.device_put(x[p * m:(p + 1) * m], s) for p in range(pieces))
                         for x, s in zip(gather_blocks(cache, blocks), self._device_shardings,
                                         strict=True))
            return scatter_blocks(cache, blocks, data)

        for n in (1 << i for i in range(_padded(max(1, max_blocks)).bit_length())):
            self.runner.update_kv_cache(partial(move, blocks=np.zeros(n, np.int32)))

    def flush(self) -> None:
        """Waits until every queued save is in the host pool."""
        while self._writes:
            self._writes.popleft()[1].result()

    def _stage_loads(self, loads: list[tuple[int, int]], pending: list[Any]
                     ) -> tuple[np.ndarray, concurrent.futures.Future]:
        n = _padded(len(loads))
        slots = np.array([s for s, _ in loads] + [loads[0][0]] * (n - len(loads)), np.int64)
        blocks = np.zeros(n, np.int32)  # padding rewrites the null block
        blocks[:len(loads)] = [b for _, b in loads]
        self.stats.bytes_to_device += len(loads) * self.block_bytes
        return blocks, self._loader.submit(self._load, slots, len(loads), pending)

    def _load(self, slots: np.ndarray, real: int, pending: list[Any]
              ) -> tuple[tuple[jax.Array, ...], ...]:
        """(loader thread) The host rows `slots` (a padded load, its first `real` rows
        wanted) on the device: per component, a tuple of its pieces' arrays in order
        (`_pieces`). Each piece's copies start (asynchronously) before the next piece is
        gathered, so they overlap."""
        for f in pending:
            f.result()
        t0 = time.perf_counter()
        n = len(slots)
        pieces, m = _pieces(n)
        out = [self._put_piece((m, p), slots[p * m:(p + 1) * m], real - p * m)
               for p in range(pieces)]
        self.stats.load_copy_s += time.perf_counter() - t0
        return tuple(zip(*out, strict=True))

    def _put_piece(self, key: tuple[int, int], slots: np.ndarray, real: int
                   ) -> tuple[jax.Array, ...]:
        """(loader thread) The rows `slots` on the device, one copy per component: gathered
        into the pinned staging arrays of `key` (reused once their last copy is done) and
        put from there, or put from NumPy without pinned memory. Rows from `real` on are
        padding (scattered into the null block): not gathered, the staging's stale rows go."""
        if not self.pinned:
            return tuple(jax.device_put(h.rows(slots), s)
                         for h, s in zip(self.host, self._device_shardings, strict=True))
        if key not in self._staging:
            self._staging[key] = tuple(zip(*(pinned_array((len(slots), *h.row_shape), h.dtype, p)
                                             for h, p in zip(self.host, self._host_shardings,
                                                             strict=True)), strict=True))
        arrays, views = self._staging[key]
        if key in self._staged_last:  # its previous copy must have read the staging
            jax.block_until_ready(self._staged_last[key])
        for h, v in zip(self.host, views, strict=True):
            h.read_into(slots[:max(0, real)], v)
        data = tuple(jax.device_put(a, s)
                     for a, s in zip(arrays, self._device_shardings, strict=True))
        self._staged_last[key] = data
        return data

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
