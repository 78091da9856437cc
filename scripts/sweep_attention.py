"""Sweeps `paged_attention`'s tuning knobs on the decode-side shapes that matter (GPU).

Shapes: the two halves of a cascade decode at 256 x (592 shared + 232 own): the
per-sequence suffix (causal, 232 keys, with LSE; also inside an engine-sized 32-layer
pool of 8,192 blocks, its blocks spread or packed) and the shared prefix (592 keys, no
mask, all 256 queries in one group, with LSE); the kernel table's decode (Llama-2-7B
32/32 and Llama-3-8B 32/8 heads, batch 256 and 64, context 2048) and prefill (8 x 2048);
the prefill of one prompt with 596 of its 700 tokens cached (time to first token); and
prefix-cached prefill (64 x (596 + 104) cached and uncached). `--profile` adds each
config's device time per call and its attention kernel's own time (jax.profiler). Every
config is checked against `paged_attention_reference` before it is timed; the table gives each
shape's time and KV bandwidth per config, best first.

    python scripts/sweep_attention.py --output-json out.json
    python scripts/sweep_attention.py --smoke   # CPU, interpret mode
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import itertools
import json
import time

import jax

from pallas_kernels.fp8 import FP8_NAMES
from pallas_kernels.paged_attention import paged_attention_reference
from scripts.kernel_timing import (
    attention_fn,
    device_times,
    fp8_case,
    make_case,
    rel_err,
    timeit,
)

DECODE_KNOBS = {  # name -> BlockSizes fields (max_q_len=1 added)
    "default": {},
    "no-prefetch": {"prefetch_pages": False},
    "evict": {"evict_first": True},
    "w2": {"num_warps": 2},
    "evict+w2": {"evict_first": True, "num_warps": 2},
    "1loop": {"single_loop": True},
    "kv128/s2": {"block_kv": 128, "num_stages": 2},
    "kv32/s4": {"block_kv": 32, "num_stages": 4},
    "kv32/w2": {"block_kv": 32, "num_warps": 2},
    "s2": {"num_stages": 2},
    "s4": {"num_stages": 4},
    "w8": {"num_warps": 8},
    "kv16/w1": {"block_kv": 16, "num_warps": 1},
    "kv32/w1": {"block_kv": 32, "num_warps": 1},
    "no-mask-kv": {"mask_kv": False},
}
SPLIT_KNOBS = {f"{name}+split{s}": {**kw, "kv_splits": s}
               for (name, kw), s in itertools.product(
                   [("default", {}), ("1loop", {"single_loop": True}),
                    ("kv32/s4", {"block_kv": 32, "num_stages": 4})], (1, 2, 4, 8))}
PREFIX_KNOBS = {
    f"bq{bq}/split{s}": {"block_q": bq, "kv_splits": s}
    for bq, s in itertools.product((64, 128), (1, 2, 4, 8))
}
PREFILL_KNOBS = {
    "default": {},
    "evict": {"evict_first": True},
    "kv32": {"block_kv": 32},
    "kv128/w8/s3": {"block_kv": 128, "num_warps": 8, "num_stages": 3},
    "split2": {"kv_splits": 2},
} | {  # occupancy: 4 stages of 128-row tiles leave room for one program per SM
    f"bq{bq}/w{w}/s{s}": {"block_q": bq, "num_warps": w, "num_stages": s}
    for bq, w, s in itertools.product((64, 128), (4, 8), (2, 3, 4))
}

POOL_KNOBS = {k: DECODE_KNOBS[k] for k in ("default", "kv128/s2", "w2", "evict")}
SHORT_KNOBS = {k: DECODE_KNOBS[k] for k in ("default", "no-mask-kv", "kv128/s2", "w2",
                                            "kv16/w1", "kv32/w1")} | {
    "kv32": {"block_kv": 32}, "kv32/no-mask-kv": {"block_kv": 32, "mask_kv": False},
    # several KV heads per decode tile
    "hp2/kv32": {"heads_per_tile": 2, "block_kv": 32},
    "hp4/kv32/s2": {"heads_per_tile": 4, "block_kv": 32, "num_stages": 2},
    "hp2": {"heads_per_tile": 2}}
# an fp8 cache's decode (with the tables above): warps, stages and step sizes around the
# engine's fp8 suffix knobs (block_kv 16, 1 warp) and the fp8 decode default (2 warps),
# several KV heads per tile
FP8_DECODE_KNOBS = {
    f"fp8 kv{kv}/w{w}/s{s}": {"block_kv": kv, "num_warps": w, "num_stages": s}
    for kv, w, s in ((32, 4, 3), (32, 2, 2), (32, 2, 4), (16, 1, 2), (16, 1, 4), (16, 2, 3),
                     (64, 2, 3), (64, 1, 3), (128, 4, 2))} | {
    "fp8 kv32/hp2": {"block_kv": 32, "heads_per_tile": 2},
    "fp8 kv16/w1/hp2": {"block_kv": 16, "num_warps": 1, "heads_per_tile": 2},
    "fp8 kv16/w1/1loop": {"block_kv": 16, "num_warps": 1, "single_loop": True},
    "fp8 kv16/w1/no-prefetch": {"block_kv": 16, "num_warps": 1, "prefetch_pages": False},
    "fp8 kv32/hp4/w4": {"block_kv": 32, "heads_per_tile": 4, "num_warps": 4},
    "fp8 kv32/no-prefetch": {"block_kv": 32, "prefetch_pages": False},
    "fp8 kv32/1loop": {"block_kv": 32, "single_loop": True},
    "fp8 kv32/evict": {"block_kv": 32, "evict_first": True}}
TTFT_KNOBS = {"default": {}} | {f"bq{bq}/split{s}": {"block_q": bq, "kv_splits": s}
                                for bq, s in itertools.product((64, 128), (1, 2, 4, 8))} | {
    # the default's 128-row tile and 4 splits, each program latency-bound (~3 key steps;
    # 8 warps by default)
    f"split4/{name}": {"kv_splits": 4, **kw} for name, kw in (
        ("kv32", {"block_kv": 32}), ("kv128", {"block_kv": 128}),
        ("kv128/w4", {"block_kv": 128, "num_warps": 4}), ("w4", {"num_warps": 4}),
        ("st2", {"num_stages": 2}), ("st3", {"num_stages": 3}), ("st4", {"num_stages": 4}),
        ("prefetch", {"prefetch_pages": True}), ("1loop", {"single_loop": True}),
        ("kv32/st4", {"block_kv": 32, "num_stages": 4}))}


def shapes(smoke: bool):
    """(name, case kwargs, paged_attention kwargs, knob table, bytes or FLOPs), in the
    order of what matters most (the sweep writes its JSON after every shape)."""
    d = 32 if smoke else 128
    ctx, batches = (64, (4,)) if smoke else (2048, (256, 64))
    hh = (4, 4) if smoke else (32, 32)
    seqs, own, prefix = (8, 24, 32) if smoke else (256, 232, 592)
    short = 12 if smoke else 130  # the engine's suffix ~20 steps into decoding
    out = [(f"cascade suffix {seqs} x {own}",
            dict(heads=hh, seqs=[(1, own)] * seqs, head_dim=d),
            dict(max_q_len=1, return_lse=True), DECODE_KNOBS, 2 * seqs * own * hh[1] * d * 2),
           (f"short suffix {seqs} x {short}",
            dict(heads=hh, seqs=[(1, short)] * seqs, head_dim=d),
            dict(max_q_len=1, return_lse=True), SHORT_KNOBS, 2 * seqs * short * hh[1] * d * 2),
           # the same suffix in an engine-sized pool (Llama-2-7B: 32 layers x 8,192
           # blocks, 34 GB per cache; 64-bit offsets), its blocks spread over the whole
           # pool as in the engine, or packed at its start
           *[(f"engine-pool suffix {seqs} x {own}, {where}",
              dict(heads=hh, seqs=[(1, own)] * seqs, head_dim=d, layers=4 if smoke else 32,
                   num_blocks=4 * seqs if smoke else 8192, spread=where == "spread"),
              dict(max_q_len=1, return_lse=True), POOL_KNOBS, 2 * seqs * own * hh[1] * d * 2)
             for where in ("spread", "packed")],
           (f"cascade prefix {seqs} q x {prefix}",
            dict(heads=hh, seqs=[(seqs, prefix)], head_dim=d),
            dict(causal=False, return_lse=True), PREFIX_KNOBS, 2 * prefix * hh[1] * d * 2)]
    for b in batches:
        for model, heads in (("llama2-7b", (32, 32)), ("llama3-8b", (32, 8))):
            heads = (4, 4) if smoke and heads[1] == 32 else (4, 1) if smoke else heads
            knobs = DECODE_KNOBS | (SPLIT_KNOBS if heads[0] != heads[1] or b == 64 else {})
            out.append((f"decode {model} B{b} ctx{ctx}",
                        dict(heads=heads, seqs=[(1, ctx)] * b, head_dim=d),
                        dict(max_q_len=1), knobs, 2 * b * ctx * heads[1] * d * 2))
    n, new, cached = (2, 40, 24) if smoke else (8, 2048, 596)
    out.append((f"prefill {n} x {new}", dict(heads=hh, seqs=[(new, new)] * n, head_dim=d),
                {}, PREFILL_KNOBS, 0))
    # one request's prefill with its prefix cached (time to first token): few tiles
    new_ttft = 8 if smoke else 104
    out.append((f"ttft prefill 1 x ({cached} + {new_ttft})",
                dict(heads=hh, seqs=[(new_ttft, cached + new_ttft)], head_dim=d), {},
                TTFT_KNOBS, 0))
    n = 4 if smoke else 64
    for label, q_len in (("cached", 104), ("uncached", cached + 104)):
        out.append((f"prefix prefill {label} {n} x ({cached} + 104)",
                    dict(heads=hh, seqs=[(q_len if not smoke else min(q_len, 30),
                                          cached + 104)] * n, head_dim=d),
                    {}, PREFILL_KNOBS, 0))
    return out


def distinct(knobs: dict) -> dict:
    """`knobs` without the knob sets equal to an earlier one (merged tables repeat some)."""
    out = {}
    for label, kw in knobs.items():
        if kw not in out.values():
            out[label] = kw
    return out


def sweep(name, case_kw, fixed, knobs, kv_bytes, smoke, reps, profile=False, fp8=None):
    """Times every knob set of `knobs` on one shape (checked against the reference first);
    `fp8` (an fp8 format name) quantises the case's caches as the engine's fp8 cache and
    counts its bytes (D + 4 per row)."""
    case = make_case(len(name), **case_kw)
    if fp8:
        case = fp8_case(case, fp8)
        kv_bytes = kv_bytes * (case["q"].shape[-1] + 4) // (2 * case["q"].shape[-1])
    scale = case["q"].shape[-1] ** -0.5
    ref = paged_attention_reference(**case, scale=scale, causal=fixed.get("causal", True),
                                    return_lse=fixed.get("return_lse", False))
    ref_o = ref[0] if isinstance(ref, tuple) else ref
    rows = []
    for label, kw in knobs.items():
        attn = attention_fn(scale, smoke, kw, **fixed)
        fn = jax.jit(lambda c, attn=attn: attn(**c))  # (the fp8 scales are keyword-only)
        try:
            out = fn(case)
            out = out[0] if isinstance(out, tuple) else out
            err = rel_err(out, ref_o)
            t = timeit(fn, case, reps=3 if smoke else reps) if err < 2e-2 else None
            dev = device_times(fn, case, reps=2 if smoke else 20) if t and profile else None
        except Exception as e:  # a config Triton cannot compile
            print(f"  {label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            err, t, dev = None, None, None
        row = {"knobs": label, "kwargs": kw, "rel_err": err, "seconds": t,
               "tb_s": kv_bytes / t / 1e12 if t and kv_bytes else None}
        if dev:  # device-side time per call and the attention kernel's own share
            kern = sum(us for k, us in dev["kernels"].items() if "paged_attention" in k)
            row.update(device_span_s=dev["span_us"] * 1e-6, kernel_s=kern * 1e-6,
                       kernels_us=dev["kernels"],
                       kernel_tb_s=kv_bytes / kern / 1e6 if kern and kv_bytes else None)
        rows.append(row)
        print(f"  {name} {label}: err {err} t {t}"
              + (f" device span {dev['span_us']:.1f} us, kernel {kern:.1f} us" if dev else ""),
              flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    ap.add_argument("--only", default="", help="comma-separated substrings of the shape "
                    "names to run (default all)")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per config")
    ap.add_argument("--profile", action="store_true", help="also trace each config with "
                    "jax.profiler: device time per call and the attention kernel's own")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *sorted(FP8_NAMES)],
                    help="auto: bf16 caches; an fp8 format: the engine's fp8 cache, and the "
                    "decode shapes sweep FP8_DECODE_KNOBS too")
    args = ap.parse_args(argv)
    fp8 = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    result = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "date": time.strftime("%Y-%m-%d"), "kv_cache_dtype": args.kv_cache_dtype,
              "shapes": {}}
    for name, case_kw, fixed, knobs, kv_bytes in shapes(args.smoke):
        if not any(part in name for part in args.only.split(",")):
            continue
        if fp8 and fixed.get("max_q_len") == 1:
            knobs = distinct(knobs | FP8_DECODE_KNOBS)
        if args.smoke:  # interpret mode is slow: two configs per shape
            knobs = dict(list(knobs.items())[1:2] + list(knobs.items())[-1:])
        print(name, flush=True)
        result["shapes"][name] = sweep(name, case_kw, fixed, knobs, kv_bytes, args.smoke,
                                        args.reps, args.profile, fp8)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(result, f, indent=1)
    print(f"\njax {result['jax']} | {result['device']}")
    for name, rows in result["shapes"].items():
        ok = sorted((r for r in rows if r["seconds"]), key=lambda r: r["seconds"])
        base = next((r for r in rows if r["knobs"] == "default" and r["seconds"]), None)
        print(f"{name}: " + (f"default {base['seconds'] * 1e3:.3f} ms; " if base else ""))
        for r in ok[:6]:
            bw = f"{r['tb_s']:.2f} TB/s" if r["tb_s"] else ""
            if r.get("kernel_s"):
                bw += (f"  (device {r['device_span_s'] * 1e3:.3f} ms, kernel "
                       f"{r['kernel_s'] * 1e3:.3f} ms"
                       + (f" = {r['kernel_tb_s']:.2f} TB/s)" if r["kernel_tb_s"] else ")"))
            print(f"   {r['knobs']:24s} {r['seconds'] * 1e3:8.3f} ms  {bw}")
    bad = [(n, r["knobs"]) for n, rows in result["shapes"].items() for r in rows
           if r["rel_err"] is not None and not r["rel_err"] < 2e-2]
    if bad:
        print(f"MISMATCH against the reference: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
