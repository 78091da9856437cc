"""The host tier's loads (host pool rows -> HBM blocks), in two ways; `KVOffloader` holds
both and uses one (`KVOffloader.in_stream`).

In-stream (`InStreamLoads`, where the pool is pinned; the default): a step's loads are
programs per pool chunk they read (`program_sizes`), queued on the launch thread before
the step, that copy each row straight out of the pinned chunk (XLA turns a dynamic-slice
of a host-memory operand into an asynchronous copy: no host gather, no staging) and
scatter it into the cache, so the step that follows reads the blocks and their sequences
prefill in that very step. A load reading a slot whose save is still being written waits
for it on the launch thread; a save's write into a slot that a queued load still reads
cannot overtake it, because the write waits for its own gather, which the device runs
after every program queued before it.

Staged (`StagedLoads`: pageable pools, tensor parallelism, or JPREFIX_HOST_LOADS=staged):
the rows are gathered on a loader thread into pinned staging arrays in up to
`LOAD_PIECES` pieces (one staging array per piece shape, piece index and component,
reused once its last copy has finished), each piece put on the device as soon as it is
gathered so that a piece's host gather overlaps the previous piece's DMA; the pieces are
joined and scattered into the cache after a later step, once the copy is done (the
engine's KVTier queues the scatter), and the sequence waits in the scheduler meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
import weakref
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jprefix.worker.host_rows import pinned_array

KVCache = tuple[jax.Array, ...]
# JPREFIX_HOST_LOADS=staged: staged loads even where the pool is pinned (to compare)
IN_STREAM_LOADS = os.environ.get("JPREFIX_HOST_LOADS", "in_stream") != "staged"
# The most rows one in-stream program copies (its copies are unrolled: this bounds a
# compile).
IN_STREAM_ROWS = 256
# A staged load's pieces (at most; a padded load of n blocks, a power of two, splits into
# min(LOAD_PIECES, n) equal pieces): more pieces overlap more of the host gather with the
# DMAs, at one more staging array, DMA and scatter operand per piece (chosen with
# `scripts/bench_offload.py --load-pieces`; docs/PERF.md).
LOAD_PIECES = 2


def padded(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@jax.jit
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


def _load_rows(cache: KVCache, chunks: tuple[jax.Array, ...], rows: jax.Array,
               blocks: jax.Array, moved: tuple[Any, ...]) -> KVCache:
    """Writes rows `rows` [n] of each component's pinned chunk (`chunks`, [R, L, K, B,
    (D)] in host memory) into blocks `blocks` [n] of cache (a block past its end: the
    write is dropped): one copy per row, each moved to the device (`moved`: the device
    sharding of a gathered [n, ...] array)."""
    out = []
    for c, h, s in zip(cache, chunks, moved, strict=True):
        data = jnp.concatenate([jax.device_put(lax.dynamic_slice_in_dim(h, rows[i], 1), s)
                                for i in range(rows.shape[0])])
        out.append(c.at[:, :, blocks].set(jnp.moveaxis(data, 0, 2).astype(c.dtype),
                                          mode="drop"))
    return tuple(out)


def program_sizes(n: int, max_rows: int) -> list[int]:
    """How n rows of one chunk split over in-stream programs: powers of two (the sizes
    `InStreamLoads.compile` compiles) of at most max_rows (a power of two), largest
    first. A padding row is a real copy, so the rest is padded up to a power of two only
    where that copies at most an eighth more rows than it holds (37 rows: 32 + 4 + 1, not
    64; 255: 256, one row padded), else split further: the bytes moved stay within
    1/8 of the bytes wanted, in at most log2(max_rows) + 1 programs past the full ones."""
    sizes = []
    while n >= max_rows:
        sizes.append(max_rows)
        n -= max_rows
    while n > 0:
        p = padded(n)
        if (p - n) * 8 <= n:
            return sizes + [p]
        sizes.append(p // 2)
        n -= p // 2
    return sizes


def in_stream_works(host_sharding: Any, device_sharding: Any) -> bool:
    """Whether a program copies rows out of a pinned array here as `_load_rows` does (a
    construction check, as `pinned_works`; else loads are staged)."""
    try:
        chunk, view = pinned_array((4, 1, 1, 2, 4), np.float32, host_sharding)
        view[...] = np.arange(32, dtype=np.float32).reshape(view.shape) + 1
        cache = (jax.device_put(np.zeros((1, 1, 3, 2, 4), np.float32), device_sharding),)
        (out,) = jax.jit(partial(_load_rows, moved=(device_sharding,)))(
            cache, (chunk,), np.array([2, 0], np.int32), np.array([1, 3], np.int32))
        want = np.zeros((1, 1, 3, 2, 4), np.float32)
        want[:, :, 1] = view[2]
        return bool(np.array_equal(np.asarray(out), want))
    except Exception:  # noqa: BLE001 (any failure means: stage the loads)
        return False


class InStreamLoads:
    """In-stream loads of `off`'s pinned pool (module docstring)."""

    def __init__(self, off: Any):
        self.off = off
        self._fn = jax.jit(partial(_load_rows, moved=off.device_shardings), donate_argnums=0)

    def start(self, loads: list[tuple[int, int]], pending: list[Any]) -> None:
        """Queues the (slot, block) loads before the step: per pool chunk read, programs
        of `program_sizes` rows (a padded program's padding copies the part's first row
        to a block past the cache's end)."""
        off = self.off
        per, past = off.host[0].per_chunk, off.runner.kv_cache[0].shape[2]
        groups: dict[int, list[tuple[int, int]]] = {}
        for slot, block in loads:
            groups.setdefault(slot // per, []).append((slot % per, block))
        calls = []
        for c, rows in sorted(groups.items()):
            lo = 0
            for size in program_sizes(len(rows), IN_STREAM_ROWS):
                part, lo = rows[lo:lo + size], lo + size
                idx = np.full(size, part[0][0], np.int32)
                blocks = np.full(size, past, np.int32)
                idx[:len(part)], blocks[:len(part)] = zip(*part, strict=True)
                calls.append((tuple(h.chunk_array(c) for h in off.host), idx, blocks))

        def load(cache: KVCache) -> KVCache:
            t0 = time.perf_counter()
            for f in pending:  # (rare: a slot saved and read again within a few steps)
                f.result()
            for chunks, idx, blocks in calls:
                cache = self._fn(cache, chunks, idx, blocks)
            off.stats.load_copy_s += time.perf_counter() - t0
            return cache

        off.runner.update_kv_cache(load)

    def compile(self, n: int) -> None:
        """Compiles the program of n rows (for the first and the last chunk, which may be
        shorter); writes nothing (every block past the cache's end)."""
        off = self.off
        if n > IN_STREAM_ROWS:
            return

        def load(cache: KVCache) -> KVCache:
            rows, past = np.zeros(n, np.int32), np.full(n, cache[0].shape[2], np.int32)
            for c in sorted({0, off.host[0].num_chunks - 1}):
                cache = self._fn(cache, tuple(h.chunk_array(c) for h in off.host), rows, past)
            return cache

        off.runner.update_kv_cache(load)


class StagedLoads:
    """Staged loads of `off`'s pool (module docstring)."""

    def __init__(self, off: Any):
        self.off = off
        self._loader = concurrent.futures.ThreadPoolExecutor(1, "jprefix-onload")
        weakref.finalize(self, self._loader.shutdown, wait=False)
        # per (rows of a piece, piece index): pinned staging arrays, their views
        self._staging: dict[tuple[int, int],
                            tuple[tuple[jax.Array, ...], tuple[np.ndarray, ...]]] = {}
        self._staged_last: dict[tuple[int, int], Any] = {}  # the last copy out of them

    def start(self, loads: list[tuple[int, int]], pending: list[Any]
              ) -> tuple[np.ndarray, concurrent.futures.Future]:
        """Starts the copies on the loader thread: (blocks, the future of the pieces)."""
        n = padded(len(loads))
        slots = np.array([s for s, _ in loads] + [loads[0][0]] * (n - len(loads)), np.int64)
        blocks = np.zeros(n, np.int32)  # padding rewrites the null block
        blocks[:len(loads)] = [b for _, b in loads]
        return blocks, self._loader.submit(self._load, slots, len(loads), pending)

    def land(self, staged: tuple[np.ndarray, concurrent.futures.Future]) -> None:
        """Queues the scatter on the launch thread, after the step dispatched last."""
        blocks, data = staged
        self.off.runner.update_kv_cache(
            lambda cache: scatter_blocks(cache, blocks, data.result()))

    def compile(self, n: int) -> None:
        """Compiles the scatter of a padded load of n blocks in its pieces (moving the
        null block 0 onto itself)."""
        def move(cache: KVCache) -> KVCache:
            blocks = np.zeros(n, np.int32)
            pieces, m = _pieces(n)
            data = tuple(tuple(jax.device_put(x[p * m:(p + 1) * m], s) for p in range(pieces))
                         for x, s in zip(gather_blocks(cache, blocks),
                                         self.off.device_shardings, strict=True))
            return scatter_blocks(cache, blocks, data)

        self.off.runner.update_kv_cache(move)

    def _load(self, slots: np.ndarray, real: int, pending: list[Any]
              ) -> tuple[tuple[jax.Array, ...], ...]:
        """(loader thread) The host rows `slots` (a padded load, its first `real` rows
        wanted) on the device: per component, a tuple of its pieces' arrays in order.
        Each piece's copies start (asynchronously) before the next piece is gathered."""
        for f in pending:
            f.result()
        t0 = time.perf_counter()
        pieces, m = _pieces(len(slots))
        out = [self._put_piece((m, p), slots[p * m:(p + 1) * m], real - p * m)
               for p in range(pieces)]
        self.off.stats.load_copy_s += time.perf_counter() - t0
        return tuple(zip(*out, strict=True))

    def _put_piece(self, key: tuple[int, int], slots: np.ndarray, real: int
                   ) -> tuple[jax.Array, ...]:
        """(loader thread) The rows `slots` on the device, one copy per component: gathered
        into the pinned staging arrays of `key` (reused once their last copy is done) and
        put from there, or put from NumPy without pinned memory. Rows from `real` on are
        padding (scattered into the null block): not gathered, the staging's stale rows go."""
        off = self.off
        if not off.pinned:
            return tuple(jax.device_put(h.rows(slots), s)
                         for h, s in zip(off.host, off.device_shardings, strict=True))
        if key not in self._staging:
            self._staging[key] = tuple(zip(*(pinned_array((len(slots), *h.row_shape), h.dtype, p)
                                             for h, p in zip(off.host, off.host_shardings,
                                                             strict=True)), strict=True))
        arrays, views = self._staging[key]
        if key in self._staged_last:  # its previous copy must have read the staging
            jax.block_until_ready(self._staged_last[key])
        for h, v in zip(off.host, views, strict=True):
            h.read_into(slots[:max(0, real)], v)
        data = tuple(jax.device_put(a, s)
                     for a, s in zip(arrays, off.device_shardings, strict=True))
        self._staged_last[key] = data
        return data


def _pieces(n: int) -> tuple[int, int]:
    """A padded load of n blocks as (pieces, blocks per piece)."""
    pieces = min(LOAD_PIECES, n)
    return pieces, n // pieces
