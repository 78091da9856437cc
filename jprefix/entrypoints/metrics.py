"""The server's view of the engine: /stats (JSON) and /metrics (Prometheus text).

Both read one `engine_snapshot`, so at rest they agree number for number. /metrics uses
vLLM's metric names (`vllm:...`, each labelled with `model_name`) through
`prometheus-client`: counters (prompt and generation tokens, finished requests by
`finished_reason`, preemptions, prefix-cache queries and hits in tokens), gauges
(running and waiting requests, KV-cache usage as a fraction) and histograms (time to
first token, inter-token latency, end-to-end latency; `engine.stats.EngineStats`).
Values are read at scrape time from the engine's own counters (no second bookkeeping).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from jprefix.entrypoints.llm import LLM

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")


def engine_snapshot(llm: LLM) -> dict[str, Any]:
    """Requests, blocks and prefix-cache counters now, summed over data-parallel replicas
    (`LLM.stats`, whose per-replica dicts and routing fields it keeps). Blocks:
    `num_total_blocks` usable (block 0 is the null block) = `num_used_blocks` (held by
    requests or pinned) + `num_free_blocks` (allocatable, `num_evictable_blocks` of them
    still cached); `num_cached_blocks` are prefix-trie blocks, in use or evictable."""
    summary, stats = llm.stats(), llm.engine.stats
    replicas = summary["replicas"]
    total = sum(r["kv_total_blocks"] for r in replicas)
    used = sum(r["kv_used_blocks"] for r in replicas)
    return summary | {
        "num_requests_running": sum(r["running"] for r in replicas),
        "num_requests_waiting": sum(r["waiting"] for r in replicas),
        "num_total_blocks": total,
        "num_used_blocks": used,
        "num_free_blocks": total - used,
        "kv_cache_usage": used / total,
        "num_preemptions": stats.num_preemptions,
        "prompt_tokens": stats.prompt_tokens,
        "generation_tokens": stats.generation_tokens,
        "num_finished_requests": dict(stats.finished),
        "spec_decode": stats.spec.summary(),  # (`engine.spec_stats`; zeros when off)
    }


class EngineCollector:
    """A prometheus-client collector reading `engine_snapshot` and the histograms."""

    def __init__(self, llm: LLM, model_name: str):
        self.llm, self.name = llm, model_name

    def _family(self, kind: type, name: str, doc: str, value: float) -> Any:
        family = kind(name, doc, labels=["model_name"])
        family.add_metric([self.name], value)
        return family

    def collect(self):
        s, stats = engine_snapshot(self.llm), self.llm.engine.stats
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(g, "vllm:num_requests_running", "Requests in model execution "
                           "batches.", s["num_requests_running"])
        yield self._family(g, "vllm:num_requests_waiting", "Requests waiting to be "
                           "processed.", s["num_requests_waiting"])
        yield self._family(g, "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 "
                           "percent usage.", s["kv_cache_usage"])
        yield self._family(c, "vllm:prefix_cache_queries", "Prefix cache queries, in "
                           "prompt tokens queried.", s["num_queried_tokens"])
        yield self._family(c, "vllm:prefix_cache_hits", "Prefix cache hits, in prompt "
                           "tokens served from the cache.", s["num_hit_tokens"])
        yield self._family(c, "vllm:num_preemptions", "Cumulative number of preemptions.",
                           s["num_preemptions"])
        yield self._family(c, "vllm:prompt_tokens", "Prefill tokens processed.",
                           s["prompt_tokens"])
        yield self._family(c, "vllm:generation_tokens", "Generation tokens processed.",
                           s["generation_tokens"])
        success = c("vllm:request_success", "Finished requests, by finish reason.",
                    labels=["model_name", "finished_reason"])
        for reason in sorted(set(FINISH_REASONS) | set(stats.finished)):
            success.add_metric([self.name, reason], stats.finished.get(reason, 0))
        yield success
        yield from self._host_tier(s)
        yield from self._spec_decode(s["spec_decode"])
        for name, doc, hist in (
                ("vllm:time_to_first_token_seconds", "Time to first token.", stats.ttft),
                ("vllm:inter_token_latency_seconds", "Time between tokens.", stats.itl),
                ("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                 stats.e2e)):
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.name], hist.cumulative(), sum_value=hist.sum)
            yield family


    def _spec_decode(self, spec: dict[str, Any]):
        """Speculative decoding's counters under vLLM's names (zeros when it is off)."""
        c = CounterMetricFamily
        for name, doc in (("num_drafts", "Verify rows: sequences whose step carried "
                                         "proposals."),
                          ("num_draft_tokens", "Proposed tokens verified."),
                          ("num_accepted_tokens", "Proposed tokens accepted.")):
            yield self._family(c, "vllm:spec_decode_" + name, doc, spec[name])
        per_pos = c("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted proposals "
                    "by their position in the proposal.", labels=["model_name", "position"])
        for pos, n in enumerate(spec["accepted_per_pos"]):
            per_pos.add_metric([self.name, str(pos)], n)
        yield per_pos

    def _host_tier(self, s: dict[str, Any]):
        """The prefix cache's host tier (`--kv-offloading-size`), when it is on."""
        if "host_used_blocks" not in s:
            return
        g, c = GaugeMetricFamily, CounterMetricFamily
        for kind, name, doc in (
                (g, "host_used_blocks", "Host-tier KV blocks holding a cached prefix."),
                (g, "host_free_blocks", "Host-tier KV blocks free."),
                (c, "num_host_hit_tokens", "Prefix cache hits served from the host tier, "
                                           "in tokens."),
                (c, "host_bytes_to_host", "Bytes copied from device to the host tier."),
                (c, "host_bytes_to_device", "Bytes copied from the host tier to device."),
                (c, "host_copy_s", "Host seconds spent copying to and from the host tier.")):
            yield self._family(kind, "jprefix:kv_offload_" + name, doc, s[name])


def metrics_registry(llm: LLM, model_name: str) -> CollectorRegistry:
    """A registry of its own per app (several servers in one process don't collide)."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm, model_name))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
