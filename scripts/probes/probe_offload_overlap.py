"""Do the host tier's save (device -> pinned host) and load (pinned host -> device) of one
step run side by side, and beside the device's compute, or one after the other?

Llama-2-7B's restore TTFT (108 ms) equals the save of the prefix it evicts (46 ms) plus
its own load (57 ms) plus a short prefill: this says whether the two copies, and a copy
and a step's kernels, serialise on the device. Times, each the median of --repeats: the
save alone, the load alone, both queued back to back, a matmul chain of about the same
length alone, and that chain queued with each copy. Overlapped: "both" near the larger of
the two; serialised: near their sum.

    python scripts/probes/probe_offload_overlap.py --model llama-2-7b --prefix-len 2000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jprefix import LLM, load  # noqa: E402
from jprefix.worker.offload import KVOffloader  # noqa: E402
from scripts.kernel_timing import wall_median  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--matmul-size", type=int, default=8192, help="the compute chain's n")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    model = load(args.model, dtype=args.dtype, load_format="dummy")
    n = -(-args.prefix_len // 16)
    llm = LLM(model, block_size=16, num_kv_blocks=4 * n + 8)
    runner = llm.engine.runner
    off = KVOffloader(runner, 2 * n)
    first, second = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    off.move(list(zip(second, range(n, 2 * n), strict=True)), [])  # slots n.. hold data
    off.flush()

    def save() -> None:
        off.move(list(zip(first, range(n), strict=True)), [])
        off.flush()

    def load_back() -> None:
        off.after_step(off.move([], list(zip(range(n, 2 * n), second, strict=True))))
        jax.block_until_ready(runner.kv_cache)

    def both() -> None:
        staged = off.move(list(zip(first, range(n), strict=True)),
                          list(zip(range(n, 2 * n), second, strict=True)))
        off.after_step(staged)
        off.flush()
        jax.block_until_ready(runner.kv_cache)

    m = args.matmul_size
    a = jnp.ones((m, m), jnp.bfloat16)
    chain = jax.jit(lambda x: x @ x @ x @ x)
    jax.block_until_ready(chain(a))

    def compute() -> None:
        jax.block_until_ready(chain(a))

    def compute_and(copy):
        def run() -> None:
            out = chain(a)
            copy()
            jax.block_until_ready(out)
        return run

    times = {name: round(wall_median(fn, args.repeats) * 1e3, 3) for name, fn in [
        ("save_ms", save), ("load_ms", load_back), ("save_and_load_ms", both),
        ("compute_ms", compute), ("compute_and_save_ms", compute_and(save)),
        ("compute_and_load_ms", compute_and(load_back))]}
    row = {"model": args.model, "blocks": n, "bytes": n * off.block_bytes,
           "pinned": off.pinned, "device": str(jax.devices()[0].device_kind), **times}
    for k, v in row.items():
        print(f"{k:>22} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
