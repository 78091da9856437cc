"""When each request of an online benchmark is sent: a gamma renewal process, as vLLM's
`vllm bench serve` draws it. Gaps between requests are gamma(shape=burstiness,
scale=1 / (rate * burstiness)): mean 1 / rate at every burstiness; burstiness 1 is a
Poisson process, below 1 burstier (more short and long gaps), above 1 more even. An
infinite rate sends every request at time 0."""

from __future__ import annotations

import math

import numpy as np


def arrival_intervals(n: int, rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> np.ndarray:
    """Seconds between request i - 1 and request i (the first: from the start), [n]."""
    if n < 0:
        raise ValueError(f"the number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate {rate} must be > 0 (inf: all at once)")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness {burstiness} must be a finite number > 0")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of n requests is sent (non-decreasing)."""
    return np.cumsum(arrival_intervals(n, rate, burstiness, seed)).tolist()
