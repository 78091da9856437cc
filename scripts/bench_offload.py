"""Bringing a prefix back from the host tier vs recomputing it, and the tier's copy
bandwidth vs a plain `jax.device_put` / `np.asarray` of the same bytes.

1. Engine: a `--prefix-len`-token prompt is computed, then a second one of the same
   length evicts it from HBM into the host tier (`num_kv_blocks` holds one); the first
   prompt plus one token is asked again (its blocks come back from the host) and timed
   against a fresh prompt of the same length (recomputed). Time to first token, median of
   `--repeats`.
2. Copies: the host tier's save (gather + device -> host) and load (host -> device +
   scatter) of that prefix's blocks, against `jax.device_put` of one host array of the
   same bytes (pageable, and pinned where the device has pinned host memory) and
   `np.asarray` of one device array of the same bytes (GB/s). The load is timed
   in-stream (rows copied straight from the pinned pool, the engine's default where the
   pool is pinned) and staged with each `--load-pieces` (a host gather into pinned
   staging and its DMA split into that many pipelined pieces).

    python scripts/bench_offload.py --model tiny-llama --load-format dummy \
        --prefix-len 2000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from jprefix import LLM, SamplingParams, load  # noqa: E402
from jprefix.worker import host_loads  # noqa: E402
from jprefix.worker.host_rows import pinned_array  # noqa: E402
from jprefix.worker.offload import KVOffloader  # noqa: E402
from scripts.kernel_timing import wall_median  # noqa: E402


def ttft(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                       use_tqdm=False)[0]
    return out.metrics["first_token_time"] - out.metrics["arrival_time"]


def engine_figures(llm: LLM, prefix_len: int, vocab: int, repeats: int, rng) -> dict:
    restore, recompute = [], []
    for r in range(repeats + 1):  # (the first round compiles)
        a, b, c = (rng.integers(3, vocab, prefix_len).tolist() for _ in range(3))
        ttft(llm, a)
        ttft(llm, b)  # evicts a into the host tier
        hits = llm.stats()["num_host_hit_tokens"]
        t_restore = ttft(llm, a + [5])
        assert llm.stats()["num_host_hit_tokens"] > hits, "the prefix did not come back"
        t_recompute = ttft(llm, c + [5])
        if r:
            restore.append(t_restore)
            recompute.append(t_recompute)
    return {"restore_ttft_ms": round(float(np.median(restore)) * 1e3, 2),
            "recompute_ttft_ms": round(float(np.median(recompute)) * 1e3, 2)}


def copy_figures(llm: LLM, prefix_len: int, repeats: int, load_pieces: list[int]) -> dict:
    runner, tier = llm.engine.runner, llm.engine.kv_tier
    n = -(-prefix_len // llm.engine.args.block_size)
    off = KVOffloader(runner, n)
    blocks, slots = list(range(1, n + 1)), list(range(n))
    nbytes = n * off.block_bytes

    def save() -> None:
        off.move(list(zip(blocks, slots, strict=True)), [])
        off.flush()

    def restore() -> None:
        off.after_step(off.move([], list(zip(slots, blocks, strict=True))))
        jax.block_until_ready(runner.kv_cache)

    host = np.ones(nbytes // 4, np.float32)
    dev = jax.device_put(host, next(iter(runner.kv_cache[0].devices())))

    device = next(iter(runner.kv_cache[0].devices()))
    pinned = (pinned_array(host.shape, host.dtype, off.host_shardings[0])[0] if off.pinned
              else host)

    def plain_h2d() -> None:
        jax.block_until_ready(jax.device_put(host, device))

    def pinned_h2d() -> None:
        jax.block_until_ready(jax.device_put(pinned, SingleDeviceSharding(device)))

    def plain_d2h() -> None:
        np.asarray(dev + 0)  # (a fresh array: no cached host copy)

    times = {name: wall_median(fn, repeats) for name, fn in [
        ("save", save), ("device_put", plain_h2d), ("device_put_pinned", pinned_h2d),
        ("asarray", plain_d2h)]}
    default, by_pieces, in_stream = host_loads.LOAD_PIECES, {}, off.in_stream
    off.in_stream = False
    for p in load_pieces:
        host_loads.LOAD_PIECES = p
        by_pieces[p] = wall_median(restore, repeats)
    host_loads.LOAD_PIECES = default
    off.in_stream = in_stream
    times["restore"] = (wall_median(restore, repeats) if in_stream else
                        by_pieces.get(default, min(by_pieces.values())))
    gbs = {k: float(f"{nbytes / v / 1e9:.3g}") for k, v in times.items()}
    del tier
    return {"bytes": nbytes, "blocks": n,
            "save_ms": round(times["save"] * 1e3, 3),
            "restore_ms": round(times["restore"] * 1e3, 3),
            "save_GBs": gbs["save"], "restore_GBs": gbs["restore"],
            "in_stream": in_stream, "device_put_GBs": gbs["device_put"],
            "device_put_pinned_GBs": gbs["device_put_pinned"], "asarray_GBs": gbs["asarray"],
            "restore_vs_device_put": round(times["device_put"] / times["restore"], 3),
            "restore_vs_device_put_pinned": round(times["device_put_pinned"] / times["restore"],
                                                  3),
            "save_vs_asarray": round(times["asarray"] / times["save"], 3),
            "restore_ms_by_pieces": {p: round(t * 1e3, 3) for p, t in by_pieces.items()}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-offloading-size", type=float, default=4.0, help="GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--load-pieces", type=int, nargs="+", default=[1, 2, host_loads.LOAD_PIECES, 8])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = load(args.model, dtype=args.dtype, load_format=args.load_format)
    blocks = -(-(args.prefix_len + 1) // args.block_size)
    llm = LLM(model, block_size=args.block_size, num_kv_blocks=blocks + 2,
              kv_cache_dtype=args.kv_cache_dtype, kv_offloading_size=args.kv_offloading_size,
              max_num_batched_tokens=max(8192, args.prefix_len + 1), enable_cascade=False)
    rng = np.random.default_rng(0)
    row = engine_figures(llm, args.prefix_len, model.config.vocab_size, args.repeats, rng)
    row |= copy_figures(llm, args.prefix_len, args.repeats, args.load_pieces)
    print(f"{args.model}: {args.prefix_len}-token prefix, {row['blocks']} blocks, "
          f"{row['bytes'] / 1e6:.1f} MB, device {jax.devices()[0].device_kind}")
    for k, v in row.items():
        print(f"{k:>24} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "row": row}, f, indent=1)


if __name__ == "__main__":
    main()
