"""Online latency against the engine in-process: `jprefix bench latency`
(jprefix/benchmarks/latency.py) run from the checkout, with the same flags.

    python scripts/bench_latency.py --model llama-2-7b --load-format dummy --input-len 700 \
        --prefix-len 596 --output-len 16 --num-prompts 200 --request-rate 8 \
        --latency-bound-ms 320
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jprefix.benchmarks.cli import run_script


def main(argv: list[str] | None = None) -> dict:
    return run_script("latency", argv)


if __name__ == "__main__":
    main()
