"""Cascade vs plain paged decode attention: B sequences sharing a prefix.

Each sequence holds the shared prefix (`--prefix` tokens, whole blocks, the same
physical blocks for all) and `--own` tokens of its own; one decode query each. Times the
plain paged kernel over the full block tables against `cascade_attention` (prefix once
per group + per-sequence suffix + merge), after checking both against the reference.
Times are device times per call (kernel_timing.measure: the kernels' busy time in a
profiler trace); the JSON also has the wall time of back-to-back calls.

    python scripts/bench_cascade.py --output-json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cascade_attention import (
    cascade_attention,
    default_suffix_block_sizes,
    resolve_prefix_block_sizes,
)
from pallas_kernels.fp8 import FP8_NAMES, quantize_rows
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from scripts.kernel_timing import measure, rel_err

B = 16  # block size


def make_case(rng, seqs: int, prefix: int, own: int, heads=(32, 32), d=128,
              kv_cache_dtype: str = "auto"):
    """(plain args, cascade args, fp8 scales as keyword arguments: {} for bf16)."""
    h, k = heads
    pb, ob = prefix // B, -(-own // B)
    n = 1 + pb + seqs * ob
    shape = (1, k, n, B, d)
    kc = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    scales = {}
    if kv_cache_dtype != "auto":  # the engine's fp8 cache: per-row scales
        kc, ks = quantize_rows(kc, FP8_NAMES[kv_cache_dtype])
        vc, vs = quantize_rows(vc, FP8_NAMES[kv_cache_dtype])
        scales = {"k_scale": ks, "v_scale": vs}
    ids = rng.permutation(np.arange(1, n))
    prefix_ids, own_ids = ids[:pb], ids[pb:].reshape(seqs, ob)
    full = np.concatenate([np.tile(prefix_ids, (seqs, 1)), own_ids], axis=1).astype(np.int32)
    kv_lens = np.full(seqs, prefix + own, np.int32)
    cu = np.arange(seqs + 1, dtype=np.int32)
    q = jnp.asarray(rng.standard_normal((seqs, h, d)), jnp.bfloat16)
    plain = (q, kc, vc, jnp.int32(0), jnp.asarray(full), jnp.asarray(kv_lens), jnp.asarray(cu))
    cascade = (q, kc, vc, jnp.int32(0), jnp.asarray(prefix_ids[None].astype(np.int32)),
               jnp.asarray([prefix], jnp.int32), jnp.asarray([0, seqs], jnp.int32),
               jnp.asarray(own_ids.astype(np.int32)), jnp.asarray(np.full(seqs, own, np.int32)),
               jnp.asarray(cu))
    return plain, cascade, scales


def parts(casc, scale, interpret=False, scales=None, **timing):
    """The cascade's two kernel calls alone: (suffix seconds, shared-prefix seconds).
    (The arrays go in as arguments: a jit closing over them would bake them in; the fp8
    `scales` go in as the jitted ops' keyword arguments; `timing`: `measure`'s reps.)"""
    q, kc, vc, layer, ptab, plen, pcu, stab, slen, cu = casc
    attn = functools.partial(paged_attention, scale=scale, return_lse=True,
                             interpret=interpret, **(scales or {}))
    # both parts as cascade_attention runs them by default (it also prepends an empty
    # group: no work)
    suffix_bs = default_suffix_block_sizes(kc, 1)
    suffix = measure(functools.partial(attn, max_q_len=1, block_sizes=suffix_bs),
                     q, kc, vc, layer, stab, slen, cu, **timing)
    prefix = measure(functools.partial(attn, causal=False,
                                       block_sizes=resolve_prefix_block_sizes(q, kc)),
                     q, kc, vc, layer, ptab, plen, pcu, **timing)
    return suffix["seconds"], prefix["seconds"]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prefix", type=int, nargs="+", default=[592, 2048])
    ap.add_argument("--own", type=int, default=232)  # 104 prompt + 128 generated
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *sorted(FP8_NAMES)],
                    help="auto: bf16 caches; an fp8 format: the engine's fp8 cache")
    args = ap.parse_args(argv)
    heads, d = ((4, 4), 32) if args.smoke else ((32, 32), 128)
    if args.smoke:
        args.seqs, args.prefix, args.own = [4], [32], 8
    rng = np.random.default_rng(0)
    scale = 1 / math.sqrt(d)
    timing = dict(reps=2, inner=1) if args.smoke else {}  # (interpret mode is slow)
    rows = []
    for prefix in args.prefix:
        for seqs in args.seqs:
            plain, casc, scales = make_case(rng, seqs, prefix, args.own, heads, d,
                                            args.kv_cache_dtype)
            ref = paged_attention_reference(*plain, scale=scale, **scales)
            plain_fn = functools.partial(paged_attention, scale=scale, max_q_len=1,
                                         interpret=args.smoke, **scales)
            casc_fn = functools.partial(cascade_attention, scale=scale, max_q_len=1,
                                        interpret=args.smoke, **scales)
            out_p, out_c = plain_fn(*plain), casc_fn(*casc)
            m_p, m_c = measure(plain_fn, *plain, **timing), measure(casc_fn, *casc, **timing)
            t_p, t_c = m_p["seconds"], m_c["seconds"]
            t_suffix, t_prefix = parts(casc, scale, args.smoke, scales, **timing)
            row_bytes = d * 2 if not scales else d + 4  # (an fp8 row and its scale)
            kv_bytes = 2 * seqs * (prefix + args.own) * heads[1] * row_bytes
            rows.append(dict(seqs=seqs, prefix=prefix, own=args.own, plain_ms=t_p * 1e3,
                             cascade_ms=t_c * 1e3, speedup=t_p / t_c,
                             plain_wall_ms=m_p["wall_seconds"] * 1e3,
                             cascade_wall_ms=m_c["wall_seconds"] * 1e3,
                             suffix_ms=t_suffix * 1e3, prefix_ms=t_prefix * 1e3,
                             suffix_tb_s=2 * seqs * args.own * heads[1] * row_bytes
                             / t_suffix / 1e12, kv_cache_dtype=args.kv_cache_dtype,
                             plain_tb_s=kv_bytes / t_p / 1e12,
                             err_plain=rel_err(out_p, ref), err_cascade=rel_err(out_c, ref)))
            print(rows[-1], flush=True)
            if args.output_json:  # after every case: a timeout keeps what was measured
                with open(args.output_json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(f"\ncascade vs plain paged decode attention (device time), heads "
          f"{heads[0]}/{heads[1]}, D {d}, bf16 q, {args.kv_cache_dtype} cache, block {B}, "
          f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for r in rows:
        print(f"{r['seqs']:4d} seqs x ({r['prefix']} shared + {r['own']} own): plain "
              f"{r['plain_ms']:.3f} ms ({r['plain_tb_s']:.2f} TB/s) | cascade "
              f"{r['cascade_ms']:.3f} ms (suffix {r['suffix_ms']:.3f} ms at "
              f"{r['suffix_tb_s']:.2f} TB/s, prefix {r['prefix_ms']:.3f}) | "
              f"{r['speedup']:.2f}x | rel err "
              f"{r['err_plain']:.1e} / {r['err_cascade']:.1e}")
    return rows


if __name__ == "__main__":
    main()
