"""One MoE layer's expert matmuls: XLA's ragged_dot against the Pallas grouped GEMM
(pallas_kernels.grouped_matmul), at real shapes, against the bound the routing allows.

For each model (qwen3-30b-a3b: 128 experts [2048, 768], top-8; mixtral-8x7b: 8 experts
[4096, 14336], top-2) and token count T: random top-k routing (k distinct experts per
token, uniform), then `models.moe.experts` (sort by expert, gather, [gate | up] grouped
matmul, SiLU, down grouped matmul, unsort, weighted sum) with each grouped matmul:
  ragged_dot    `models.moe.grouped_matmul` (the "xla" backend's, and until now GPU's);
  ragged_pallas the same under `jax_ragged_dot_use_gpu_pallas_triton_lowering` (jax's own
                Pallas-Triton lowering, where this jax ships it; else an error entry);
  kernel        the engine's path (`step_linear.kernel_grouped_matmul`: the kernel at
                `gmm_tiling`'s default tiling);
  a few other tilings, the best reported with its knobs.
`--fp8`: the experts' weights in fp8 (`quantization="fp8"`: e4m3 [X, N, K] with
per-channel scales, W8A16), ragged_dot then being `grouped_matmul`'s fp8 path.
Each timed call runs `layers` layers with their own weights (2 where T <= 256, so the
touched experts do not stay in L2 between calls), the output of one the input of the
next; time per layer = median over reps of back-to-back calls (synchronised with
block_until_ready once per rep) / layers. Every variant's output is checked against
ragged_dot's (relative L2 error). Variants are compiled in parallel threads first.

The bound per layer: max(bytes / 4.3 TB/s, flops / 790 TFLOP/s), bytes = the touched
experts' gate, up and down weights + the grouped matmuls' activations (rows in, [gate |
up] out, SiLU product in, down out: 2*A*E + 3*A*F elements, A = T*k), flops = 6*A*E*F.

    python scripts/bench_moe.py --out moe.json            # the H200 run, < 3 minutes
    python scripts/bench_moe.py --fp8 --out moe_fp8.json  # the same with fp8 experts
    python scripts/bench_moe.py --tiny --out /tmp/m.json  # CPU smoke (interpret mode)
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import functools
import json
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jprefix.worker.step_linear import kernel_grouped_matmul
from models.fp8_linear import Fp8Weight, quantize_weight
from models.moe import experts
from models.moe import grouped_matmul as ragged_matmul
from pallas_kernels.grouped_matmul import GmmTiling, gmm_tiling
from pallas_kernels.grouped_matmul import grouped_matmul as gmm
from scripts.kernel_timing import timeit

BANDWIDTH, FLOPS = 4.3e12, 790e12
# name: (experts X, hidden E, expert hidden F, top-k)
MODELS = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2)}
TINY_MODELS = {"tiny-qwen3-moe": (16, 64, 32, 4), "tiny-mixtral": (4, 64, 48, 2)}
TOKENS = (1, 8, 64, 256, 1024, 8192)
TINY_TOKENS = (1, 8, 64)
RAGGED_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"


def candidate_tilings(rows: int, x_: int, e: int, f: int, tiny: bool) -> list[GmmTiling]:
    """Tilings to try for A = `rows` rows over x_ experts: alternates around the
    default's regime, each dividing both matmuls' K and N (E, 2F and F)."""
    default = gmm_tiling(rows, e, 2 * f, x_)
    if tiny:
        return [GmmTiling(16, 16, 16, 4, 2)]
    if default.block_m == 16:
        alts = [GmmTiling(16, 64, 128, 4, 4), GmmTiling(16, 32, 256, 4, 3),
                GmmTiling(16, 128, 128, 4, 3)]
    elif default.block_m <= 64:
        alts = [GmmTiling(default.block_m, 64, 64, 4, 4), GmmTiling(64, 128, 64, 4, 3),
                GmmTiling(32, 128, 64, 4, 4)]
    else:
        alts = [GmmTiling(128, 128, 32, 8, 4), GmmTiling(64, 128, 64, 4, 3),
                GmmTiling(128, 256, 64, 8, 3)]
    ok = [t for t in alts if t != default and all(
        n % t.block_n == 0 and k % t.block_k == 0 for k, n in ((e, 2 * f), (f, e)))]
    return ok[:2]


def routing(rng, t: int, x_: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """k distinct uniformly random experts per token, weights summing to 1."""
    ids = np.argsort(rng.uniform(size=(t, x_)), axis=1)[:, :k].astype(np.int32)
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def layer_stack(matmul, layers: int):
    """f(x, weights [L, T, k], ids [L, T, k], gate_ups, downs): `layers` MoE layers."""
    def run(x, weights, ids, gate_ups, downs):
        for i in range(layers):
            x = experts(x, weights[i], ids[i], gate_ups[i], None, downs[i], matmul=matmul)
        return x
    return run


def variants(rows: int, x_: int, e: int, f: int, tiny: bool) -> dict:
    """name -> (grouped matmul, jax config overrides), the tilings included."""
    interpret = jax.default_backend() == "cpu"
    out = {"ragged_dot": (ragged_matmul, {}), "kernel": (kernel_grouped_matmul(interpret), {})}
    if not interpret and hasattr(jax.config, RAGGED_FLAG):
        out["ragged_pallas"] = (ragged_matmul, {RAGGED_FLAG: True})
    for t in candidate_tilings(rows, x_, e, f, tiny):
        name = f"kernel_m{t.block_m}_n{t.block_n}_k{t.block_k}_w{t.num_warps}_s{t.num_stages}"
        out[name] = (functools.partial(tiled_matmul, tiling=t, interpret=interpret), {})
    return out


def tiled_matmul(x, w, group_sizes, *, tiling: GmmTiling, interpret: bool):
    """The kernel at `tiling` (an `Fp8Weight` as its fp8 variant)."""
    if isinstance(w, Fp8Weight):
        return gmm(x, w.w8, group_sizes, scale=w.scale, tiling=tiling, interpret=interpret)
    return gmm(x, w, group_sizes, tiling=tiling, interpret=interpret)


def compile_one(fn, args, flags: dict):
    """`fn` jitted and compiled for `args` under the jax config `flags`."""
    old = {name: getattr(jax.config, name) for name in flags}
    try:
        for name, value in flags.items():
            jax.config.update(name, value)
        return jax.jit(fn).lower(*args).compile()
    finally:
        for name, value in old.items():
            jax.config.update(name, value)


def time_call(fn, args, budget_s: float, max_reps: int) -> float:
    """Median seconds per call (`kernel_timing.timeit`): reps of back-to-back calls,
    each rep synchronised once, as many reps (3..max_reps) as fit in about budget_s."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    inner = max(1, min(10, int(0.02 / max(once, 1e-6))))
    reps = int(max(3, min(max_reps, budget_s / max(once * inner, 1e-6))))
    return timeit(fn, *args, reps=reps, inner=inner)


def make_weights(key, layers: int, x_: int, e: int, f: int, dtype, fp8: bool):
    """Per layer: gate_up [X, E, 2F] (fused, as the engine's GPU layout) and down
    [X, F, E]; `fp8`: as `Fp8Weight`s."""
    keys = jax.random.split(key, 2 * layers)
    gate_ups = tuple((jax.random.normal(keys[2 * i], (x_, e, 2 * f), jnp.float32)
                      / np.sqrt(e)).astype(dtype) for i in range(layers))
    downs = tuple((jax.random.normal(keys[2 * i + 1], (x_, f, e), jnp.float32)
                   / np.sqrt(f)).astype(dtype) for i in range(layers))
    if fp8:
        return tuple(quantize_weight(w) for w in gate_ups), tuple(quantize_weight(w) for w in downs)
    return gate_ups, downs


def bound(ids: np.ndarray, e: int, f: int, w_itemsize: int, x_itemsize: int) -> dict:
    """One layer's floor (module docstring)."""
    a = ids.size
    touched = len(np.unique(ids))
    nbytes = touched * 3 * e * f * w_itemsize + (2 * a * e + 3 * a * f) * x_itemsize
    flops = 6 * a * e * f
    ms = max(nbytes / BANDWIDTH, flops / FLOPS) * 1e3
    return dict(experts_touched=touched, bytes=nbytes, flops=flops, bound_ms=ms,
                bytes_ms=nbytes / BANDWIDTH * 1e3, flops_ms=flops / FLOPS * 1e3)


def bench_case(model: str, t: int, weights, args, rng) -> dict:
    """One (model, T) row: every variant compiled (in parallel), checked and timed."""
    x_, e, f, k = (TINY_MODELS if args.tiny else MODELS)[model]
    layers = 2 if t <= 256 else 1
    gate_ups, downs = weights[0][:layers], weights[1][:layers]
    routes = [routing(rng, t, x_, k) for _ in range(layers)]
    ids = jnp.asarray(np.stack([r[0] for r in routes]))
    wts = jnp.asarray(np.stack([r[1] for r in routes]))
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    x = jax.random.normal(jax.random.key(t), (t, e), jnp.float32).astype(dtype)
    call_args = (x, wts, ids, gate_ups, downs)
    row = dict(model=model, tokens=t, rows=t * k, layers=layers,
               **bound(np.asarray(ids[0]), e, f, 1 if args.fp8 else x.dtype.itemsize,
                       x.dtype.itemsize),
               default_tiling=dataclasses.asdict(gmm_tiling(t * k, e, 2 * f, x_)),
               ms={}, rel_err={}, errors={})
    todo = variants(t * k, x_, e, f, args.tiny)
    with ThreadPoolExecutor(max_workers=8) as pool:  # (config flags are global: those
        # variants compile on this thread, after the others)
        futures = {name: pool.submit(compile_one, layer_stack(mm, layers), call_args, {})
                   for name, (mm, flags) in todo.items() if not flags}
    ref = None
    for name, (mm, flags) in todo.items():
        try:
            fn = (futures[name].result() if name in futures
                  else compile_one(layer_stack(mm, layers), call_args, flags))
            out = fn(*call_args)
            if ref is None:  # (ragged_dot runs first; where it failed, the next)
                ref, row["rel_err_against"] = np.asarray(out, np.float32), name
            got = np.asarray(out, np.float32)
            row["rel_err"][name] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            row["ms"][name] = time_call(fn, call_args, args.budget_s, args.reps) / layers * 1e3
        except Exception as exc:  # noqa: BLE001 (one variant failing must not end the run)
            row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
    kernels = {n: v for n, v in row["ms"].items() if n.startswith("kernel")}
    if kernels:
        best = min(kernels, key=kernels.get)
        row.update(best=best, best_ms=kernels[best], best_of_bound=row["bound_ms"] / kernels[best])
        if "ragged_dot" in row["ms"]:
            row["speedup_vs_ragged_dot"] = row["ms"]["ragged_dot"] / kernels[best]
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, float32 (CPU smoke)")
    ap.add_argument("--fp8", action="store_true", help="the experts' weights in fp8")
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--reps", type=int, default=20, help="most timed reps per variant")
    ap.add_argument("--budget-s", type=float, default=0.4, help="timing seconds per variant")
    args = ap.parse_args(argv)
    models = args.models or list(TINY_MODELS if args.tiny else MODELS)
    tokens = args.tokens or (TINY_TOKENS if args.tiny else TOKENS)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    result = dict(backend=jax.default_backend(), jax=jax.__version__, fp8=args.fp8,
                  device=str(jax.devices()[0]), bandwidth=BANDWIDTH, flops=FLOPS, rows=[])
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for model in models:
        x_, e, f, _ = (TINY_MODELS if args.tiny else MODELS)[model]
        weights = make_weights(jax.random.key(1), 2, x_, e, f, dtype, args.fp8)
        for t in tokens:
            result["rows"].append(bench_case(model, t, weights, args, rng))
            if args.out:  # rewritten after each row: a timeout keeps what was measured
                Path(args.out).write_text(json.dumps(result, indent=1))
        del weights
    result["seconds"] = time.perf_counter() - start
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    return result


def print_table(result: dict) -> None:
    print(f"\nMoE expert matmuls per layer, ms, {'fp8' if result['fp8'] else '16-bit'} "
          f"weights ({result['device']}, jax {result['jax']}, "
          f"{result['seconds']:.0f} s); bound = max(bytes / 4.3 TB/s, flops / 790 TFLOP/s)")
    print(f"{'model':15} {'T':>5} {'experts':>7} {'bound':>8} {'ragged':>9} {'jax-pl':>8} "
          f"{'kernel':>8} {'best':>8} {'of bnd':>6}  best tiling")
    for r in result["rows"]:
        ms = r["ms"]

        def cell(name, width=8, ms=ms):
            return f"{ms[name]:{width}.3f}" if name in ms else f"{'-':>{width}}"
        print(f"{r['model']:15} {r['tokens']:5d} {r['experts_touched']:7d} "
              f"{r['bound_ms']:8.3f} {cell('ragged_dot', 9)} {cell('ragged_pallas')} "
              f"{cell('kernel')} {r.get('best_ms', float('nan')):8.3f} "
              f"{r.get('best_of_bound', 0):6.0%}  {r.get('best', '-')}"
              + (f"  errors: {sorted(r['errors'])}" if r["errors"] else ""))


if __name__ == "__main__":
    main()
