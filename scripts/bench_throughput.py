"""Offline throughput: `jprefix bench throughput` (jprefix/benchmarks/throughput.py) run
from the checkout, with the same flags.

    python scripts/bench_throughput.py --model llama-2-7b --load-format dummy \
        --input-len 700 --prefix-len 596 --output-len 128 --num-prompts 256 --compare-caching
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jprefix.benchmarks.cli import run_script


def main(argv: list[str] | None = None) -> dict:
    return run_script("throughput", argv)


if __name__ == "__main__":
    main()
