"""Probe: what one kernel launch costs the host on this machine, for XLA (a jitted chain
of N tiny kernels that cannot fuse) and, when torch is installed, for PyTorch eager and
a replayed CUDA graph of the same chain. An engine step launches hundreds of kernels, so
this per-launch cost bounds a step from below whatever the device does.

    python scripts/probes/probe_launch.py [--kernels 500]

XLA runs as jprefix sets it up (command buffers off); JPREFIX_XLA_COMMAND_BUFFERS=1 keeps
XLA's default, and XLA_FLAGS passes other settings (e.g. --xla_gpu_cublas_fallback=false).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import json
import os
import statistics
import time

from jprefix.benchmarks.common import write_json
from jprefix.worker import xla_flags


def issue_and_whole(call, wait, reps: int) -> tuple[float, float]:
    """Median (host seconds until `call()` returns, seconds until `wait(its result)` does)
    over `reps` calls, after one warm-up call. The probes' shared timer."""
    wait(call())
    issue, whole = [], []
    for _ in range(reps):
        t = time.perf_counter()
        out = call()
        issue.append(time.perf_counter() - t)
        wait(out)
        whole.append(time.perf_counter() - t)
    return statistics.median(issue), statistics.median(whole)


def probe_xla(n: int, reps: int) -> dict:
    """Issue and whole time per kernel of jitted chains of n kernels of one kind each:
    an elementwise fusion, a matmul (cuBLAS), a Pallas (Triton) kernel."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    def pallas_add(x):
        return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=jax.default_backend() != "gpu")(x)

    w = jnp.eye(256, dtype=jnp.bfloat16)
    big = jnp.eye(4096, dtype=jnp.bfloat16)  # a Llama-2-7B-sized projection
    kinds = {"elementwise": (jnp.sin, jnp.ones(256, jnp.float32)),
             "matmul": (lambda x: x @ w, jnp.ones((256, 256), jnp.bfloat16)),
             "matmul 256x4096x4096": (lambda x: x @ big, jnp.ones((256, 4096), jnp.bfloat16)),
             "matmul 104x4096x4096": (lambda x: x @ big, jnp.ones((104, 4096), jnp.bfloat16)),
             "pallas": (pallas_add, jnp.ones(256, jnp.float32))}
    result = {}
    for kind, (op, x) in kinds.items():
        count = n if jax.default_backend() == "gpu" else 4

        def chain(x, op=op, count=count):
            for _ in range(count):  # the barrier keeps each op a kernel of its own
                x = jax.lax.optimization_barrier(op(x))
            return x

        f = jax.jit(chain)
        issue, whole = issue_and_whole(lambda f=f, x=x: f(x), jax.block_until_ready, reps)
        result[kind] = dict(kernels=count, issue_us_per_kernel=issue / count * 1e6,
                            whole_us_per_kernel=whole / count * 1e6)
    return result


def probe_torch(n: int, reps: int) -> dict | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.ones(256, device="cuda")

    def chain():
        y = x
        for _ in range(n):
            y = torch.sin(y)
        return y

    eager = issue_and_whole(chain, lambda _: torch.cuda.synchronize(), reps)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    replay = issue_and_whole(graph.replay, lambda _: torch.cuda.synchronize(), reps)
    return dict(kernels=n, eager_issue_us_per_kernel=eager[0] / n * 1e6,
                eager_whole_us_per_kernel=eager[1] / n * 1e6,
                graph_issue_us=replay[0] * 1e6, graph_whole_us_per_kernel=replay[1] / n * 1e6)


def main(argv: list[str] | None = None) -> dict:
    xla_flags.apply()  # XLA's flags as the engine runs them, before jax starts
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernels", type=int, default=500)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    result = dict(xla_flags=os.environ.get("XLA_FLAGS", ""),
                  xla=probe_xla(args.kernels, args.reps),
                  torch=probe_torch(args.kernels, args.reps))
    print(json.dumps(result, indent=1))
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
