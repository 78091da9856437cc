"""Probe: which decode knobs suit an fp8 cache once the programs are one warp, and how
many key splits such programs want (GPU; `--smoke` runs anywhere in interpret mode).

One-warp programs on one-page steps made the cascade's short fp8 suffixes 25% faster,
but on long contexts each program walks its keys alone, and the decode tiling's key
splits were sized for 2-warp programs (~1,024 programs). This times, per shape, the bf16
cache at its default, the fp8 cache at its default, and the fp8 cache over one- and
two-warp knobs with 1-8 key splits (`--knob-set fine`: pipeline stages, cache hint, page
prefetch and step size around one warp, 32 keys, two splits). Shapes: Llama-2-7B (32/32)
and Llama-3-8B (32/8) heads at batch 64 / 256 and context 2,048 (the kernel table's),
256 ShareGPT-like contexts (uniform in 100-2,000: the engine's long suffixes) at 32/8,
and 256 x 232 (the seed workload's cascade suffix) at 32/32. Device time per call
(`measure`), each config checked against the reference first.

    python scripts/probes/probe_fp8_decode.py --output-json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import json

import jax
import numpy as np

from pallas_kernels.paged_attention import paged_attention_reference
from scripts.kernel_timing import attention_fn, fp8_case, make_case, measure, rel_err

KNOBS = {"default": {}} | {
    f"w{w}/kv{kv}/split{s}": {"num_warps": w, "block_kv": kv, "kv_splits": s}
    for w, kv, s in [(1, 16, 1), (1, 16, 2), (1, 16, 4), (1, 16, 8), (1, 32, 1), (1, 32, 2),
                     (1, 32, 4), (2, 32, 2), (2, 32, 4), (2, 64, 4), (2, 64, 8)]}
# `--knob-set fine`: around the one-warp, 32-key, two-split default
_W1 = {"num_warps": 1, "block_kv": 32, "kv_splits": 2}
FINE = {"default": {}} | {f"w1/kv32/split2 {k}": _W1 | v for k, v in [
    ("stages2", {"num_stages": 2}), ("stages4", {"num_stages": 4}),
    ("stages5", {"num_stages": 5}), ("evict_first", {"evict_first": True}),
    ("no_prefetch", {"prefetch_pages": False}), ("kv64", {"block_kv": 64}),
    ("kv64 stages4", {"block_kv": 64, "num_stages": 4})]}


def shapes(smoke: bool):
    rng = np.random.default_rng(0)
    if smoke:
        return [("tiny", (4, 2), [(1, 60)] * 4, 32)]
    sharegpt = [(1, int(c)) for c in rng.integers(100, 2000, 256)]
    return [("llama2 B64 ctx2048", (32, 32), [(1, 2048)] * 64, 128),
            ("llama2 B256 ctx2048", (32, 32), [(1, 2048)] * 256, 128),
            ("llama3 B64 ctx2048", (32, 8), [(1, 2048)] * 64, 128),
            ("llama3 B256 ctx2048", (32, 8), [(1, 2048)] * 256, 128),
            ("llama3 B256 sharegpt", (32, 8), sharegpt, 128),
            ("llama2 B256 ctx232", (32, 32), [(1, 232)] * 256, 128)]


def time_config(case: dict, knobs: dict, interpret: bool) -> dict:
    scale = case["q"].shape[-1] ** -0.5
    names = list(case)
    op = attention_fn(scale, interpret, {"max_q_len": 1, **knobs})
    fn = jax.jit(lambda *a: op(**dict(zip(names, a, strict=True))))
    ref = paged_attention_reference(**case, scale=scale)
    try:
        err = rel_err(fn(*case.values()), ref)
        m = measure(fn, *case.values()) if err < 2e-2 else {"seconds": float("nan")}
    except Exception as e:  # a config Triton cannot compile
        print(f"  {knobs} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return {"rel_err": float("nan"), "seconds": float("nan")}
    return {"rel_err": err, **m}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--output-json")
    ap.add_argument("--knob-set", choices=["sweep", "fine"], default="sweep")
    ap.add_argument("--only", default="", help="shapes whose name contains this")
    args = ap.parse_args()
    knob_set = FINE if args.knob_set == "fine" else KNOBS
    interpret = args.smoke or jax.default_backend() == "cpu"
    results = []
    for name, heads, seqs, d in shapes(args.smoke):
        if args.only not in name:
            continue
        case = make_case(1, heads=heads, seqs=seqs, head_dim=d)
        kv_keys = sum(kv for _, kv in seqs) * heads[1]
        row = {"shape": name, "bf16": time_config(case, {}, interpret), "fp8": {}}
        fp8 = fp8_case(case, "fp8")
        del case
        for label, knobs in (knob_set if not args.smoke else {"default": {}, **dict(
                list(knob_set.items())[1:3])}).items():
            row["fp8"][label] = r = time_config(fp8, knobs, interpret)
            ratio = row["bf16"]["seconds"] / r["seconds"]
            print(f"{name}: fp8 {label}: {r['seconds'] * 1e3:.4f} ms "
                  f"({2 * kv_keys * (d + 4) / r['seconds'] / 1e12:.2f} TB/s), "
                  f"{ratio:.2f}x bf16 ({row['bf16']['seconds'] * 1e3:.4f} ms)", flush=True)
        del fp8
        results.append(row)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
