"""HostRows: the host tier's block storage, in the device's pinned host memory where it
offers that memory kind, with copies spread over host threads.

Why pinned: a host -> device copy from pageable memory goes through the driver's bounce
buffers at a fifth of what the link carries, and a copy into pageable memory is slower
still (docs/PERF.md, the host tier). JAX allocates pinned memory (`pinned_host` memory
kind) but treats arrays as immutable, so each pinned array here is written through a
NumPy view of its buffer (`unsafe_buffer_pointer`): the array only keeps the memory
alive, and nothing in JAX reads it while a view writes (the owner orders copies).

Rows are `[row_shape]` blocks (all layers of one cache component), stored in chunks of
about `chunk_bytes` allocated on first use, so an unused tier costs no memory and no
start-up time. Where pinned memory is absent (or under tensor parallelism, whose loads
land sharded over several devices) the chunks are plain NumPy arrays.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from typing import Any

import jax
import numpy as np

# Row copies run side by side on up to this many threads (a load's gather is host-bound;
# GPU hosts have 16 or more cores).
_COPY_THREADS = max(1, min(16, os.cpu_count() or 1))


def pinned_array(shape: tuple[int, ...], dtype: Any, sharding: Any
                 ) -> tuple[jax.Array, np.ndarray]:
    """A pinned host array and a writable NumPy view of its buffer."""
    arr = jax.device_put(np.zeros(shape, dtype), sharding)
    arr.block_until_ready()
    buf = (ctypes.c_ubyte * arr.nbytes).from_address(arr.unsafe_buffer_pointer())
    return arr, np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)


def pinned_works(sharding: Any, device_sharding: Any) -> bool:
    """Whether a write through a pinned array's view reaches the device (else: pageable)."""
    if sharding is None:
        return False
    try:
        arr, view = pinned_array((4, 8), np.float32, sharding)
        view[2] = 7.0
        back = np.asarray(jax.device_put(arr, device_sharding))
        return bool((back[2] == 7.0).all() and (back[[0, 1, 3]] == 0).all())
    except Exception:  # noqa: BLE001 (any failure means: use pageable memory)
        return False


class HostRows:
    """`num_rows` rows of `row_shape`/`dtype`; `pinned` is the pinned-host sharding to
    allocate chunks with, or None for NumPy chunks; chunks of `per_chunk` rows, or of as
    many as `chunk_bytes` holds. Thread-safe for disjoint rows."""

    def __init__(self, num_rows: int, row_shape: tuple[int, ...], dtype: Any,
                 pinned: Any = None, chunk_bytes: int = 1 << 30, per_chunk: int | None = None):
        self.row_shape, self.dtype, self.pinned = tuple(row_shape), np.dtype(dtype), pinned
        row_bytes = max(1, int(np.prod(self.row_shape)) * self.dtype.itemsize)
        self.per_chunk = max(1, min(num_rows, per_chunk or chunk_bytes // row_bytes))
        self.num_rows = num_rows
        self._chunks: list[np.ndarray | None] = [None] * -(-num_rows // self.per_chunk)
        self._arrays: list[jax.Array | None] = [None] * len(self._chunks)  # (pinned: the
        # arrays behind the views, which a device program may read rows from)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.num_rows

    @property
    def nbytes(self) -> int:
        """Bytes of all rows (allocated or not): the most this storage holds."""
        return self.num_rows * int(np.prod(self.row_shape)) * self.dtype.itemsize

    def _chunk(self, c: int) -> np.ndarray:
        chunk = self._chunks[c]
        if chunk is None:
            with self._lock:
                chunk = self._chunks[c]
                if chunk is None:
                    rows = min(self.per_chunk, self.num_rows - c * self.per_chunk)
                    shape = (rows, *self.row_shape)
                    if self.pinned is None:
                        chunk = np.zeros(shape, self.dtype)
                    else:
                        self._arrays[c], chunk = pinned_array(shape, self.dtype, self.pinned)
                    self._chunks[c] = chunk
        return chunk

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def chunk_array(self, c: int) -> jax.Array:
        """The pinned array of chunk c (allocated if new; pinned storage only): a device
        program reads its rows straight from pinned memory."""
        self._chunk(c)
        return self._arrays[c]

    def _row(self, slot: int) -> np.ndarray:
        return self._chunk(slot // self.per_chunk)[slot % self.per_chunk]

    def read_into(self, slots: np.ndarray, out: np.ndarray) -> None:
        """out[i] = row slots[i], for i < len(slots)."""
        def copy(i: int, part: Any) -> None:
            out[i][part] = self._row(int(slots[i]))[part]
        _spread(copy, len(slots), self.row_shape)

    def write_from(self, slots: np.ndarray, data: np.ndarray) -> None:
        """Row slots[i] = data[i]."""
        def copy(i: int, part: Any) -> None:
            self._row(int(slots[i]))[part] = data[i][part]
        _spread(copy, len(slots), self.row_shape)

    def rows(self, slots: list[int] | np.ndarray) -> np.ndarray:
        """A new NumPy array of rows slots."""
        slots = np.asarray(slots, np.int64)
        out = np.empty((len(slots), *self.row_shape), self.dtype)
        self.read_into(slots, out)
        return out


_copier = concurrent.futures.ThreadPoolExecutor(_COPY_THREADS, "jprefix-host-copy")


def _spread(copy: Any, n: int, row_shape: tuple[int, ...]) -> None:
    """Runs copy(i, part) for every row i < n and part of it, in up to _COPY_THREADS ranges
    side by side (NumPy releases the GIL for these copies). A part is the whole row
    (Ellipsis), or where n < _COPY_THREADS a slice of the row's first axis (contiguous), so
    that a copy of a few large rows (a piece of a load) still uses every thread."""
    splits = max(1, min(row_shape[0] if row_shape else 1, _COPY_THREADS // max(1, n)))
    units = [(i, ...) for i in range(n)] if splits == 1 else [
        (i, slice(row_shape[0] * j // splits, row_shape[0] * (j + 1) // splits))
        for i in range(n) for j in range(splits)]

    def run(lo: int, hi: int) -> None:
        for i, part in units[lo:hi]:
            copy(i, part)

    parts = min(_COPY_THREADS, len(units))
    if parts <= 1:
        run(0, len(units))
        return
    bounds = [len(units) * i // parts for i in range(parts + 1)]
    for f in [_copier.submit(run, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]:
        f.result()
