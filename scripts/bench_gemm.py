"""Few-row matmuls of a Llama-2-7B layer: pallas_kernels.skinny_matmul against XLA's own.

A step of one ~100-token prompt (time to first token) or of a small decode batch
multiplies M <= 256 rows by each weight matrix; its cost is streaming the weights. For
each projection and M this sweeps the kernel's tiling (output columns per program and K
splits first, then K step, pipeline stages and warps for the best of those), checks each
against XLA's result, and reports device time per matmul (kernel busy time from a
profiler trace, kernel_timing.device_times) for XLA and the best tiling, as TB/s of
weights read and against the 4.3 TB/s copy floor. Each timed call multiplies by
`copies` distinct weights (>= 256 MB in all), so the L2 cache cannot hold them between
calls, as in the model where every layer has its own. `--quantization fp8` also times
the fp8 path of the same matmuls (`models.fp8_linear`: per-channel fp8 weights, per-token
fp8 activations, XLA's fp8 dot), with its error against the bf16 result, and the engine's
choice for the rows (`worker.step._linear`: skinny_matmul's fp8 variant where it takes
the rows, else the same XLA dot). `--fp8-native` sweeps the kernel with the activations
as fp8 (the tensor cores' fp8 x fp8 dot; the row quantisation inside the timed call).

    python scripts/bench_gemm.py --output-json out/gemm.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jprefix.worker.step import _linear
from models.fp8_linear import FP8, fp8_matmul, quantize_activations, quantize_weight
from models.llama import apply_act, dense_linear
from pallas_kernels.skinny_matmul import (
    MatmulTiling,
    check_matmul_inputs,
    skinny_matmul,
    skinny_matmul_reference,
)
from scripts.kernel_timing import device_times, guarded, rel_err, timeit

COPY_FLOOR_TBS = 4.3
# name: (K, N of w, act) for Llama-2-7B (E 4096, F 11008; w_gate holds [gate | up])
SHAPES = {"qkv": (4096, 12288, None), "o": (4096, 4096, None),
          "gate_up": (4096, 22016, "silu_mul"), "down": (11008, 4096, None)}
SMOKE_SHAPES = {"qkv": (256, 384, None), "gate_up": (256, 256, "silu_mul"),
                "down": (512, 128, None)}


def stage1(act, smoke):
    blocks = (16, 32) if smoke else (32, 64, 128)
    splits = (1,) if act else (1, 2, 4, 8)
    bk = 64 if smoke else 128
    return [MatmulTiling(block_n=bn, block_k=bk, k_splits=s) for bn, s in
            itertools.product(blocks, splits)]


def stage2(best, smoke):
    steps = ((32, 2), (64, 3)) if smoke else ((64, 6), (128, 3), (128, 5), (256, 3))
    return [MatmulTiling(block_n=t.block_n, block_k=bk, k_splits=t.k_splits,
                         num_stages=st, num_warps=nw)
            for t in best for (bk, st), nw in itertools.product(steps, (4, 8))]


def time_matmul(fn, x, ws, interpret, device=False, calls=20):
    """Seconds per matmul: with `device`, kernel busy time from a profiler trace; else
    the wall time of `calls` back-to-back calls (`kernel_timing.timeit`: each call's
    kernels outlast its dispatch, so it is close; the sweep uses it because a trace
    costs ~1 s)."""
    dev = device_times(fn, x, ws, reps=5) if device and not interpret else None
    if dev is not None:
        return dev["busy_us"] * 1e-6 / len(ws)
    return timeit(fn, x, ws, reps=1, inner=1 if interpret else calls) / len(ws)


FP8_VARIANTS = {"dot16": {"dot_dtype": jnp.bfloat16}, "tensor": {"granularity": "tensor"},
                "tensor_dot16": {"dot_dtype": jnp.bfloat16, "granularity": "tensor"}}


def bench_case(name, m, shape, args, interpret):
    k, n, act = shape
    dtype = jnp.float32 if interpret else jnp.bfloat16
    copies = 1 if interpret else max(2, -(-256 * 2**20 // (k * n * 2)))
    keys = jax.random.split(jax.random.key(m + n), copies + 1)
    x = jax.random.normal(keys[0], (m, k), dtype)
    ws = [(jax.random.normal(kk, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
          for kk in keys[1:]]
    ref = skinny_matmul_reference(x, ws[0], act)
    xla = jax.jit(lambda x, ws: [dense_linear(x, w, act) for w in ws])
    row = {"name": name, "m": m, "k": k, "n": n, "act": act, "copies": copies,
           "weight_mb": k * n * 2 / 2**20, "floor_us": k * n * 2 / COPY_FLOOR_TBS / 1e6,
           "xla_us": time_matmul(xla, x, ws, interpret, device=True) * 1e6,
           "xla_wall_us": time_matmul(xla, x, ws, interpret) * 1e6,
           "xla_err": rel_err(xla(x, ws[:1])[0], ref), "tried": []}
    if args.quantization == "fp8":
        qws = [quantize_weight(w) for w in ws]
        fp8 = jax.jit(lambda x, qws: [dense_linear(x, w, act) for w in qws])
        row["fp8_us"] = time_matmul(fp8, x, qws, interpret, device=True) * 1e6
        row["fp8_err"] = rel_err(fp8(x, qws[:1])[0], ref)
        # the engine's choice for these rows: skinny_matmul's fp8 variant or XLA's fp8 dot
        lin = _linear("pallas-interpret" if interpret else "pallas", None)
        engine = jax.jit(lambda x, qws: [lin(x, w, act) for w in qws])
        row["fp8_engine_us"] = time_matmul(engine, x, qws, interpret, device=True) * 1e6
        row["fp8_engine_err"] = rel_err(engine(x, qws[:1])[0], ref)
        # XLA's fp8 dot in other forms: a 16-bit dot result, one activation scale
        for label, kw in FP8_VARIANTS.items():
            fn = jax.jit(lambda x, qws, kw=kw: [apply_act(fp8_matmul(x, w, **kw), act)
                                                     for w in qws])
            row[f"fp8_{label}_us"] = time_matmul(fn, x, qws, interpret, device=True) * 1e6
            row[f"fp8_{label}_err"] = rel_err(fn(x, qws[:1])[0], ref)

    if args.fp8_native:
        bench_native_fp8(row, x, [quantize_weight(w) for w in ws], act, ref, interpret)

    def ours(t):
        return jax.jit(lambda x, ws: [skinny_matmul(x, w, act=act, tiling=t,
                                                    interpret=interpret) for w in ws])

    def run(tilings):
        for t in tilings:
            try:
                check_matmul_inputs(x, ws[0], act, t)
            except ValueError:
                continue
            fn = ours(t)
            try:
                err = rel_err(fn(x, ws[:1])[0], ref)
                us = time_matmul(fn, x, ws, interpret) * 1e6 if err < 2e-2 else None
            except Exception as exc:  # e.g. a tiling past the shared memory
                row["tried"].append({"tiling": t.__dict__, "error": str(exc)[:200]})
                continue
            row["tried"].append({"tiling": t.__dict__, "us": us, "err": err})

    if args.xla_only:
        return row
    run(stage1(act, args.smoke))
    ok = sorted((r for r in row["tried"] if r.get("us")), key=lambda r: r["us"])
    run(stage2([MatmulTiling(**r["tiling"]) for r in ok[:1]], args.smoke))
    ok = sorted((r for r in row["tried"] if r.get("us")), key=lambda r: r["us"])
    if ok:
        row["best"] = ok[0]
        best = MatmulTiling(**ok[0]["tiling"])
        row["best_us"] = time_matmul(ours(best), x, ws, interpret, device=True) * 1e6
    return row


def native_tilings(m, act, best=None):
    """The fp8-native sweep: rows per program, output columns and K splits first, then
    K step, stages and warps for the best of those."""
    if best is None:
        row_blocks = [0] + [b for b in (64, 128) if b < m]
        return [MatmulTiling(block_n=bn, block_k=128, k_splits=s, block_m=bm,
                             num_warps=8 if (bm or m) * bn >= 128 * 128 else 4)
                for bm, bn, s in itertools.product(row_blocks, (64, 128), (1, 2))
                if not (act and s > 1)]
    return [dataclasses.replace(best, block_k=bk, num_stages=st, num_warps=nw)
            for (bk, st), nw in itertools.product(((64, 4), (128, 3), (128, 5), (256, 3)),
                                                  (4, 8))]


def bench_native_fp8(row, x, qws, act, ref, interpret):
    """skinny_matmul with x as fp8 (the tensor cores' fp8 dot) over `native_tilings`,
    the activations quantised per row inside the timed call as `fp8_matmul` does:
    row["fp8_native"] = the tilings tried; row["fp8_native_us"] the best's device time."""
    def fn(t):
        def one(x, w):
            x8, xs = quantize_activations(x)
            return skinny_matmul(x8, w.w8, act=act, tiling=t, interpret=interpret,
                                 scales=(xs[:, 0], w.scale), out_dtype=x.dtype)
        return jax.jit(lambda x, qws: [one(x, w) for w in qws])

    tried = row["fp8_native"] = []

    def run(tilings):
        for t in tilings:
            try:
                check_matmul_inputs(x.astype(FP8), qws[0].w8, act, t,
                                    (qws[0].scale[:1].repeat(x.shape[0]), qws[0].scale),
                                    x.dtype)
                err = rel_err(fn(t)(x, qws[:1])[0], ref)
                us = time_matmul(fn(t), x, qws, interpret) * 1e6 if err < 0.1 else None
            except Exception as exc:  # a tiling past the shared memory or registers
                tried.append({"tiling": t.__dict__, "error": str(exc)[:200]})
                continue
            tried.append({"tiling": t.__dict__, "us": us, "err": err})

    def best():
        ok = sorted((r for r in tried if r.get("us")), key=lambda r: r["us"])
        return MatmulTiling(**ok[0]["tiling"]) if ok else None

    run(native_tilings(x.shape[0], act))
    if best() is not None:
        run(native_tilings(x.shape[0], act, best()))
        row["fp8_native_best"] = best().__dict__
        row["fp8_native_us"] = time_matmul(fn(best()), x, qws, interpret, device=True) * 1e6


def line(row):
    tbs = row["weight_mb"] * 2**20 / 1e12

    def cell(us):
        return f"{us:7.1f} us {tbs / (us * 1e-6):5.2f} TB/s" if us else "   (none)"
    best = row.get("best", {}).get("tiling", {})
    best = ", ".join(f"{k} {v}" for k, v in best.items())
    fp8 = (f"  fp8 {row['fp8_us']:7.1f} us ({row['xla_us'] / row['fp8_us']:.2f}x, err "
           f"{row['fp8_err']:.3f}), engine's {row['fp8_engine_us']:7.1f} us "
           f"({row['xla_us'] / row['fp8_engine_us']:.2f}x)" if "fp8_us" in row else "")
    fp8 += "".join(f"  {k} {row[f'fp8_{k}_us']:.1f} us" for k in FP8_VARIANTS
                   if f"fp8_{k}_us" in row)
    if "fp8_native_us" in row:
        nat = ", ".join(f"{k} {v}" for k, v in row["fp8_native_best"].items())
        fp8 += (f"  fp8 native {row['fp8_native_us']:7.1f} us "
                f"({row['xla_us'] / row['fp8_native_us']:.2f}x; {nat})")
    return (f"{row['name']:8s} M {row['m']:4d}  floor {row['floor_us']:6.1f} us  "
            f"xla {cell(row['xla_us'])}  ours {cell(row.get('best_us'))}  ({best})" + fp8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 128, 256])
    ap.add_argument("--only", default="", help="comma-separated projections (default all)")
    ap.add_argument("--xla-only", action="store_true", help="time XLA's matmuls only")
    ap.add_argument("--smoke", action="store_true", help="small shapes, interpret mode")
    ap.add_argument("--output-json")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="also time the fp8-weight matmuls (models.fp8_linear)")
    ap.add_argument("--fp8-native", action="store_true",
                    help="also sweep skinny_matmul with fp8 activations (fp8 x fp8 dot)")
    args = ap.parse_args(argv)
    interpret = args.smoke or jax.default_backend() == "cpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    names = [s for s in args.only.split(",") if s] or list(shapes)
    results = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
               "date": time.strftime("%Y-%m-%d"), "rows": [], "errors": []}
    def run(name, m):
        row = bench_case(name, m, shapes[name], args, interpret)
        results["rows"].append(row)
        print(line(row), flush=True)

    for name, m in itertools.product(names, args.rows):
        guarded(results, f"{name} M {m}", functools.partial(run, name, m), args.output_json)
    return results


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
