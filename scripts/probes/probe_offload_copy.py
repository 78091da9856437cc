"""Probe: which way of holding the host tier's blocks moves them fastest to and from HBM?

One block of Llama-3-8B shapes (32 layers x 8 kv heads x 16 tokens x 128, bf16) is 1 MiB
per component (K, V); a 2,000-token prefix is 125 blocks, 262 MB both components. Timed
per way (median of --repeats, GB/s of the K+V bytes):

- host -> HBM: pageable numpy (one array; and a numpy row gather first, as the tier does
  today), one `pinned_host` jax array, and one pinned jax array per block moved by one
  `device_put` of the list (then stacked on the device);
- HBM -> host: `np.asarray` of a device array, `device_put` to `pinned_host` (one array,
  and one per block), and `np.asarray` of a pinned array;
- the cost of making per-block pinned arrays (allocation) and of freeing them.

    python scripts/probes/probe_offload_copy.py --blocks 125
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from scripts.kernel_timing import wall_median


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=125)
    ap.add_argument("--pool", type=int, default=2048, help="host pool blocks for the gather")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = jax.devices()[0]
    kinds = sorted(m.kind for m in dev.addressable_memories())
    print("device", dev.device_kind, "memory kinds", kinds)
    shape = (32, 8, 16, 128)  # one block, one component: [L, K, B, D]
    n = args.blocks
    nbytes = 2 * n * int(np.prod(shape)) * 2
    dsh = jax.sharding.SingleDeviceSharding(dev)
    psh = dsh.with_memory_kind("pinned_host") if "pinned_host" in kinds else None
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 2**15, (args.pool, *shape), np.int16).view(jnp.bfloat16)
            for _ in range(2)]
    slots = np.sort(rng.choice(args.pool, n, replace=False))
    rows = [p[slots] for p in pool]
    dev_arrs = [jax.device_put(r, dsh) for r in rows]
    res: dict[str, float] = {}

    def h2d_gather():
        jax.block_until_ready([jax.device_put(p[slots], dsh) for p in pool])

    def h2d_pageable():
        jax.block_until_ready([jax.device_put(r, dsh) for r in rows])

    res["np_gather_only"] = wall_median(lambda: [p[slots] for p in pool], args.repeats)
    res["h2d_np_gather+put"] = wall_median(h2d_gather, args.repeats)
    res["h2d_pageable"] = wall_median(h2d_pageable, args.repeats)
    res["d2h_asarray"] = wall_median(lambda: [np.asarray(a + 0) for a in dev_arrs], args.repeats)
    if psh is not None:
        pinned = [jax.device_put(a, psh) for a in dev_arrs]
        jax.block_until_ready(pinned)
        res["h2d_pinned_one"] = wall_median(
            lambda: jax.block_until_ready([jax.device_put(p, dsh) for p in pinned]),
            args.repeats)
        res["d2h_pinned_one"] = wall_median(
            lambda: jax.block_until_ready([jax.device_put(a + 0, psh) for a in dev_arrs]),
            args.repeats)
        res["pinned_to_numpy"] = wall_median(lambda: [np.asarray(p) for p in pinned], args.repeats)
        split = jax.jit(lambda a: tuple(a[i] for i in range(a.shape[0])))
        blocks = [split(a) for a in dev_arrs]
        jax.block_until_ready(blocks)

        def d2h_per_block():
            out = [jax.device_put(list(b), psh) for b in blocks]
            jax.block_until_ready(out)
            return out

        res["d2h_pinned_per_block"] = wall_median(d2h_per_block, args.repeats)
        per_block = d2h_per_block()
        stack = jax.jit(lambda *xs: jnp.stack(xs))

        def h2d_per_block():
            jax.block_until_ready([stack(*jax.device_put(b, dsh)) for b in per_block])

        res["h2d_pinned_per_block+stack"] = wall_median(h2d_per_block, args.repeats)
        t0 = time.perf_counter()
        many = [d2h_per_block() for _ in range(8)]
        res["alloc_8x_per_block"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        del many
        res["free_8x_per_block"] = time.perf_counter() - t0
    for k, v in res.items():
        moved = nbytes * (8 if k.startswith(("alloc", "free")) else 1)
        print(f"{k:>28} {v * 1e3:9.2f} ms {moved / v / 1e9:8.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "blocks": n, "kinds": kinds,
                       "ms": {k: round(v * 1e3, 3) for k, v in res.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
