"""Can the host tier's loads copy rows straight out of the pinned pool (a DMA per row
issued by one jitted program over the pinned chunk) instead of gathering them on host
threads into pinned staging first?

The pool is chunks of `[rows, L, K, B, D]` in the device's pinned host memory. Today a
load copies its rows into a pinned staging array with NumPy (16 threads) and puts that on
the device; XLA's GPU pipeline turns a dynamic-slice of a host-memory operand into an
asynchronous copy, so a jit taking the chunk (pinned_host) and the slots, slicing each row
and moving it to the device, would skip the host gather. Per row count: the staged path,
the jitted path, and one device_put of a contiguous pinned array of the same bytes (the
link's rate), each the median of --repeats, with the jitted rows checked equal.

    python scripts/probes/probe_host_dma.py --rows 16 64 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from jprefix.worker.host_rows import pinned_array  # noqa: E402


def median_s(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row-shape", type=int, nargs="+", default=[32, 8, 16, 128],
                    help="one block of one component (Llama-3-8B's K: 1 MiB in bf16)")
    ap.add_argument("--chunk-rows", type=int, default=1024)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dev = jax.devices()[0]
    host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = SingleDeviceSharding(dev, memory_kind="device")
    shape = (args.chunk_rows, *args.row_shape)
    chunk, view = pinned_array(shape, jnp.bfloat16, host)
    rng = np.random.default_rng(0)
    view[...] = rng.standard_normal(shape, np.float32).astype(view.dtype)
    row_bytes = int(np.prod(args.row_shape)) * 2
    results = []
    for n in args.rows:
        slots = rng.choice(args.chunk_rows, n, replace=False).astype(np.int32)
        staging, sview = pinned_array((n, *args.row_shape), jnp.bfloat16, host)

        def staged(slots=slots, staging=staging, sview=sview):
            np.take(view, slots, axis=0, out=sview)
            return jax.device_put(staging, on_dev)

        def take(c, idx, n=n):
            return jnp.stack([jax.device_put(lax.dynamic_index_in_dim(c, idx[i], keepdims=False),
                                             on_dev) for i in range(n)])

        def take_loop(c, idx, n=n):
            def body(i, acc):
                r = jax.device_put(lax.dynamic_slice_in_dim(c, idx[i], 1), on_dev)
                return lax.dynamic_update_slice_in_dim(acc, r, i, 0)
            return lax.fori_loop(0, n, body, jnp.zeros((n, *c.shape[1:]), c.dtype,
                                                         device=on_dev))

        row = {"rows": n, "bytes": n * row_bytes}
        row["staged_ms"] = median_s(staged, args.repeats) * 1e3
        row["contiguous_ms"] = median_s(lambda staging=staging: jax.device_put(staging, on_dev),
                                        args.repeats) * 1e3
        try:
            f = jax.jit(take, in_shardings=(host, on_dev), out_shardings=on_dev)
            idx = jax.device_put(slots, on_dev)
            t0 = time.perf_counter()
            out = f(chunk, idx)
            row["jit_compile_s"] = time.perf_counter() - t0
            row["jit_equal"] = bool(np.array_equal(np.asarray(out, np.float32),
                                                   view[slots].astype(np.float32)))
            row["jit_ms"] = median_s(lambda f=f, idx=idx: f(chunk, idx), args.repeats) * 1e3
            hlo = f.lower(chunk, idx).compile().as_text()
            row["jit_async_slices"] = hlo.count("dynamic-slice-start")
            # the rows scattered into a device cache in the same program (a load's use)
            cache = jnp.zeros((2 * n + 1, *args.row_shape), jnp.bfloat16, device=dev)
            blocks = jax.device_put(np.arange(1, n + 1, dtype=np.int32)[::-1].copy(), on_dev)
            g = jax.jit(lambda cache, c, idx, b: cache.at[b].set(take(c, idx)),
                        in_shardings=(on_dev, host, on_dev, on_dev), out_shardings=on_dev,
                        donate_argnums=0)
            box = [g(cache, chunk, idx, blocks)]
            row["fused_equal"] = bool(np.array_equal(
                np.asarray(box[0][1:n + 1][::-1], np.float32), view[slots].astype(np.float32)))

            def fused(g=g, idx=idx, blocks=blocks, box=box):
                box[0] = g(box[0], chunk, idx, blocks)
                return box[0]
            row["fused_ms"] = median_s(fused, args.repeats) * 1e3
        except Exception as exc:  # noqa: BLE001 (the answer may be: unsupported)
            row["jit_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        try:
            h = jax.jit(take_loop, in_shardings=(host, on_dev), out_shardings=on_dev)
            idx = jax.device_put(slots, on_dev)
            row["loop_equal"] = bool(np.array_equal(np.asarray(h(chunk, idx), np.float32),
                                                    view[slots].astype(np.float32)))
            row["loop_ms"] = median_s(lambda h=h, idx=idx: h(chunk, idx), args.repeats) * 1e3
        except Exception as exc:  # noqa: BLE001
            row["loop_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        for k in ("staged", "contiguous", "jit", "fused", "loop"):
            if f"{k}_ms" in row:
                row[f"{k}_gb_s"] = round(row["bytes"] / row[f"{k}_ms"] / 1e6, 1)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(dev), "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
