"""Probe: what does the ALiBi bias cost the prefill kernels now that a one-head tile
(multi-head attention, `group == 1`) adds one [block_kv] bias row per step instead of a
per-row outer product (GPU; `--smoke` runs anywhere in interpret mode).

The three prefill cases of `bench_kernels.py --sections prefill` (Llama-2-7B heads,
32 x 32, D 128): 8 x 2,048 causal, 64 x 700 uncached, 64 x (596 cached + 104), plus the
cached case at Baichuan2-13B's 40 heads. Each is timed without and with `alibi_slopes(H)`
by `bench_kernels.alibi_cost` (alternating rounds, best of each, biased output checked
against the reference) at a few prefill tilings; the figure is the biased op at its best
tiling against the unbiased op at its best.

    python scripts/probes/probe_alibi_prefill.py --output-json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import json

import jax

from scripts.bench_kernels import alibi_cost
from scripts.kernel_timing import make_case

TILINGS = [{}, {"num_stages": 2}, {"num_stages": 3}, {"block_q": 64},
           {"block_q": 64, "num_stages": 2}]


def cases(smoke: bool) -> list[tuple[str, tuple[int, int], list[tuple[int, int]]]]:
    if smoke:
        return [("tiny", (4, 4), [(24, 40)] * 2)]
    return [("prefill 8 x 2048", (32, 32), [(2048, 2048)] * 8),
            ("uncached 64 x 700", (32, 32), [(700, 700)] * 64),
            ("cached 64 x (596 + 104)", (32, 32), [(104, 700)] * 64),
            ("cached 64 x (596 + 104), 40 heads", (40, 40), [(104, 700)] * 64)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    interpret = args.smoke or jax.default_backend() == "cpu"
    tilings = TILINGS[:2] if args.smoke else TILINGS
    results = []
    for i, (name, heads, seqs) in enumerate(cases(args.smoke)):
        case = make_case(2 + i, heads=heads, seqs=seqs, head_dim=32 if args.smoke else 128)
        print(name, flush=True)
        rows = [alibi_cost(case, t, interpret) for t in tilings]
        off = min(rows, key=lambda r: r["off_seconds"])
        on = min(rows, key=lambda r: r["on_seconds"])
        summary = {"case": name, "off_best": off["config"], "off_seconds": off["off_seconds"],
                   "on_best": on["config"], "on_seconds": on["on_seconds"],
                   "overhead": on["on_seconds"] / off["off_seconds"] - 1, "rows": rows}
        print(f"{name}: best off {off['off_seconds'] * 1e3:.3f} ms {off['config']}, best on "
              f"{on['on_seconds'] * 1e3:.3f} ms {on['config']}: {summary['overhead']:+.1%}",
              flush=True)
        results.append(summary)
        del case
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
