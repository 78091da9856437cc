"""Reading a `jax.profiler` trace (Perfetto JSON) for device time: the trace file, its
events, the device processes and the time covered by a set of intervals."""

from __future__ import annotations

import glob
import gzip
import json
import os


def perfetto_file(trace_dir: str) -> str:
    """The perfetto_trace.json.gz that `jax.profiler.start_trace(trace_dir,
    create_perfetto_trace=True)` wrote."""
    path = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    if not path:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    return path[0]


def load_trace(trace_dir: str) -> list[dict]:
    """The trace's events (Chrome trace format dicts)."""
    with gzip.open(perfetto_file(trace_dir)) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [lo, hi) intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def device_pids(events: list[dict]) -> set:
    """The trace's GPU device processes (none on the CPU backend)."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return {pid for pid, n in names.items() if "GPU" in n or "/device:" in n}
