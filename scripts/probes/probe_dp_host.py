"""Can one process drive N data-parallel replicas, or does each need its own process?

Two host measurements, no accelerator needed (run it on the CPU):

1. Host work per engine step when one front (`DataParallelEngine`) steps N replicas in
   one thread: N engines over bench_host's packing stub, 256 decoding sequences each
   (N prefix groups, routed one per replica by affinity). If the front adds nothing, a
   front step costs N times one replica's step; one process then drives as many
   replicas as fit in a device step (N * host step < device step).
2. Whether a jitted call holds the GIL while XLA runs it: a Python counting thread's
   rate alone, and while another thread calls a jitted function back to back. A
   replica's step launch runs on its own thread; if the launch held the GIL, N replicas'
   launches would serialise with every replica's Python work.
Also the router's cost per request (hashing and matching a 700-token prompt).

    JAX_PLATFORMS=cpu python scripts/probes/probe_dp_host.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import json
import statistics
import threading
import time

import numpy as np

from jprefix.core.sampling_params import SamplingParams
from jprefix.engine.args import EngineArgs
from jprefix.engine.dp_engine import DataParallelEngine
from scripts.bench_host import stub_engine


def front_step_ms(n: int, seqs: int, prefix: int, unique: int, steps: int) -> dict:
    args = EngineArgs(num_kv_blocks=16384, data_parallel_size=n)
    front = DataParallelEngine(None, args, replicas=[stub_engine(args) for _ in range(n)])
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    groups = [rng.integers(10, 32000, prefix).tolist() for _ in range(n)]
    route_us = []
    for i in range(seqs * n):
        group = front.make_request(groups[i % n] + rng.integers(10, 32000, unique).tolist(),
                                   sp, prefix)
        t = time.perf_counter()
        front.add(group)
        route_us.append((time.perf_counter() - t) * 1e6)
    while any(len(r.scheduler.running) < seqs or
              any(s.num_output_tokens == 0 for s in r.scheduler.running.values())
              for r in front.replicas):
        front.step()  # prefill
    chunks = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(steps // 5):
            front.step()
        chunks.append((time.perf_counter() - t) / (steps // 5) * 1e3)
    per_replica = [r.stats()["requests"] for r in front.replicas]
    return dict(replicas=n, requests_per_replica=per_replica, front_step_ms=min(chunks),
                per_replica_ms=min(chunks) / n, route_us_median=statistics.median(route_us))


def gil_probe(seconds: float = 2.0) -> dict:
    """Python iterations per second of a counting thread, alone and beside a thread that
    runs a jitted function back to back (its share of the time inside XLA)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def work(x):
        for _ in range(8):
            x = jnp.tanh(x @ x) * 0.5
        return x

    x = jnp.ones((384, 384), jnp.float32)
    work(x).block_until_ready()

    def count(stop: threading.Event, out: list) -> None:
        n = 0
        while not stop.is_set():
            n += 1
        out.append(n)

    def run(with_jax: bool) -> tuple[float, float]:
        stop, out, calls = threading.Event(), [], [0, 0.0]
        counter = threading.Thread(target=count, args=(stop, out))

        def jax_loop():
            while not stop.is_set():
                t = time.perf_counter()
                work(x).block_until_ready()
                calls[0] += 1
                calls[1] += time.perf_counter() - t
        worker = threading.Thread(target=jax_loop) if with_jax else None
        counter.start()
        if worker:
            worker.start()
        time.sleep(seconds)
        stop.set()
        counter.join()
        if worker:
            worker.join()
        return out[0] / seconds, (calls[1] / calls[0] * 1e3 if calls[0] else 0.0)

    alone, _ = run(False)
    beside, call_ms = run(True)
    return dict(count_per_s_alone=alone, count_per_s_beside_jax=beside,
                ratio=beside / alone, jitted_call_ms=call_ms)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--num-seqs", type=int, default=256, help="decoding sequences per replica")
    ap.add_argument("--prefix-len", type=int, default=596)
    ap.add_argument("--unique-len", type=int, default=104)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    result = {"front": [front_step_ms(n, args.num_seqs, args.prefix_len, args.unique_len,
                                      args.steps) for n in args.replicas],
              "gil": gil_probe()}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
