"""Timing and test cases shared by the kernel benchmarks (bench_kernels, bench_write_kv,
bench_cascade, bench_gemm, bench_moe, sweep_attention; the copy timings of bench_offload
and probe_offload_copy).

Times: `timeit` is the wall time of back-to-back calls (`wall_median`: of calls that
sync themselves, e.g. host copies); `device_times` reads a
`jax.profiler` trace for the device time of the same calls (none on the CPU backend);
`measure` gives both, preferring device time. Cases: `make_case` builds a ragged batch over
a shuffled paged KV cache in `paged_attention`'s argument order, and `attention_fn` binds
its tuning knobs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8 import FP8_NAMES, quantize_rows
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention_tiling import BlockSizes
from scripts.device_trace import device_pids, load_trace, union_length

BF16 = jnp.bfloat16
BLOCK_SIZES_FIELDS = {f.name for f in dataclasses.fields(BlockSizes)}


def timeit(fn: Callable, *args, reps: int = 15, inner: int = 5) -> float:
    """Median seconds per call: back-to-back calls, synchronised once per repetition."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def wall_median(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls of fn after one warm-up call; fn must
    finish its own work before it returns (a copy fetched, a block_until_ready)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_times(fn: Callable, *args, reps: int = 20) -> dict | None:
    """Device time per call from a `jax.profiler` trace of `reps` back-to-back calls:
    `busy_us` (union of the call's kernels), `span_us` (first kernel start to last end,
    over reps: what the device spends per call when calls queue back to back), and
    `kernels` (name -> microseconds per call). None where the trace has no device
    kernels (the CPU backend)."""
    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="jprefix-kernel-trace-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
    finally:  # (a trace left running would make every later start_trace fail)
        jax.profiler.stop_trace()
    try:
        events = load_trace(trace_dir)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    devices = device_pids(events)
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
             if e.get("ph") == "X" and e["pid"] in devices]
    if not spans:
        return None
    per_name: dict[str, float] = {}
    for lo, hi, name in spans:
        per_name[name[:160]] = per_name.get(name[:160], 0.0) + (hi - lo) / reps
    return dict(busy_us=union_length([(lo, hi) for lo, hi, _ in spans]) / reps,
                span_us=(max(s[1] for s in spans) - min(s[0] for s in spans)) / reps,
                kernels=dict(sorted(per_name.items(), key=lambda kv: -kv[1])))


def measure(fn: Callable, *args, reps: int = 15, inner: int = 5) -> dict:
    """`seconds`: device time per call (its kernels' busy time from a profiler trace of
    back-to-back calls: what the op costs inside a jitted engine step, with no per-call
    host dispatch) where the backend reports kernels, else wall time; `wall_seconds`:
    back-to-back calls timed on the host (`timeit`, `reps` x `inner` calls; a smoke run
    in interpret mode passes fewer)."""
    wall = timeit(fn, *args, reps=reps, inner=inner)
    dev = device_times(fn, *args, reps=min(10, reps))
    if dev is None:
        return {"seconds": wall, "wall_seconds": wall, "time_source": "wall"}
    # busy time leaves out the gaps between an op's own kernels (a cascade call has more
    # kernels than a plain one); span_seconds, first kernel to last over the calls,
    # includes them and any host-bound idle between calls
    return {"seconds": dev["busy_us"] * 1e-6, "wall_seconds": wall,
            "device_seconds": dev["busy_us"] * 1e-6, "span_seconds": dev["span_us"] * 1e-6,
            "time_source": "device"}


def rel_err(out, ref) -> float:
    """Relative L2 error of `out` against `ref` in float32; NaN where `out` has a NaN."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if np.isnan(out).any():
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def guarded(results: dict, label: str, fn: Callable[[], object],
            output_json: str | None) -> None:
    """Runs fn(); a failure is printed and recorded in results["errors"] under `label`,
    and the run goes on; the JSON is rewritten after each, so a timeout keeps what was
    measured."""
    try:
        fn()
    except Exception:
        traceback.print_exc()
        results["errors"].append(f"{label}: {traceback.format_exc()[-2000:]}")
    if output_json:
        with open(output_json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def make_case(seed: int, *, heads: tuple[int, int], seqs: list[tuple[int, int]],
              block_size: int = 16, head_dim: int = 128, layers: int = 2, dtype=BF16,
              num_blocks: int | None = None, spread: bool = True) -> dict:
    """Ragged batch of (q_len, kv_len) per sequence over a shuffled paged cache.

    `num_blocks` (default: just the blocks used) sizes an engine-like pool: `layers` x
    `num_blocks` blocks per KV head, of which the used ones sit in the last layer, drawn
    from the whole pool (`spread`) or from its first blocks. The rest of the pool holds a
    constant (a 32-layer Llama-2-7B pool of 12k blocks is 50 GB per cache: no random
    fill)."""
    h, kh = heads
    rng = np.random.default_rng(seed)
    blocks = [-(-kv // block_size) for _, kv in seqs]
    m = max(blocks)
    used = sum(blocks)
    n = max(1 + used, num_blocks or 0)
    pool = np.arange(1, n) if spread else np.arange(1, 1 + used)
    physical = rng.permutation(pool)[:used].astype(np.int32)
    tables = np.zeros((len(seqs), m), np.int32)
    offsets = np.cumsum([0] + blocks)
    for s, nb in enumerate(blocks):
        tables[s, :nb] = physical[offsets[s]:offsets[s] + nb]
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (layers, kh, n, block_size, head_dim)
    if num_blocks is None:
        k_cache = jax.random.normal(k2, shape, dtype)
        v_cache = jax.random.normal(k3, shape, dtype)
    else:  # random values in the used blocks of the last layer only, built in place
        fill = (used, kh, block_size, head_dim)  # (the indexed dims go first)

        @jax.jit
        def pool(key, rows):
            vals = jax.random.normal(key, fill, dtype)
            return jnp.full(shape, 0.5, dtype).at[layers - 1, :, rows].set(vals)

        k_cache = pool(k2, jnp.asarray(physical))
        v_cache = pool(k3, jnp.asarray(physical))
    return dict(
        q=jax.random.normal(k1, (int(cu[-1]), h, head_dim), dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        layer=jnp.int32(layers - 1),
        block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32),
        cu_q_lens=jnp.asarray(cu),
    )


def fp8_case(case: dict, fmt: str) -> dict:
    """`case` with its caches quantised to fp8 format `fmt` (the engine's per-row scales:
    `k_scale`, `v_scale` join the case as `paged_attention`'s keyword arguments)."""
    k8, ks = quantize_rows(case["k_cache"], FP8_NAMES[fmt])
    v8, vs = quantize_rows(case["v_cache"], FP8_NAMES[fmt])
    return dict(case, k_cache=k8, v_cache=v8, k_scale=ks, v_scale=vs)


def attn_pairs(seqs: list[tuple[int, int]]) -> int:
    """(query, key) pairs a causal ragged batch computes."""
    return sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in seqs)


def attention_fn(scale: float, interpret: bool, knobs: dict, **fixed) -> Callable:
    """`paged_attention` with its keyword arguments bound: `knobs` and `fixed` hold
    `BlockSizes` fields (gathered into `block_sizes`) and the op's own (max_q_len, ...)."""
    kw = {**fixed, **knobs}
    block = {k: kw.pop(k) for k in list(kw) if k in BLOCK_SIZES_FIELDS}
    return functools.partial(paged_attention, scale=scale, interpret=interpret,
                             block_sizes=BlockSizes(**block), **kw)
