"""Mosaic GPU kernels against today's path, one GPU call: the fp8 x fp8 matmul with the
activations quantised inside (`pallas_kernels.mgpu_fp8_matmul`).

1. Correctness: each kernel variant (`VARIANTS`) on a grid of small shapes and on one
   Llama-2-7B projection against `mgpu_fp8_matmul_reference`, the output buffer
   poisoned (NaN) first through the allocator (a NaN array of the output's size is
   freed just before the call, so the kernel's output most likely lands on it; any
   element the kernel does not write then reads NaN).
2. Device time per matmul (kernel busy time from a profiler trace,
   `kernel_timing.device_times`) per Llama-2-7B projection (`SHAPES`) and row count:
   bf16 weights (XLA's dot), today's fp8 path as the engine runs it
   (`worker.step._linear`: the Triton few-row kernel where it takes the rows, else
   `fp8_matmul`, i.e. a quantising fusion + XLA's fp8 dot + a scaling fusion), and each
   variant x tiling of the Mosaic kernel. Each timed call multiplies by `copies` distinct
   weights (>= 256 MB), so the L2 cache does not hold them between calls.

    python scripts/bench_mgpu.py --output-json out/mgpu.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jprefix.worker.step import _linear
from models.fp8_linear import quantize_activations, quantize_weight
from models.llama import dense_linear
from pallas_kernels.mgpu_fp8_matmul import (
    MgpuMatmulConfig,
    mgpu_fp8_matmul,
    mgpu_fp8_matmul_reference,
)
from scripts.kernel_timing import device_times, guarded, rel_err

# name: (K, N) of Llama-2-7B's projections (gate_up = [gate | up], without the act)
SHAPES = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016),
          "down": (11008, 4096)}
ROWS = (16, 128, 256, 4096)
C = MgpuMatmulConfig
# variant: (quant, a_operand, delay_release) of the Mosaic kernel
VARIANTS = {"fused_regs": ("fused", "regs", 0), "fused_smem": ("fused", "smem", 0),
            "pre": ("pre", "regs", 0), "fused_regs_d1": ("fused", "regs", 1),
            "pre_d1": ("pre", "regs", 1)}
# tilings tried per row count: few rows split the CTA's columns over the warpgroups
TILINGS = {
    "few": (C(tile_m=64, tile_n=64, tile_k=128, max_stages=4, wg_split="n"),
            C(tile_m=64, tile_n=128, tile_k=128, max_stages=3, wg_split="n")),
    "many": (C(tile_m=64, tile_n=128, tile_k=128, max_stages=3, wg_split="m"),
             C(tile_m=64, tile_n=256, tile_k=64, max_stages=4, wg_split="m"),
             C(tile_m=128, tile_n=128, tile_k=64, max_stages=4, wg_split="m")),
}


# the fastest of those per row count on the first run (docs/results/mgpu_fp8_*s1.json)
BEST = {"few": TILINGS["few"][:1], "128": TILINGS["many"][:1], "many": TILINGS["many"][1:2]}


def tilings_for(m: int, best: bool = False):
    if best:
        return BEST["few" if m <= 64 else "128" if m <= 128 else "many"]
    return TILINGS["few"] if m <= 64 else TILINGS["many"]


def mosaic_fn(variant: str, config: MgpuMatmulConfig):
    """A jitted x, [Fp8Weight] -> [y] through the Mosaic kernel (the activations'
    amax and, for "pre", their quantisation inside the timed call)."""
    quant, a_operand, delay = VARIANTS[variant]
    config = C(**{**config.__dict__, "a_operand": a_operand, "delay_release": delay})

    def one(x, w):
        if quant == "pre":
            x8, xs = quantize_activations(x)
            return mgpu_fp8_matmul(x8, w.w8, w.scale, config=config, quant="pre",
                                   x_scale=xs[:, 0])
        return mgpu_fp8_matmul(x, w.w8, w.scale, config=config)

    return jax.jit(lambda x, ws: [one(x, w) for w in ws])


def poisoned_call(fn, x, ws, out_shape):
    """fn(x, ws) right after freeing a NaN array of the output's size (module doc)."""
    poison = jnp.full(out_shape, jnp.nan, jnp.bfloat16).block_until_ready()
    del poison
    return jax.block_until_ready(fn(x, ws))


def make(m, k, n, copies, seed=0):
    keys = jax.random.split(jax.random.key(seed + m + n), copies + 1)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    ws = [(jax.random.normal(kk, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
          for kk in keys[1:]]
    return x, ws


def check(results, variant, config, m, k, n):
    x, ws = make(m, k, n, 1, seed=1)
    qw = quantize_weight(ws[0])
    ref = mgpu_fp8_matmul_reference(x, qw.w8, qw.scale)
    out = poisoned_call(mosaic_fn(variant, config), x, [qw], (m, n))[0]
    full = np.asarray(dense_linear(x, ws[0]), np.float32)
    row = {"variant": variant, "config": config.__dict__, "m": m, "k": k, "n": n,
           "nan": bool(np.isnan(np.asarray(out, np.float32)).any()),
           "err_vs_ref": rel_err(out, ref), "err_vs_bf16": rel_err(out, full)}
    results["checks"].append(row)
    print(f"check {variant:10s} {m:5d}x{k}x{n} {config.tile_m}/{config.tile_n}/"
          f"{config.tile_k}/{config.wg_split}: nan={row['nan']} "
          f"err_ref={row['err_vs_ref']:.2e} err_bf16={row['err_vs_bf16']:.3f}", flush=True)
    return row["err_vs_ref"] < 1e-2 and not row["nan"]


def busy_us(fn, x, ws):
    dev = device_times(fn, x, ws, reps=5)
    return None if dev is None else dev["busy_us"] / len(ws)


def bench_case(results, name, m, variants_ok, deadline, best):
    k, n = SHAPES[name]
    copies = max(2, -(-256 * 2**20 // (k * n)))
    x, ws = make(m, k, n, copies)
    qws = [quantize_weight(w) for w in ws]
    ref = mgpu_fp8_matmul_reference(x, qws[0].w8, qws[0].scale)
    row = {"name": name, "m": m, "k": k, "n": n, "copies": copies, "mosaic": []}
    results["cases"].append(row)
    bf16 = jax.jit(lambda x, ws: [dense_linear(x, w) for w in ws])
    row["bf16_us"] = busy_us(bf16, x, ws)
    del ws
    lin = _linear("pallas", None)
    today = jax.jit(lambda x, qws: [lin(x, w) for w in qws])
    row["today_us"] = busy_us(today, x, qws)
    row["today_err"] = rel_err(today(x, qws[:1])[0], ref)
    for variant in variants_ok:
        for config in tilings_for(m, best):
            if time.time() > deadline:
                row["mosaic"].append({"variant": variant, "skipped": "deadline"})
                continue
            entry = {"variant": variant, "config": config.__dict__}
            try:
                fn = mosaic_fn(variant, config)
                entry["err"] = rel_err(fn(x, qws[:1])[0], ref)
                entry["us"] = busy_us(fn, x, qws)
            except Exception as exc:  # a tiling past the shared memory, say
                entry["error"] = str(exc)[-300:]
            row["mosaic"].append(entry)
    timed = [e for e in row["mosaic"] if e.get("us") and e.get("err", 1) < 1e-2]
    best = min(timed, key=lambda e: e["us"], default=None)
    row["best"] = best
    print(f"{name:8s} m={m:5d} bf16 {row['bf16_us']:8.1f} us  today {row['today_us']:8.1f}"
          f"  mosaic {best['us'] if best else float('nan'):8.1f} "
          f"({best['variant'] if best else '-'} {best['config'] if best else ''})", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-json")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--best-tilings", action="store_true",
                    help="time only the tiling that was fastest per row count (BEST)")
    ap.add_argument("--skip-checks", nargs="*", default=[],
                    help="variants taken as correct without the check grid (checked before)")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="stop starting Mosaic timings after this many seconds")
    args = ap.parse_args(argv)
    t0 = time.time()
    results = {"jax": jax.__version__, "device": str(jax.devices()[0]), "checks": [],
               "cases": [], "errors": []}
    ok = []
    for variant in args.variants:
        if variant in args.skip_checks:
            ok.append(variant)
            continue
        passed = []
        for config in (*TILINGS["few"][:1], *TILINGS["many"]):
            label = f"check {variant} {config}"
            guarded(results, label, lambda v=variant, c=config, p=passed: p.append(
                all(check(results, v, c, m, 512, 256) for m in (1, 100, 256))),
                args.output_json)
        if passed and all(passed):
            ok.append(variant)
    guarded(results, "check 7B", lambda: [check(results, v, TILINGS["many"][0], 256,
                                                *SHAPES["qkv"]) for v in ok
                                          if v not in args.skip_checks],
            args.output_json)
    results["variants_ok"] = ok
    deadline = t0 + args.budget_s
    for name in args.shapes:
        for m in args.rows:
            guarded(results, f"{name} {m}",
                    lambda n=name, m=m: bench_case(results, n, m, ok, deadline,
                                                   args.best_tilings),
                    args.output_json)
    print(f"{'shape':8s} {'rows':>5s} {'bf16':>8s} {'today':>8s} {'mosaic':>8s}  best")
    for r in results["cases"]:
        b = r.get("best") or {}
        print(f"{r['name']:8s} {r['m']:5d} {r.get('bf16_us') or 0:8.1f} "
              f"{r.get('today_us') or 0:8.1f} {b.get('us', float('nan')):8.1f}  "
              f"{b.get('variant', '-')} {b.get('config', '')}")
    print(f"{len(results['errors'])} errors; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
