"""EngineStats: the engine's request and token counters and latency histograms (host).

Plain Python numbers, updated on the engine thread and read by anyone (the server's
/metrics exports them under vLLM's names: `jprefix.entrypoints.metrics`). Times are
`time.monotonic()` seconds, as a Sequence's `arrival_time`.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Iterable
from typing import Any

from jprefix.core.scheduler import SchedulerOutput
from jprefix.core.sequence import Sequence
from jprefix.engine.spec_stats import SpecDecodingStats

# vLLM's bucket bounds (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Observations counted per bucket: `counts[i]` is the number of values <= bounds[i]
    and > bounds[i - 1]; `counts[-1]` those above every bound (+Inf)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        """Counts `value` `times` times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations <= it) pairs, ending with ("+Inf", count)."""
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class EngineStats:
    """Counters since the engine started: prompt tokens (counted when a request's first
    token is sampled), generated tokens, preemptions, finished requests by finish
    reason; histograms of time to first token, inter-token latency and end-to-end
    latency."""

    def __init__(self, spec_k: int = 0):
        """`spec_k`: speculative decoding's num_speculative_tokens (0: off)."""
        self.prompt_tokens = self.generation_tokens = self.num_preemptions = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        # request id -> when its latest token was sampled (host clock), while it runs
        self._last_token: dict[str, float] = {}
        self.spec = SpecDecodingStats(spec_k)  # speculative decoding (`spec_stats`)

    @classmethod
    def merged(cls, parts: Iterable[EngineStats]) -> EngineStats:
        """The sum of several engines' counters and histograms (data-parallel replicas:
        one /metrics for all of them); a snapshot, not updated afterwards."""
        out = cls()
        for part in parts:
            out.prompt_tokens += part.prompt_tokens
            out.generation_tokens += part.generation_tokens
            out.num_preemptions += part.num_preemptions
            out.finished.update(part.finished)
            out.spec.add(part.spec)
            for name in ("ttft", "itl", "e2e"):
                mine, theirs = getattr(out, name), getattr(part, name)
                mine.counts = [a + b for a, b in zip(mine.counts, theirs.counts, strict=True)]
                mine.sum += theirs.sum
                mine.count += theirs.count
        return out

    def record_schedule(self, out: SchedulerOutput) -> None:
        self.num_preemptions += len(out.preempted)

    def record_tokens(self, out: SchedulerOutput) -> None:
        """After a step's tokens are applied: one generated token per sampling row of a
        live sequence. The rows of a decode batch mostly share their previous token's
        time (the step before): each distinct time is one histogram observation with
        its count."""
        now = time.monotonic()
        gaps: dict[float, int] = {}
        tokens = 0
        for sc in out.scheduled:
            if not sc.sample:
                continue
            seq = sc.seq
            if seq.finish_reason == "abort":
                continue
            last = self._last_token.get(seq.request_id)
            self._last_token[seq.request_id] = now
            tokens += 1
            if last is None:
                self.ttft.observe(now - seq.arrival_time)
                self.prompt_tokens += seq.num_prompt_tokens
            else:
                gaps[last] = gaps.get(last, 0) + 1
        for last, times in gaps.items():
            self.itl.observe(now - last, times)
        self.generation_tokens += tokens

    def record_finished(self, seqs: Iterable[Sequence]) -> None:
        now = time.monotonic()
        for seq in seqs:
            self._last_token.pop(seq.request_id, None)
            self.finished[seq.finish_reason or "abort"] += 1
            self.e2e.observe(now - seq.arrival_time)


CACHE_COUNTERS = ("num_queried_tokens", "num_hit_tokens", "num_cached_blocks",
                   "num_evictable_blocks")


def summarize_stats(replicas: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The /stats body: the prefix cache's counters summed over replicas (the keys and
    hit rate a single engine reports), `extra`, and `replicas`, one dict per replica."""
    out: dict[str, Any] = {k: sum(r[k] for r in replicas) for k in CACHE_COUNTERS}
    queried = out["num_queried_tokens"]
    out["hit_rate"] = out["num_hit_tokens"] / queried if queried else 0.0
    return out | extra | {"replicas": replicas}


def engine_counters(num_requests: int, unfinished: list[Any], scheduler: Any,
                    kv_tier: Any) -> dict[str, Any]:
    """An engine's counters: requests received, running and waiting; queued tokens (the
    prompt tokens of every unfinished request plus the output tokens of the running
    ones: what the data-parallel router balances); the prefix cache's counters and hit
    rate; KV blocks used of the cache's (block 0, the null block, not counted); the host
    tier's (`kv_tier`, or None)."""
    running = list(scheduler.running.values())
    cache, blocks = scheduler.prefix_pool.stats(), scheduler.block_manager
    used, total = blocks.num_used_blocks, blocks.num_blocks - 1
    return {"requests": num_requests, "running": len(running),
            "waiting": max(0, len(unfinished) - len(running)),  # (two snapshots)
            "queued_tokens": sum(s.num_prompt_tokens for s in unfinished)
            + sum(s.num_output_tokens for s in running),
            "num_queried_tokens": cache.num_queried_tokens,
            "num_hit_tokens": cache.num_hit_tokens, "hit_rate": cache.hit_rate,
            "num_cached_blocks": cache.num_cached_blocks,
            "num_evictable_blocks": cache.num_evictable_blocks,
            "kv_used_blocks": used, "kv_total_blocks": total, "kv_usage": used / total,
            "num_host_hit_tokens": cache.num_host_hit_tokens,
            **({} if kv_tier is None else kv_tier.counters())}
