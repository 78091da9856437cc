"""Benchmarks jprefix's Pallas kernels on a GPU (the kernel table); --smoke runs it tiny on CPU.

Sections: decode KV bandwidth vs JAX's own `pallas.ops.gpu.paged_attention` (both tuned
over their knobs in this run), prefill TFLOP/s vs cuDNN on the dense equivalent,
prefix-cached vs uncached prefill time, write_kv time and in-place check (bench_write_kv),
the device copy ceiling. The decode and prefill sections also time their best config with
ALiBi slopes against the same config without (`alibi_cost`: the bias's cost). Section
`fp8` times decode on the same batch with a bf16 cache and with an fp8 one
(`--kv-cache-dtype`, per-row scales), each tuned over a few knobs: tokens/s side by side.
Every timed shape is checked against `paged_attention_reference` first. Prints one table last. Times
are device times per call (`kernel_timing.measure`: the op's kernels' busy time in a
profiler trace, as inside a jitted engine step), for ours and the peers alike; the JSON
also keeps the wall time of back-to-back calls.

    python scripts/bench_kernels.py --output-json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import functools
import time
import warnings

import jax
import jax.numpy as jnp

from models.alibi import alibi_slopes
from pallas_kernels.fp8 import FP8_NAMES
from pallas_kernels.paged_attention import paged_attention_reference
from scripts.bench_write_kv import bench_write_kv
from scripts.kernel_timing import (
    BF16,
    attention_fn,
    attn_pairs,
    fp8_case,
    guarded,
    make_case,
    measure,
    rel_err,
)

HEADS = {"llama2-7b": (32, 32), "llama3-8b": (32, 8),  # (H, K), D = 128
         "baichuan2-13b": (40, 40)}  # (ALiBi)


def tune_ours(case: dict, configs: list[dict], interpret: bool) -> tuple[dict, list]:
    """Checks the default config against the reference, then times every config."""
    scale = case["q"].shape[-1] ** -0.5
    ref = paged_attention_reference(**case, scale=scale)
    rows = []
    names = list(case)  # (positional for `measure`; the fp8 scales are keyword-only)
    for cfg in configs:
        op = attention_fn(scale, interpret, cfg)
        fn = jax.jit(lambda *a, op=op: op(**dict(zip(names, a, strict=True))))
        nan = {"seconds": float("nan")}
        try:
            err = rel_err(fn(*case.values()), ref)
            m = measure(fn, *case.values()) if err < 2e-2 else nan
        except Exception as e:  # a config Triton cannot compile (e.g. shared memory)
            print(f"  config {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
            err, m = float("nan"), nan
        rows.append({"config": cfg, "rel_err": err, **m})
        print(f"  {cfg} err={err:.2e} t={m['seconds'] * 1e3:.3f} ms "
              f"(wall {m.get('wall_seconds', float('nan')) * 1e3:.3f} ms)", flush=True)
    ok = [r for r in rows if r["seconds"] == r["seconds"]]
    best = min(ok, key=lambda r: r["seconds"]) if ok else rows[0]
    return best, rows


def alibi_cost(case: dict, cfg: dict, interpret: bool, rounds: int = 3,
               sweep: list[dict] = ()) -> dict:
    """The ALiBi bias's cost on `case` with knobs `cfg`: the op timed without
    `alibi_slopes(H)` and with them, alternating for `rounds` rounds (best of each),
    after the biased output is checked against the reference with the same slopes
    (raises if off). `sweep`: other knobs timed with the slopes too (`own_best`: the biased op's
    best tiling, against `cfg`'s unbiased time)."""
    scale = case["q"].shape[-1] ** -0.5
    slopes = jnp.asarray(alibi_slopes(case["q"].shape[1]))
    fns = {"off": jax.jit(attention_fn(scale, interpret, cfg)),
           "on": jax.jit(attention_fn(scale, interpret, cfg, alibi_slopes=slopes))}
    want = paged_attention_reference(**case, scale=scale, alibi_slopes=slopes)
    err = rel_err(fns["on"](**case), want)
    if not err < 2e-2:
        raise AssertionError(f"ALiBi off the reference: rel_err {err} with {cfg}")
    times = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            times[label].append(measure(fn, *case.values())["seconds"])
    off_s, on_s = min(times["off"]), min(times["on"])
    print(f"  alibi {cfg}: off {off_s * 1e3:.3f} ms, on {on_s * 1e3:.3f} ms "
          f"({on_s / off_s - 1:+.1%})", flush=True)
    own = {"config": cfg, "seconds": on_s}
    for knobs in (k for k in sweep if k != cfg):
        fn = jax.jit(attention_fn(scale, interpret, knobs, alibi_slopes=slopes))
        if not rel_err(fn(**case), want) < 2e-2:
            raise AssertionError(f"ALiBi off the reference with {knobs}")
        t = min(measure(fn, *case.values())["seconds"] for _ in range(rounds))
        print(f"  alibi {knobs}: {t * 1e3:.3f} ms ({t / off_s - 1:+.1%})", flush=True)
        own = min(own, {"config": knobs, "seconds": t}, key=lambda r: r["seconds"])
    return {"config": cfg, "rel_err": err, "off_seconds": off_s, "on_seconds": on_s,
            "overhead": on_s / off_s - 1, "times": times,
            "own_best": {**own, "overhead": own["seconds"] / off_s - 1}}


def decode_configs(smoke: bool) -> list[dict]:
    if smoke:
        return [{"max_q_len": 1}, {"max_q_len": 1, "kv_splits": 2, "block_kv": 32}]
    cfgs = [{}, {"evict_first": True}, {"num_warps": 2}, {"evict_first": True, "num_warps": 2},
            {"block_kv": 128, "num_stages": 2}, {"single_loop": True}]
    cfgs += [{"kv_splits": s} for s in (1, 2, 4)]
    cfgs += [{"single_loop": True, "kv_splits": s} for s in (1, 4)]
    return [{"max_q_len": 1, **c} for c in cfgs]


def jax_ops_decode(case: dict, smoke: bool) -> dict | None:
    """JAX's own Triton paged attention on the same layer, tuned over its knobs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import paged_attention as ops
    layer = int(case["layer"])
    k_pages, v_pages = case["k_cache"][layer], case["v_cache"][layer]
    args = (case["q"], k_pages, v_pages, case["block_tables"], case["kv_lens"])
    ref = paged_attention_reference(**case, scale=1.0)
    grid = [{"k_splits": 2, "pages_per_compute_block": 2}] if smoke else [{}] + [
        {"pages_per_compute_block": p, "k_splits": s, "num_warps": 4}
        for p, s in ((8, 4), (8, 8), (8, 16), (16, 16))]  # the best of a wider first sweep
    best = None
    for knobs in grid:
        fn = jax.jit(functools.partial(ops.paged_attention, interpret=smoke, **knobs))
        try:
            err = rel_err(fn(*args), ref)
            m = measure(fn, *args)
        except Exception as e:
            print(f"  jax ops {knobs} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(f"  jax ops {knobs} err={err:.2e} t={m['seconds'] * 1e3:.3f} ms "
              f"(wall {m['wall_seconds'] * 1e3:.3f} ms)", flush=True)
        if best is None or m["seconds"] < best["seconds"]:
            best = {"config": knobs, "rel_err": err, **m}
    return best


def bench_decode(smoke: bool, results: dict) -> None:
    batches, ctx = ((4, 16), 64) if smoke else ((64, 256), 2048)
    for name, heads in HEADS.items():
        for batch in batches:
            hh = (4, 4) if smoke and heads[0] == heads[1] else (4, 1) if smoke else heads
            d = 32 if smoke else 128
            case = make_case(batch, heads=hh, seqs=[(1, ctx)] * batch, head_dim=d)
            kv_bytes = 2 * batch * ctx * hh[1] * d * 2
            print(f"decode {name} batch {batch}", flush=True)
            best, rows = tune_ours(case, decode_configs(smoke), smoke)
            theirs = jax_ops_decode(case, smoke)
            alibi = alibi_cost(case, best["config"], smoke)
            results["decode"].append({
                "model": name, "batch": batch, "ctx": ctx, "kv_bytes": kv_bytes,
                "ours": best, "ours_sweep": rows, "jax_ops": theirs,
                "ours_tb_s": kv_bytes / best["seconds"] / 1e12,
                "jax_ops_tb_s": kv_bytes / theirs["seconds"] / 1e12 if theirs else None,
                "alibi": alibi,
            })
            del case


def bench_fp8_decode(smoke: bool, results: dict, fmt: str = "fp8") -> None:
    """Decode tokens/s with a bf16 and an fp8 cache on the same batch (Llama-2-7B and
    Llama-3-8B heads, batch 64/256, context 2048), each tuned over a few split/warp knobs."""
    batches, ctx = ((4, 16), 64) if smoke else ((64, 256), 2048)
    configs = decode_configs(True) if smoke else [
        {"max_q_len": 1, **c} for c in ({}, {"kv_splits": 2}, {"kv_splits": 4},
                                        {"num_warps": 2}, {"block_kv": 128, "num_stages": 2},
                                        # more bytes per program (an fp8 key is half)
                                        {"num_warps": 2, "block_kv": 128},
                                        {"num_warps": 2, "num_stages": 4},
                                        {"num_warps": 2, "heads_per_tile": 2},
                                        # one-warp programs, one or two pages a step
                                        {"num_warps": 1, "block_kv": 16},
                                        {"num_warps": 1, "block_kv": 32},
                                        {"num_warps": 1, "block_kv": 16, "kv_splits": 2})]
    results["fp8_decode"] = []
    for name in ("llama2-7b", "llama3-8b"):
        heads = HEADS[name]
        for batch in batches:
            hh = ((4, 4) if heads[0] == heads[1] else (4, 1)) if smoke else heads
            d = 32 if smoke else 128
            case = make_case(batch, heads=hh, seqs=[(1, ctx)] * batch, head_dim=d)
            print(f"fp8 decode {name} batch {batch}: bf16", flush=True)
            bf16, _ = tune_ours(case, configs, smoke)
            fp8 = fp8_case(case, fmt)
            del case
            print(f"fp8 decode {name} batch {batch}: {fmt}", flush=True)
            best, _ = tune_ours(fp8, configs, smoke)
            del fp8
            results["fp8_decode"].append({
                "model": name, "batch": batch, "ctx": ctx, "format": fmt,
                "bf16": bf16, "fp8": best,
                "bf16_tok_s": batch / bf16["seconds"], "fp8_tok_s": batch / best["seconds"],
                "speedup": bf16["seconds"] / best["seconds"],
                "bf16_kv_bytes": 2 * batch * ctx * hh[1] * d * 2,
                "fp8_kv_bytes": 2 * batch * ctx * hh[1] * (d + 4)})


def prefill_configs(smoke: bool) -> list[dict]:
    if smoke:
        return [{}, {"block_q": 32, "block_kv": 32}]
    return [{}, {"evict_first": True}, {"num_stages": 3}, {"block_q": 64},
            {"block_q": 64, "num_stages": 2}, {"num_stages": 2}, {"mask_q": True},
            {"block_kv": 128, "num_warps": 8, "num_stages": 3}, {"block_kv": 32}]


def cudnn_dense(batch: int, seq: int, heads: int, d: int, smoke: bool) -> dict:
    """cuDNN (XLA on CPU) causal attention on the dense [batch, seq, H, D] equivalent."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (batch, seq, heads, d)
    q, k, v = (jax.random.normal(x, shape, BF16) for x in (k1, k2, k3))
    impl = "xla" if smoke else "cudnn"
    fn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                   implementation=impl))
    return measure(fn, q, k, v)


def check_mixed(smoke: bool, results: dict) -> None:
    """Ragged mixed batches (decode + prefix-cached + plain prefill + padding) vs reference."""
    seqs = [(1, 300), (37, 37), (0, 0), (120, 700), (1, 1), (64, 129), (1, 48)]
    cases = [((32, 8), 128, 16, BF16), ((12, 4), 64, 8, jnp.float32), ((32, 32), 128, 32, BF16)]
    rows = []
    for i, (heads, d, b, dtype) in enumerate(cases[:1] if smoke else cases):
        case = make_case(10 + i, heads=heads, seqs=seqs, head_dim=d, block_size=b,
                         dtype=dtype)
        ref = paged_attention_reference(**case, scale=0.1, soft_cap=30.0)
        for knobs in ({}, {"prefetch_pages": True}, {"max_q_len": 1, "kv_splits": 3},
                      {"max_q_len": 1, "single_loop": True, "evict_first": True}):
            out = attention_fn(0.1, smoke, knobs, soft_cap=30.0)(**case)
            rows.append({"heads": heads, "head_dim": d, "block_size": b,
                         "dtype": jnp.dtype(dtype).name, "knobs": knobs,
                         "rel_err": rel_err(out, ref)})
            print(f"mixed {rows[-1]}", flush=True)
    results["mixed_checks"] = rows
    bad = [r for r in rows if not r["rel_err"] < (2e-2 if r["dtype"] == "bfloat16" else 1e-4)]
    if bad:
        raise AssertionError(f"mixed-batch mismatch: {bad}")


def bench_prefill(smoke: bool, results: dict) -> None:
    n_seq, seq_len = (2, 40) if smoke else (8, 2048)
    heads, d = ((4, 4), 32) if smoke else (HEADS["llama2-7b"], 128)
    seqs = [(seq_len, seq_len)] * n_seq
    case = make_case(1, heads=heads, seqs=seqs, head_dim=d)
    print("prefill", flush=True)
    best, rows = tune_ours(case, prefill_configs(smoke), smoke)
    flops = 4 * d * heads[0] * attn_pairs(seqs)
    cudnn = cudnn_dense(n_seq, seq_len, heads[0], d, smoke)
    results["prefill"] = {"seqs": n_seq, "new_tokens": seq_len, "flops": flops,
                          "ours": best, "ours_sweep": rows, "cudnn": cudnn,
                          "cudnn_seconds": cudnn["seconds"],
                          "ours_tflops": flops / best["seconds"] / 1e12,
                          "cudnn_tflops": flops / cudnn["seconds"] / 1e12,
                          "alibi": alibi_cost(case, best["config"], smoke,
                                             sweep=prefill_configs(smoke))}
    del case
    cached, new = (20, 8) if smoke else (596, 104)
    n = 4 if smoke else 64
    out = {}
    for label, q_len in (("uncached", cached + new), ("cached", new)):
        seqs = [(q_len, cached + new)] * n
        case = make_case(2, heads=heads, seqs=seqs, head_dim=d)
        print(f"prefix prefill {label}", flush=True)
        best_c, _ = tune_ours(case, prefill_configs(smoke), smoke)
        out[label] = {"ours": best_c, "flops": 4 * d * heads[0] * attn_pairs(seqs),
                      "tflops": 4 * d * heads[0] * attn_pairs(seqs) / best_c["seconds"] / 1e12,
                      "alibi": alibi_cost(case, best_c["config"], smoke,
                                          sweep=prefill_configs(smoke))}
        del case
    out["speedup"] = out["uncached"]["ours"]["seconds"] / out["cached"]["ours"]["seconds"]
    out["flop_ratio"] = out["uncached"]["flops"] / out["cached"]["flops"]
    results["prefix_prefill"] = out


def bench_copy(smoke: bool, results: dict) -> None:
    """Device copy ceiling: bytes read + written per second for a large array."""
    x = jnp.ones((1 << (20 if smoke else 30),), BF16)
    m = measure(jax.jit(lambda a: a * 2), x)
    results["copy_tb_s"] = 2 * x.size * 2 / m["seconds"] / 1e12
    results["copy_tb_s_wall"] = 2 * x.size * 2 / m["wall_seconds"] / 1e12


def table(results: dict) -> str:
    lines = [f"jax {jax.__version__} | {jax.devices()[0].device_kind}",
             "| case (device time per call) | ours | peer | target |",
             "| --- | --- | --- | --- |"]
    for r in results.get("decode", []):
        peer = f"{r['jax_ops_tb_s']:.2f} TB/s (jax ops, tuned)" if r["jax_ops_tb_s"] else "-"
        lines.append(f"| decode {r['model']} B{r['batch']} ctx{r['ctx']} | "
                     f"{r['ours_tb_s']:.2f} TB/s | {peer} | >= 3.0 TB/s |")
    if "prefill" in results:
        p = results["prefill"]
        lines.append(f"| prefill {p['seqs']}x{p['new_tokens']} | {p['ours_tflops']:.0f} "
                     f"TFLOP/s | {p['cudnn_tflops']:.0f} TFLOP/s (cuDNN dense) | >= 300 |")
    if "prefix_prefill" in results:
        pp = results["prefix_prefill"]
        lines.append(
            f"| prefix prefill cached vs uncached | {pp['speedup']:.2f}x less time "
            f"({pp['cached']['ours']['seconds'] * 1e3:.3f} vs "
            f"{pp['uncached']['ours']['seconds'] * 1e3:.3f} ms) | FLOP ratio "
            f"{pp['flop_ratio']:.2f} | >= 3x |")
    for w in results.get("write_kv", []):
        lines.append(f"| write_kv {w['variant']} {w['tokens']} tok | {w['seconds'] * 1e6:.1f} us | "
                     f"aliased {w['alias_bytes']} of {w['cache_bytes']} B, "
                     f"{w['cache_copies_in_hlo']} cache copies | in place |")
    for r in results.get("fp8_decode", []):
        lines.append(f"| decode {r['model']} B{r['batch']} ctx{r['ctx']}, {r['format']} cache "
                     f"| {r['fp8_tok_s']:.0f} tok/s per layer call "
                     f"({r['fp8_kv_bytes'] / r['fp8']['seconds'] / 1e12:.2f} TB/s) | bf16 "
                     f"{r['bf16_tok_s']:.0f} tok/s: {r['speedup']:.2f}x | >= 1.8x |")
    for label, r in alibi_rows(results):
        lines.append(f"| ALiBi cost, {label} | {r['overhead']:+.1%} "
                     f"({r['on_seconds'] * 1e3:.3f} vs {r['off_seconds'] * 1e3:.3f} ms); "
                     f"own best tiling {r.get('own_best', r)['overhead']:+.1%} | no bias "
                     f"| <= +5% |")
    if "copy_tb_s" in results:
        lines.append(f"| device copy (ceiling) | {results['copy_tb_s']:.2f} TB/s | | |")
    return "\n".join(lines)


def alibi_rows(results: dict) -> list[tuple[str, dict]]:
    """(label, alibi_cost result) of each section row that has one."""
    rows = [(f"decode {r['model']} B{r['batch']}", r["alibi"])
            for r in results.get("decode", []) if "alibi" in r]
    if "alibi" in results.get("prefill", {}):
        rows.append(("prefill", results["prefill"]["alibi"]))
    for label in ("uncached", "cached"):
        r = results.get("prefix_prefill", {}).get(label, {})
        if "alibi" in r:
            rows.append((f"prefix prefill {label}", r["alibi"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    parser.add_argument("--sections", default="copy,write_kv,mixed,decode,prefill",
                        help="comma-separated: copy, write_kv, mixed, decode, prefill, fp8")
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=sorted(FP8_NAMES),
                        help="the fp8 format of section fp8")
    args = parser.parse_args(argv)
    results = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
               "date": time.strftime("%Y-%m-%d"), "decode": [], "errors": []}
    sections = {"copy": bench_copy, "write_kv": bench_write_kv, "decode": bench_decode,
                "prefill": bench_prefill, "mixed": check_mixed,
                "fp8": functools.partial(bench_fp8_decode, fmt=args.kv_cache_dtype)}
    for name in args.sections.split(","):
        guarded(results, name, functools.partial(sections[name], args.smoke, results),
                args.output_json)
    print(table(results))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
