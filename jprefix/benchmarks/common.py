"""Helpers every benchmark shares (the `jprefix bench` commands and the device-side tools in
scripts/): JSON output, the printed table, the engine's replicas, and the engine
benchmarks' shared-prefix workload flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from jprefix.entrypoints.cli_args import add_fp8_flags as add_fp8_flags  # (re-exported)
from jprefix.entrypoints.cli_args import add_spec_flag
from jprefix.entrypoints.cli_args import fp8_kwargs as fp8_kwargs


def write_json(path: str | None, result: Any) -> None:
    """Writes `result` as indented JSON to `path` (its folder made); nothing if None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Right-aligned text columns; `columns` holds (header, row key, format string)."""
    cells = [[c[0] for c in columns]] + [[f.format(r[k]) for _, k, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in cells)


def replicas(llm: Any) -> list:
    """The engine's replicas (LLMEngines): one without data parallelism."""
    return getattr(llm.engine, "replicas", [llm.engine])


def workload_parser(description: str, prompts: bool = True) -> argparse.ArgumentParser:
    """The engine benchmarks' and probes' common flags: the model and its weights, the
    shared-prefix workload of `datasets.make_prompts` (`prompts`: also how many
    requests), the JSON path and the fp8 modes (--kv-cache-dtype, --quantization)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--load-format", default="dummy")
    if prompts:
        ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=596)
    ap.add_argument("--unique-len", type=int, default=104)
    ap.add_argument("--output-json", default=None)
    add_fp8_flags(ap)
    add_spec_flag(ap)
    return ap
