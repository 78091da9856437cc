"""Probe: how soon the host has a step's result once the device is done. A jitted chain
of matmuls (a few ms of device work, like an engine step) returns a small int32 array;
each way of fetching it is timed from the call to the numpy result (median of reps), so
the differences are host-side latency:

  asarray      np.asarray(out) after the call (what a blocking fetch does)
  async_copy   out.copy_to_host_async() right after the call, then np.asarray(out)
  spin_ready   poll out.is_ready() until true, then np.asarray(out)
  block        out.block_until_ready(), then np.asarray(out)

    python scripts/probes/probe_fetch.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jprefix.benchmarks.common import write_json
from jprefix.worker import xla_flags


@functools.partial(jax.jit, static_argnames="layers")
def _work(x, w, layers: int):
    for _ in range(layers):  # unrolled: one kernel sequence, no host round trips
        x = jnp.tanh(x @ w)
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def _fetch(out, how: str) -> np.ndarray:
    if how == "async_copy":
        out.copy_to_host_async()
    elif how == "spin_ready":
        while not out.is_ready():
            pass
    elif how == "block":
        out.block_until_ready()
    return np.asarray(out)


def main(argv: list[str] | None = None) -> dict:
    xla_flags.apply()  # XLA's flags as the engine runs them, before jax starts
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=150,
                    help="matmuls in the chain (a few ms on a GPU)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    key = jax.random.key(0)
    x = jax.random.normal(key, (128, args.size), jnp.bfloat16)
    w = jax.random.normal(key, (args.size, args.size), jnp.bfloat16) * 0.02
    ways = ("asarray", "async_copy", "spin_ready", "block")
    times = {how: [] for how in ways}
    for how in ways:  # warm up every path
        _fetch(_work(x, w, args.layers), how)
    for _ in range(args.reps):  # interleaved, so drifts hit every way alike
        for how in ways:
            t = time.perf_counter()
            _fetch(_work(x, w, args.layers), how)
            times[how].append(time.perf_counter() - t)
    result = dict(device=str(jax.devices()[0]), jax=jax.__version__,
                  ms={how: round(statistics.median(v) * 1e3, 3) for how, v in times.items()},
                  ms_min={how: round(min(v) * 1e3, 3) for how, v in times.items()})
    print(result, flush=True)
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
