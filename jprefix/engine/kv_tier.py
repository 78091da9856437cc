"""The engine's host tier of the prefix cache: the host pool (core, what lives where)
wired to the offloader (worker, the bytes), each step's moves, the counters, and the
prefix cache saved to and loaded from disk (`jprefix.engine.prefix_cache_file`)."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from jprefix.core.host_pool import HostPool
from jprefix.core.prefix_cache import PrefixPool
from jprefix.engine import prefix_cache_file
from jprefix.worker.offload import KVOffloader, read_blocks

HOST_COUNTERS = ("num_host_hit_tokens", "host_used_blocks", "host_free_blocks",
                 "host_stored_blocks", "host_dropped_blocks", "host_rejected_blocks",
                 "host_bytes_to_host",
                 "host_bytes_to_device", "host_copy_s")


def host_summary(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The host tier's counters summed over replicas (for /stats; none when it is off)."""
    if not any("host_used_blocks" in r for r in replicas):
        return {}
    return {k: sum(r.get(k, 0) for r in replicas) for k in HOST_COUNTERS}


class KVTier:
    """One replica's host tier: `num_slots` host blocks beside `runner`'s cache."""

    def __init__(self, runner: Any, num_slots: int, block_size: int):
        if getattr(runner, "channel", None) is not None:
            raise ValueError("kv_offloading_size > 0 is not supported in a multi-process "
                             "run (the other processes would not move their blocks)")
        if num_slots < 1:
            raise ValueError(f"kv_offloading_size holds no KV block (one takes "
                             f"{KVOffloader.block_bytes_of(runner)} bytes)")
        self.offloader = KVOffloader(runner, num_slots)
        self.pool = HostPool(num_slots, block_size)
        self.pool.loads_in_step = self.offloader.in_stream
        self._staged: deque = deque()  # loads in flight, oldest first: (blocks, future)
        self._pool: PrefixPool | None = None

    @classmethod
    def for_args(cls, runner: Any, size_gib: float, block_size: int,
                 min_slots: int = 0, step_tokens: int = 0) -> KVTier | None:
        """The tier of `kv_offloading_size` GiB (None when 0 and nothing needs it),
        bringing back at most `step_tokens` (`kv_offloading_step_tokens`) a step."""
        if size_gib < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {size_gib}")
        slots = max(KVOffloader.slots_for(runner, size_gib), min_slots)
        if size_gib == 0 and slots == 0:
            return None
        tier = cls(runner, slots, block_size)
        tier.pool.step_load_tokens = step_tokens
        return tier

    def before_step(self, pool: PrefixPool) -> Any:
        """Queues the step's saves (before the step runs) and its loads: in-stream, before
        the step too (their batch lands at once), else staged (their host copies start on
        the loader thread)."""
        self._pool = pool
        saves, loads = pool.take_moves()
        staged = self.offloader.move(saves, loads)
        if loads and staged is None:
            pool.land_oldest()
        return staged

    def after_step(self, staged: Any, idle: bool = False) -> None:
        """Queues after the step the scatters of the staged loads whose host copies are
        done, oldest first, and lands their batches in the pool: a copy still running
        never holds the launch thread (its sequences wait in the scheduler). `idle`: the
        step ran nothing, so the oldest copy is waited for rather than polled."""
        if staged is not None:
            self._staged.append(staged)
        if idle and self._staged:
            self._staged[0][1].result()
        while self._staged and self._staged[0][1].done():
            self.offloader.after_step(self._staged.popleft())
            self._pool.land_oldest()

    def counters(self) -> dict[str, Any]:
        s, p = self.offloader.stats, self.pool
        return {"host_used_blocks": p.num_used_slots, "host_free_blocks": p.num_free_slots,
                "host_stored_blocks": p.num_stored_blocks,
                "host_dropped_blocks": p.num_dropped_blocks,
                "host_rejected_blocks": p.num_rejected_blocks,
                "host_bytes_to_host": s.bytes_to_host, "host_bytes_to_device": s.bytes_to_device,
                "host_copy_s": s.copy_s}

    def load_file(self, path: str | Path, ident: dict[str, Any]) -> int:
        """Loads a saved prefix cache into the host tier (parents first, as many blocks
        as are free); returns the blocks loaded. A refused file loads nothing."""
        entries, salts, data = prefix_cache_file.load(path, ident)
        paths: list[list[tuple]] = []
        slots, rows = [], []
        for i, (parent, salt_id, tokens) in enumerate(entries):
            paths.append(([] if parent < 0 else paths[parent]) + [tokens])
            if self.pool.num_free_slots == 0:
                break
            slot = self.pool.store(salts[salt_id], paths[i])
            if slot is not None:
                slots.append(slot)
                rows.append(i)
        self.offloader.write(slots, tuple(d[rows] for d in data))
        return len(slots)


def save_prefix_cache(pool: PrefixPool, tier: KVTier | None, runner: Any,
                      path: str | Path, ident: dict[str, Any]) -> int:
    """Writes every cached block of both tiers (HBM's read from the device) to `path`;
    returns the number of blocks written."""
    found: dict[tuple, tuple[str, int]] = {}  # (salt, path) -> (tier, block or slot)
    if tier is not None:
        for salt, blocks, node in tier.pool.entries():
            found[(salt, tuple(blocks))] = ("host", node.slot)
    for node in pool.trie.nodes():
        found[(pool.trie.salt_of(node), tuple(n.tokens for n in node.path()))] = (
            "hbm", node.block)
    keys = sorted(found, key=lambda k: len(k[1]))
    index: dict[tuple, int] = {}
    salts: list = []
    entries, order = [], []
    for salt, blocks in keys:
        parent = -1 if len(blocks) == 1 else index.get((salt, blocks[:-1]))
        if parent is None:
            continue  # its ancestors are in neither tier: unreachable
        if salt not in salts:
            salts.append(salt)
        index[(salt, blocks)] = len(entries)
        entries.append((parent, salts.index(salt), blocks[-1]))
        order.append(found[(salt, blocks)])
    hbm = [i for i, (t, _) in enumerate(order) if t == "hbm"]
    host = [i for i, (t, _) in enumerate(order) if t == "host"]
    dev = read_blocks(runner, [order[i][1] for i in hbm])
    on_host = (tier.offloader.read([order[i][1] for i in host]) if tier is not None
               else tuple(d[:0] for d in dev))
    data = []
    for d, h in zip(dev, on_host, strict=True):
        out = np.empty((len(entries), *d.shape[1:]), d.dtype)
        out[hbm], out[host] = d, h
        data.append(out)
    return prefix_cache_file.save(path, ident, entries, salts, tuple(data))
