"""Probe: host time of one jitted call against the number of array arguments (the step
takes one per weight array) and whether its flat inputs come from numpy (copied to the
device inside the call) or are on the device already.

    python scripts/probes/probe_args.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jprefix.benchmarks.common import write_json
from jprefix.worker import xla_flags
from scripts.probes.probe_launch import issue_and_whole


@jax.jit
def _call(leaves, ints, floats):
    return ints[:4] + floats[:4].astype(jnp.int32)


def time_call(leaves, ints, floats, reps: int) -> float:
    """Median host microseconds of the call (the device work is a few tiny kernels)."""
    issue, _ = issue_and_whole(lambda: _call(leaves, ints, floats), jax.block_until_ready,
                               reps)
    return issue * 1e6


def main(argv: list[str] | None = None) -> dict:
    xla_flags.apply()  # XLA's flags as the engine runs them, before jax starts
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--leaves", type=int, nargs="+", default=[0, 64, 195, 400])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    ints = np.arange(3000, dtype=np.int32)
    floats = np.ones(300, np.float32)
    rows = []
    for n in args.leaves:
        leaves = [jnp.full((8, 8), i, jnp.bfloat16) for i in range(n)]
        host = time_call(leaves, ints, floats, args.reps)
        device = time_call(leaves, jax.device_put(ints), jax.device_put(floats), args.reps)
        rows.append(dict(leaves=n, us_numpy_inputs=round(host, 1),
                         us_device_inputs=round(device, 1)))
        print(rows[-1], flush=True)
    result = dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=rows)
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
