"""Probe: what one kernel launch costs the host on this machine, for XLA (a jitted chain
of N tiny kernels that cannot fuse) and, when torch is installed, for PyTorch eager and
a replayed CUDA graph of the same chain. The engine's steps launch ~430-580 kernels, so
this per-launch cost bounds a step from below whatever the device does.

    PYTHONPATH=$PWD python scripts/probe_launch.py [--kernels 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _timed(call, sync, reps: int) -> tuple[float, float]:
    """Median (host seconds to issue, seconds until the device is done) per call."""
    call()
    sync()
    issue, whole = [], []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        issue.append(time.perf_counter() - t)
        sync()
        whole.append(time.perf_counter() - t)
    return statistics.median(issue), statistics.median(whole)


def probe_xla(n: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    def chain(x):
        for _ in range(n):  # the barrier keeps each sin a kernel of its own
            x = jax.lax.optimization_barrier(jnp.sin(x))
        return x

    f = jax.jit(chain)
    x = jnp.ones(256, jnp.float32)
    out = {}

    def call():
        out["y"] = f(x)

    issue, whole = _timed(call, lambda: out["y"].block_until_ready(), reps)
    return dict(kernels=n, issue_us_per_kernel=issue / n * 1e6,
                whole_us_per_kernel=whole / n * 1e6)


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

    eager = _timed(chain, torch.cuda.synchronize, reps)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    replay = _timed(graph.replay, torch.cuda.synchronize, reps)
    return dict(kernels=n, eager_issue_us_per_kernel=eager[0] / n * 1e6,
                eager_whole_us_per_kernel=eager[1] / n * 1e6,
                graph_issue_us=replay[0] * 1e6, graph_whole_us_per_kernel=replay[1] / n * 1e6)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernels", type=int, default=500)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    result = dict(xla=probe_xla(args.kernels, args.reps),
                  torch=probe_torch(args.kernels, args.reps))
    print(json.dumps(result, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
