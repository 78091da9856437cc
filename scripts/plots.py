"""PNG charts of the headline comparisons, read from bench_throughput / bench_latency JSON.

    python scripts/plots.py results/*.json --out-dir results/

Throughput files give one bar chart each (output tok/s and prefill tokens computed per
configuration); latency files give E2E / TTFT percentiles per trial, and all latency files
together a chart of the highest QPS within the latency bound; bench_engine files give
output tok/s per engine mode and output length, and TTFT; several throughput files
together also a chart of their KV memory (kv_memory.png). matplotlib is optional
(`pip install matplotlib`, or the project's `bench` extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json


def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("plots need matplotlib: pip install matplotlib "
                         "(or pip install -e '.[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label(run: dict) -> str:
    return f"{run['policy']}\ncache {'on' if run['enable_prefix_caching'] else 'off'}"


def _bar_panels(names: list[str], rows: list[dict], panels: list[tuple[str, str]],
                suptitle: str, out: Path, plt, color: str) -> Path:
    """One bar chart per (key, title) in `panels`, side by side: rows[i][key] per name."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.bar_label(ax.bar(names, [r[key] for r in rows], color=color), fmt="%.0f")
        ax.set_title(title)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def dataset_name(args: dict) -> str:
    """The run's dataset (files written before `jprefix bench` name it `dataset`)."""
    return args.get("dataset_name", args.get("dataset"))


def plot_throughput(result: dict, out: Path, plt) -> Path:
    runs = result["runs"]
    return _bar_panels([label(r) for r in runs], runs,
                       [("output_tokens_per_s", "output tokens / s"),
                        ("prefill_tokens_computed", "prefill tokens computed")],
                       f"{result['model']}: {dataset_name(result['args'])}, "
                       f"{runs[0]['requests']} requests", out, plt, "tab:blue")


def plot_latency(result: dict, out: Path, plt) -> Path:
    trials = sorted(result["trials"], key=lambda t: t["request_rate"])
    rate = [t["request_rate"] for t in trials]  # offered: overloaded trials achieve less
    fig, ax = plt.subplots(figsize=(6, 4))
    for metric, stat, style in [("e2e_ms", "mean", "-o"), ("e2e_ms", "p90", "--o"),
                                ("ttft_ms", "p90", ":o")]:
        ax.plot(rate, [t[metric][stat] for t in trials], style, label=f"{metric[:-3]} {stat}")
    if result.get("latency_bound_ms"):
        ax.axhline(result["latency_bound_ms"], color="gray", lw=0.8, label="bound")
    ax.set_yscale("log")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("latency (ms)")
    cache = "on" if result["enable_prefix_caching"] else "off"
    ax.set_title(f"{result['model']}: {result['policy']}, prefix cache {cache}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_qps_at_bound(results: list[dict], out: Path, plt) -> Path:
    names = [f"{r['policy']}, cache {'on' if r['enable_prefix_caching'] else 'off'}"
             for r in results]
    qps = [r["at_bound"]["achieved_qps"] if r.get("at_bound") else 0.0 for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar_label(ax.bar(names, qps, color="tab:green"), fmt="%.1f")
    bound = results[0]["latency_bound_ms"]
    ax.set_title(f"highest QPS with {results[0]['latency_metric']} E2E <= {bound:g} ms")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_kv_memory(results: list[dict], names: list[str], out: Path, plt) -> Path:
    """Several throughput files side by side: KV blocks of the prefix cache and at peak
    (RESULTS row (c): trie vs flat per-prefix caching)."""
    return _bar_panels(names, [r["runs"][0] for r in results],
                       [("prefix_cache_blocks", "prefix-cache KV blocks"),
                        ("peak_kv_blocks", "peak KV blocks in use")],
                       f"{results[0]['model']}: KV memory, "
                       f"{results[0]['runs'][0]['requests']} requests each", out, plt,
                       "tab:purple")


def plot_engine(result: dict, out: Path, plt) -> Path:
    """bench_engine.py JSON: output tok/s per mode and output length, and TTFT."""
    runs = {k[len("throughput_"):]: v for k, v in result.items() if k.startswith("throughput_")}
    ttft = {k[len("ttft_ms_"):]: v for k, v in result.items() if k.startswith("ttft_ms_")}
    fig, axes = plt.subplots(1, 2 if ttft else 1, figsize=(10 if ttft else 6, 4),
                             squeeze=False)
    names = [k.replace("_out", "\nout ").replace("on_nocascade", "on, no cascade")
             for k in runs]
    bars = axes[0][0].bar(names, [r["output_tok_s"] for r in runs.values()], color="tab:blue")
    axes[0][0].bar_label(bars, fmt="%.0f")
    axes[0][0].set_title("output tokens / s (cache on = with cascade decode)")
    if ttft:
        bars = axes[0][1].bar(list(ttft), list(ttft.values()), color="tab:orange")
        axes[0][1].bar_label(bars, fmt="%.1f")
        axes[0][1].set_title("time to first token (ms), one request")
    fig.suptitle(f"{result['model']}: {result['num_prompts']} x ({result['prefix_len']} shared "
                 f"+ {result['unique_len']}) tokens")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="files written with --output-json")
    ap.add_argument("--out-dir", default=None, help="default: next to each JSON file")
    args = ap.parse_args(argv)
    plt = _pyplot()
    written, swept, throughput = [], [], []
    for name in args.json:
        path = Path(name)
        result = json.loads(path.read_text())
        out = (Path(args.out_dir) if args.out_dir else path.parent) / f"{path.stem}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        if result.get("benchmark") == "throughput":
            written.append(plot_throughput(result, out, plt))
            throughput.append((path.stem, result))
        elif any(k.startswith("throughput_") for k in result):  # bench_engine.py
            written.append(plot_engine(result, out, plt))
        elif result.get("benchmark") == "latency":
            written.append(plot_latency(result, out, plt))
            if result.get("latency_bound_ms") is not None:
                swept.append(result)
        else:
            raise SystemExit(f"{path}: not a bench_throughput, bench_latency or bench_engine "
                             "JSON file")
    if len(swept) > 1:
        out_dir = Path(args.out_dir) if args.out_dir else Path(args.json[0]).parent
        written.append(plot_qps_at_bound(swept, out_dir / "qps_at_latency_bound.png", plt))
    if len(throughput) > 1:
        out_dir = Path(args.out_dir) if args.out_dir else Path(args.json[0]).parent
        names = [name for name, _ in throughput]
        written.append(plot_kv_memory([r for _, r in throughput], names,
                                      out_dir / "kv_memory.png", plt))
    for p in written:
        print(p)
    return written


if __name__ == "__main__":
    main()
