"""The KV-cache write timed in place: `write_kv` (the shipped unique-index row scatter),
the same scatter without unique indices, and an experimental Pallas write (power-of-2 K
only, not shipped). For each: device time per write (16 dependent writes inside one jit,
so no dispatch), time per jitted call, whether the donated cache is aliased rather than
copied (XLA's memory analysis and the cache-sized copies in the compiled HLO), and a
check of one written row. A section of bench_kernels:

    python scripts/bench_kernels.py --sections write_kv --output-json out.json
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_cache import write_kv, write_kv_reference
from scripts.kernel_timing import BF16


def _pallas_write_kernel(slot_ref, layer_ref, k_ref, v_ref, kc_in, vc_in, kc_ref, vc_ref, *,
                         kh, n, b):
    """Experimental Pallas write (power-of-2 K only), timed against write_kv, not shipped."""
    del kc_in, vc_in  # aliased to kc_ref, vc_ref
    t = pl.program_id(0)
    slot = slot_ref[t]
    heads = jnp.arange(kh, dtype=jnp.int32)
    rows = (layer_ref[0] * kh + heads) * (n * b) + slot  # [K] rows of [L*K*N*B, D]
    src = t * kh + heads
    kc_ref[rows] = k_ref[src]
    vc_ref[rows] = v_ref[src]


def _pallas_write(kc, vc, layer, k, v, slots):
    """`write_kv`'s contract (caches [L, K, N, B, D], k and v [T, K, D], slots [T]) as one
    Pallas program per token writing its K rows of the flattened caches."""
    num_layers, kh, n, b, d = kc.shape
    t = k.shape[0]
    flat = (num_layers * kh * n * b, d)
    kc2, vc2 = pl.pallas_call(
        functools.partial(_pallas_write_kernel, kh=kh, n=n, b=b), grid=(t,),
        out_shape=[jax.ShapeDtypeStruct(flat, kc.dtype)] * 2,
        input_output_aliases={4: 0, 5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(slots, jnp.asarray(layer, jnp.int32).reshape(1), k.reshape(t * kh, d),
      v.reshape(t * kh, d), kc.reshape(flat), vc.reshape(flat))
    return kc2.reshape(kc.shape), vc2.reshape(vc.shape)


WRITE_VARIANTS = {
    "write_kv": write_kv,  # shipped: unique-index row scatter, null-block writes dropped
    "nonunique_scatter": write_kv_reference,  # the same scatter without unique indices
    "pallas_experimental": _pallas_write,
}


def _looped(variant, writes=16):
    """`writes` dependent writes inside one jit: device time per write, no dispatch."""
    def run(kc, vc, *args):
        return jax.lax.fori_loop(0, writes, lambda i, c: variant(*c, *args), (kc, vc))
    return jax.jit(run, donate_argnums=(0, 1)), writes


def _time_write(fn, caches, args, reps=20):
    k_cache, v_cache = caches
    for _ in range(3):
        k_cache, v_cache = fn(k_cache, v_cache, *args)
    jax.block_until_ready(k_cache)
    t0 = time.perf_counter()
    for _ in range(reps):
        k_cache, v_cache = fn(k_cache, v_cache, *args)
    jax.block_until_ready(k_cache)
    return (time.perf_counter() - t0) / reps, (k_cache, v_cache)


def bench_write_kv(smoke: bool, results: dict) -> None:
    """results["write_kv"]: one row per variant and token count (the Pallas write is left
    out in `smoke`, which runs tiny shapes on CPU)."""
    layers, kh, d, b = (2, 4, 32, 16) if smoke else (2, 32, 128, 16)
    n = 64 if smoke else 8192
    shape = (layers, kh, n, b, d)
    caches = (jnp.zeros(shape, BF16) + 1, jnp.zeros(shape, BF16) + 2)
    dims = ",".join(map(str, shape))
    rows = []
    for tokens in ((8, 64) if smoke else (256, 16384)):
        slots = jnp.asarray(np.random.default_rng(tokens).permutation(np.arange(b, n * b))[:tokens],
                            jnp.int32)
        k = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, kh, d), BF16)
        args = (jnp.int32(1), k, -k, slots)
        for name, variant in WRITE_VARIANTS.items():
            if name == "pallas_experimental" and smoke:
                continue
            fn = jax.jit(variant, donate_argnums=(0, 1))
            looped, writes = _looped(variant)
            try:
                compiled = fn.lower(*caches, *args).compile()
                t_call, caches = _time_write(fn, caches, args)
                t, caches = _time_write(looped, caches, args)
                t /= writes
            except Exception as e:
                print(f"write {name} failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            mem = compiled.memory_analysis()
            copies = [line for line in compiled.as_text().splitlines()
                      if " copy(" in line and f"[{dims}]" in line.split(" copy(")[0]]
            s0 = int(slots[0])
            ok = bool(jnp.array_equal(caches[0][1, :, s0 // b, s0 % b], k[0])
                      & jnp.array_equal(caches[1][1, :, s0 // b, s0 % b], -k[0]))
            rows.append({"variant": name, "tokens": tokens, "seconds": t, "correct": ok,
                         "seconds_per_call": t_call,
                         "cache_bytes": 2 * caches[0].size * caches[0].dtype.itemsize,
                         "alias_bytes": getattr(mem, "alias_size_in_bytes", None),
                         "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
                         "cache_copies_in_hlo": len(copies)})
            print(f"write_kv {rows[-1]}", flush=True)
    results["write_kv"] = rows

