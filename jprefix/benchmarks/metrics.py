"""Latency statistics of the online benchmarks, named as vLLM's `vllm bench serve` names
them: TTFT (time to first token), TPOT (time per output token after the first: (E2EL -
TTFT) / (output tokens - 1), per request), ITL (every gap between two streamed chunks of
a request) and E2EL (end-to-end latency). Each is reported in ms as mean, median, std and
the percentiles asked for (`p50`, `p90`, `p99`, ... keys)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
DEFAULT_METRIC_PERCENTILES = "50,90,99"


def parse_percentile_metrics(text: str) -> list[str]:
    """'ttft,tpot' -> ['ttft', 'tpot']; ValueError naming an unknown metric."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: each must be one of "
                         f"{', '.join(METRICS)}")
    return names


def parse_percentiles(text: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0]; ValueError naming a value outside (0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: not comma-separated numbers") \
            from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: each must be in (0, 100]")
    return values


def percentile_key(p: float) -> str:
    """50.0 -> 'p50', 99.9 -> 'p99.9'."""
    return f"p{p:g}"


def latency_stats(seconds: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean, median, std and each percentile of `seconds`, in milliseconds (linear
    interpolation between order statistics, numpy's default); every value None when
    there is no sample."""
    keys = ["mean", "median", "std"] + [percentile_key(p) for p in percentiles]
    if len(seconds) == 0:
        return dict.fromkeys(keys)
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    values = [ms.mean(), np.median(ms), ms.std()] + [np.percentile(ms, p) for p in percentiles]
    return {k: float(v) for k, v in zip(keys, values, strict=True)}


def tpot(e2el: float, ttft: float, output_tokens: int) -> float | None:
    """Seconds per output token after the first; None for a reply of one token or none."""
    return (e2el - ttft) / (output_tokens - 1) if output_tokens > 1 else None
