"""One step's arrays as one flat int32 buffer, and back (one host-to-device transfer).

`flatten_batch` (host) lays the arrays out integer ones first, then float32 ones as their
bit patterns; the `Layout` (static, hashable: it is a static argument of the jitted step)
says where each array sits. `unflatten_batch` is the inverse inside the jitted step;
`flat_views` gives the host's arrays back as views into the buffer (steady decode steps
advance them in place: `jprefix.worker.repack`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Layout = tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) per array
# (dtype.name builds a string on every call; packing asks once per array per step)
_DTYPE_NAMES = {np.dtype(t): np.dtype(t).name for t in (np.int32, np.uint32, np.float32)}


def flatten_batch(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, Layout]:
    """Packs the step's arrays into one int32 buffer (one host-to-device transfer instead
    of one per array, each of which costs host time), float32 arrays as their bit
    patterns after the integer ones; `layout` (static, hashable) splits it again."""
    layout = tuple((k, v.shape, _DTYPE_NAMES.get(v.dtype) or _four_byte_name(k, v))
                   for k, v in batch.items())
    ints = [v.view(np.int32).ravel() for v in batch.values() if v.dtype != np.float32]
    floats = [v.view(np.int32).ravel() for v in batch.values() if v.dtype == np.float32]
    return np.concatenate(ints + floats), layout


def _four_byte_name(name: str, value: np.ndarray) -> str:
    """The dtype name of an array the int32 buffer can carry (its offsets count 4-byte
    elements)."""
    if value.dtype.itemsize != 4:
        raise TypeError(f"step array {name!r} is {value.dtype}: the flat buffer takes "
                        f"4-byte dtypes only")
    return value.dtype.name


class PackedStep(NamedTuple):
    """A packed step: the flat buffer the device receives, its layout, and the step's
    arrays by name (views into the buffer, or the arrays it was built from)."""

    flat: np.ndarray
    layout: Layout
    arrays: dict[str, np.ndarray]


def pack_flat(batch: dict[str, np.ndarray]) -> PackedStep:
    return PackedStep(*flatten_batch(batch), batch)


@functools.lru_cache(maxsize=256)  # (a steady decode step asks for the same layout)
def layout_spans(layout: Layout) -> tuple[tuple[str, tuple[int, ...], str, int, int], ...]:
    """Where `flatten_batch` put each array: (name, shape, dtype, start, size), in layout
    order; the float32 arrays start after all the others."""
    sizes = [(name, shape, dtype, math.prod(shape)) for name, shape, dtype in layout]
    offsets = {False: 0,
               True: sum(size for _, _, dtype, size in sizes if dtype != "float32")}
    spans = []
    for name, shape, dtype, size in sizes:
        is_float = dtype == "float32"
        spans.append((name, shape, dtype, offsets[is_float], size))
        offsets[is_float] += size
    return tuple(spans)


def flat_views(flat: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """The arrays of a `flatten_batch` result as views into its buffer."""
    views = {}
    for name, shape, dtype, start, stop in _view_spans(layout):
        view = flat[start:stop] if dtype is None else flat[start:stop].view(dtype)
        views[name] = view if shape is None else view.reshape(shape)
    return views


@functools.lru_cache(maxsize=256)
def _view_spans(layout: Layout) -> tuple[tuple[str, Any, Any, int, int], ...]:
    """`layout_spans` for `flat_views`: (name, shape or None for 1-D, np.dtype or None
    for int32, start, stop), resolved once per layout so that a steady decode step's
    views skip the dtype-name parsing and the no-op reshapes."""
    return tuple((name, shape if len(shape) != 1 else None,
                  None if dtype == "int32" else np.dtype(dtype), start, start + size)
                 for name, shape, dtype, start, size in layout_spans(layout))


def unflatten_batch(flat: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    """Inverse of `flatten_batch`, inside the jitted step."""
    out = {}
    for name, shape, dtype, start, size in layout_spans(layout):
        part = flat[start : start + size]
        if dtype != "int32":
            part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        out[name] = part.reshape(shape)
    return out
