"""Probe: is the step's host dispatch time spent re-recording XLA command buffers when
input buffer addresses change? Times the jitted step called with (a) fresh host inputs
each call, as the engine does, and (b) the same device input arrays every call.

    XLA_FLAGS=... python scripts/probes/probe_dispatch.py --model llama-2-7b
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jprefix import LLM, load  # noqa: E402
from jprefix.worker.flat_batch import flatten_batch  # noqa: E402
from jprefix.worker.pack import pack_step  # noqa: E402
from jprefix.worker.step import step  # noqa: E402
from scripts.bench_step import fake_decode_batch  # noqa: E402
from scripts.probes.probe_launch import issue_and_whole  # noqa: E402


def _run_step(runner, prev, kw, flat):
    tokens, runner._kv_cache = step(runner.params, runner._kv_cache, flat, prev, **kw)
    return tokens


def _with_copy(run, flat):
    return run(flat.copy())  # a new host buffer, as every engine step has


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--context", type=int, default=700)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    model = load(args.model, dtype="bfloat16", load_format="dummy")
    runner = LLM(model, gpu_memory_utilization=0.85).engine.runner
    rng = np.random.default_rng(0)
    for b in args.batch:
        sched = fake_decode_batch(b, args.context, runner.block_size,
                                  runner.kv_cache[0].shape[2], rng)
        flat, layout = flatten_batch(pack_step(sched, runner.block_size, runner.buckets))
        prev = jnp.zeros(runner.max_rows, jnp.int32)
        kw = dict(layout=layout, cfg=runner.cfg, backend=runner.backend, decode=True,
                  greedy=True, mesh=runner.mesh)

        run = functools.partial(_run_step, runner, prev, kw)
        fresh = functools.partial(_with_copy, run, flat)
        same = functools.partial(run, jax.device_put(flat))

        for name, call in (("fresh host inputs", fresh), ("same device inputs", same)):
            d, w = (1e3 * x for x in issue_and_whole(call, jax.block_until_ready, args.reps))
            print(f"batch {b:4d} {name:20s}: dispatch {d:6.2f} ms, step {w:6.2f} ms "
                  f"[XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}]", flush=True)


if __name__ == "__main__":
    main()
