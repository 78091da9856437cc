"""The prefix cache saved on disk (`LLM.save_prefix_cache`, `prefix_cache_path`).

Layout: a magic line, an 8-byte little-endian header length, the JSON header, then the
payload: parent index per entry (int64 [n], -1 under a root), salt index per entry
(int64 [n], into the header's `salts`), the tokens (int64 [n, B]), and each cache
component's blocks ([n, L, K, B, (D)], the host pool's row layout). The header names the
model, its dtype, the KV dtype, the block size, the tensor-parallel size, the components'
dtypes and per-block shapes, and the payload's size and SHA-256. A file whose header does
not match the engine, whose payload is shorter or longer, or whose checksum differs is
refused with a ValueError naming what differs, before anything is loaded.

Entries are in parents-first order; an entry's parent is in the file (blocks whose
ancestors are in neither tier are not saved: nothing could reach them).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"JPREFIXKV1\n"
FORMAT_VERSION = 1


def identity(engine: Any) -> dict[str, Any]:
    """What a file must match to load into `engine` (an LLMEngine)."""
    args, cache = engine.args, engine.runner.kv_cache
    leaves = [x for x in _leaves(engine.model.params) if hasattr(x, "dtype")]
    return {"model": engine.model.name, "dtype": str(leaves[0].dtype) if leaves else "",
            "kv_cache_dtype": str(cache[0].dtype), "block_size": args.block_size,
            "tensor_parallel_size": args.tensor_parallel_size,
            "components": [[str(c.dtype), [c.shape[0], c.shape[1], *c.shape[3:]]]
                           for c in cache]}


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(tree)


def save(path: str | Path, ident: dict[str, Any], entries: list[tuple[int, int, tuple]],
         salts: list[str | None], data: tuple[np.ndarray, ...]) -> int:
    """Writes entries (parent index, salt index, tokens) and their blocks' data (per
    component, one row per entry); returns the number of blocks written."""
    n = len(entries)
    parents = np.array([e[0] for e in entries], np.int64)
    salt_ids = np.array([e[1] for e in entries], np.int64)
    tokens = np.array([e[2] for e in entries], np.int64).reshape(n, ident["block_size"])
    chunks = [parents.tobytes(), salt_ids.tobytes(), tokens.tobytes()]
    chunks += [np.ascontiguousarray(d).tobytes() for d in data]
    digest = hashlib.sha256()
    for c in chunks:
        digest.update(c)
    header = dict(ident, format_version=FORMAT_VERSION, num_blocks=n, salts=salts,
                  payload_bytes=sum(map(len, chunks)), sha256=digest.hexdigest())
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(raw)) + raw)
        for c in chunks:
            f.write(c)
    return n


def read_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """The header and the payload's offset; ValueError for a file that is not one."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"prefix cache file {path}: not a jprefix prefix cache file")
        size = f.read(8)
        if len(size) < 8:
            raise ValueError(f"prefix cache file {path}: truncated header")
        (length,) = struct.unpack("<Q", size)
        raw = f.read(length)
    if len(raw) != length:
        raise ValueError(f"prefix cache file {path}: truncated header")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"prefix cache file {path}: the header is not JSON ({exc})") from None
    return header, len(MAGIC) + 8 + length


def load(path: str | Path, ident: dict[str, Any]
         ) -> tuple[list[tuple[int, int, tuple]], list[str | None], tuple[np.ndarray, ...]]:
    """Reads and checks a file against the engine's `ident`; returns (entries, salts,
    data) as `save` took them. Raises ValueError naming the mismatch, loading nothing."""
    header, offset = read_header(path)
    if header.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"prefix cache file {path}: format_version "
                         f"{header.get('format_version')!r} is not {FORMAT_VERSION}")
    for key, want in ident.items():
        if header.get(key) != want:
            raise ValueError(f"prefix cache file {path}: {key} {header.get(key)!r} does not "
                             f"match the engine's {want!r}")
    payload = Path(path).read_bytes()[offset:]
    if len(payload) != header["payload_bytes"]:
        raise ValueError(f"prefix cache file {path}: payload of {len(payload)} bytes, the "
                         f"header says {header['payload_bytes']} (truncated or extended)")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise ValueError(f"prefix cache file {path}: checksum mismatch (the file was altered)")
    n, B = header["num_blocks"], header["block_size"]
    parts, at = [], 0
    for dtype, shape in [("int64", [n]), ("int64", [n]), ("int64", [n, B])] + [
            (d, [n, *s]) for d, s in header["components"]]:
        count = int(np.prod(shape))
        dt = np.dtype(_np_dtype(dtype))
        parts.append(np.frombuffer(payload, dt, count, at).reshape(shape))
        at += count * dt.itemsize
    parents, salt_ids, tokens, *data = parts
    entries = [(int(p), int(s), tuple(int(t) for t in row))
               for p, s, row in zip(parents, salt_ids, tokens, strict=True)]
    return entries, header["salts"], tuple(data)


def _np_dtype(name: str) -> Any:
    import ml_dtypes  # noqa: F401  (registers the fp8 dtypes with numpy)

    return getattr(ml_dtypes, name, None) or name
