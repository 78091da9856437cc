"""How fast does `models.moe.experts` (the grouped expert matmuls through ragged_dot) run
at a real MoE's shapes, against the bytes of the experts it touches?

For each token count T: random routing of T tokens to k of X experts, then one layer's
experts (gate/up [X, E, F], down [X, F, E]) timed on the device; the bound is the bytes
of the distinct experts the routing touched over the copy bandwidth given. How XLA runs
ragged_dot decides the answer: its default lowering expands the product over every
expert; compare with `XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true` (cuDNN
>= 9.22) and `JAX_RAGGED_DOT_USE_GPU_PALLAS_TRITON_LOWERING=1` (where the jax build ships
its Pallas-Triton grouped GEMM) in separate processes.

    python scripts/probes/probe_moe_grouped.py --model qwen3-30b-a3b
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

from models.config import PRESETS
from models.fp8_linear import quantize_weight
from models.moe import experts


def touched_bytes(ids: np.ndarray, e: int, f: int, itemsize: int) -> int:
    """Bytes of the distinct experts in `ids` (three [E, F] matrices each)."""
    return len(np.unique(ids)) * 3 * e * f * itemsize


def time_layer(fn, args, reps: int) -> float:
    """Median seconds of `fn(*args)` over `reps` runs after a compile."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048, 8192])
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--bandwidth-tb-s", type=float, default=4.3, help="copy bandwidth")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    cfg = PRESETS[args.model]
    x_, k, e, f = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size
    keys = jax.random.split(jax.random.key(0), 3)
    gate_up = (0.02 * jax.random.normal(keys[0], (x_, e, 2 * f))).astype(jnp.bfloat16)
    down = (0.02 * jax.random.normal(keys[1], (x_, f, e))).astype(jnp.bfloat16)
    weights = (gate_up, None, down)
    if args.quantization == "fp8":
        weights = (quantize_weight(gate_up), None, quantize_weight(down))
    itemsize = 1 if args.quantization else 2
    run = jax.jit(experts)
    rows = []
    rng = np.random.default_rng(0)
    for t in args.tokens:
        ids = np.stack([rng.choice(x_, k, replace=False) for _ in range(t)]).astype(np.int32)
        x = jax.random.normal(keys[2], (t, e)).astype(jnp.bfloat16)
        w = jnp.full((t, k), 1.0 / k, jnp.float32)
        try:
            seconds = time_layer(run, (x, w, jnp.asarray(ids), *weights), args.reps)
        except Exception as e:  # noqa: BLE001 (XLA's dense expansion can run out of memory)
            rows.append(dict(tokens=t, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(rows[-1], flush=True)
            continue
        nbytes = touched_bytes(ids, e, f, itemsize)
        bound = nbytes / (args.bandwidth_tb_s * 1e12)
        rows.append(dict(tokens=t, experts_touched=int(len(np.unique(ids))),
                         ms=seconds * 1e3, bound_ms=bound * 1e3,
                         of_bound=bound / seconds, gb_s=nbytes / seconds / 1e9))
        print(rows[-1], flush=True)
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(dict(model=args.model, quantization=args.quantization, rows=rows), fh,
                      indent=1)
    print(f"\n{args.model} experts of one layer ({x_} x [{e}, {f}], top-{k}), "
          f"{args.quantization or 'bf16'}, backend {jax.default_backend()}")
    for r in rows:
        if "error" in r:
            print(f"T {r['tokens']:5d}: {r['error']}")
            continue
        print(f"T {r['tokens']:5d}: {r['experts_touched']:4d} experts touched, "
              f"{r['ms']:8.3f} ms (bound {r['bound_ms']:.3f} ms, {r['of_bound']:.0%})")
    return rows


if __name__ == "__main__":
    main()
