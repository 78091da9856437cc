"""`jprefix bench serve` against a real server (the tiny random model under uvicorn on a
free port): the requests, prompt, generated and cached tokens it reports equal what the
server's /metrics counted over the run, at once and at a bursty rate under a concurrency
cap; a rejected request is counted as failed, not raised. And, on fixed seeds, the arrival
process (gamma gaps of mean 1 / rate, spread 1 / sqrt(burstiness)) and the latency
statistics."""

import json
import math

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
import httpx  # noqa: E402
from server_harness import Server  # noqa: E402

import jprefix  # noqa: E402
from jprefix import LLM  # noqa: E402
from jprefix.benchmarks import arrivals, metrics, serve_client  # noqa: E402
from jprefix.entrypoints import cli  # noqa: E402

COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total")
NUM_PROMPTS, OUTPUT_LEN = 12, 5
WORKLOAD = ["--model", "tiny-llama", "--dataset-name", "shared-prefix", "--num-prompts",
            str(NUM_PROMPTS), "--input-len", "40", "--prefix-len", "24", "--num-prefixes", "2",
            "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--disable-tqdm",
            "--logprobs", "0"]  # (the model has no tokenizer: no text, a logprob per token)


@pytest.fixture(scope="module")
def server():
    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    s = Server(LLM(tiny, block_size=8, num_kv_blocks=128))
    yield s
    s.stop()


def scrape(url: str) -> dict[str, float]:
    """The counters above from /metrics, each summed over its labels."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def bench(server, tmp_path, *flags: str) -> tuple[dict, dict]:
    """Runs `jprefix bench serve` through the CLI; (its saved result, the server's
    counters over the run)."""
    before = scrape(server.url)
    rc = cli.main(["bench", "serve", "--port", str(server.port), *WORKLOAD, *flags,
                   "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                   "r.json"])
    server.wait_idle()
    after = scrape(server.url)
    result = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0
    return result, {k: after[k] - before[k] for k in COUNTERS}


def assert_counts_match(result: dict, delta: dict) -> None:
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert delta["vllm:request_success_total"] == NUM_PROMPTS
    assert result["total_input_tokens"] == delta["vllm:prompt_tokens_total"] == NUM_PROMPTS * 40
    assert (result["total_output_tokens"] == delta["vllm:generation_tokens_total"]
            == NUM_PROMPTS * OUTPUT_LEN)
    assert result["total_cached_tokens"] == delta["vllm:prefix_cache_hits_total"] > 0
    assert result["cached_token_share"] == pytest.approx(
        result["total_cached_tokens"] / result["total_input_tokens"])


def test_all_at_once_under_a_concurrency_cap_counts_what_the_server_counted(server, tmp_path):
    result, delta = bench(server, tmp_path, "--max-concurrency", "4")
    assert_counts_match(result, delta)
    for name in ("ttft", "tpot", "itl", "e2el"):  # (defaults: mean, median, std, p50/90/99)
        stats = result[f"{name}_ms"]
        assert set(stats) == {"mean", "median", "std", "p50", "p90", "p99"}
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert result["ttft_ms"]["p99"] <= result["e2el_ms"]["p99"]
    assert result["request_throughput"] == pytest.approx(NUM_PROMPTS / result["duration"])
    assert result["max_concurrency"] == 4 and math.isinf(result["request_rate"])


def test_a_bursty_rate_counts_what_the_server_counted(server, tmp_path):
    result, delta = bench(server, tmp_path, "--request-rate", "200", "--burstiness", "0.5",
                          "--seed", "3", "--percentile-metrics", "ttft,itl",
                          "--metric-percentiles", "25,75")
    assert_counts_match(result, delta)
    assert set(result) >= {"ttft_ms", "itl_ms"} and "tpot_ms" not in result
    assert set(result["itl_ms"]) == {"mean", "median", "std", "p25", "p75"}


def test_rejected_requests_are_counted_as_failed(server, tmp_path):
    result, delta = bench(server, tmp_path, "--served-model-name", "no-such-model",
                          "--max-concurrency", "2")
    assert result["completed"] == 0 and result["failed"] == NUM_PROMPTS
    assert "HTTP 4" in result["errors"][0] and "no-such-model" in result["errors"][0]
    assert delta["vllm:request_success_total"] == 0


def test_arrivals_have_the_rate_and_spread_asked_for_on_a_fixed_seed():
    a = arrivals.arrival_intervals(40_000, rate=8.0, burstiness=1.0, seed=1)
    assert np.array_equal(a, arrivals.arrival_intervals(40_000, 8.0, 1.0, seed=1))
    assert not np.array_equal(a, arrivals.arrival_intervals(40_000, 8.0, 1.0, seed=2))
    for burstiness in (0.25, 1.0, 4.0):
        gaps = arrivals.arrival_intervals(40_000, 8.0, burstiness, seed=1)
        assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)  # the rate at any burstiness
        cv = gaps.std() / gaps.mean()  # a gamma's: 1 / sqrt(shape); Poisson's is 1
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    times = arrivals.arrival_times(5, 2.0, seed=0)
    assert times == pytest.approx(np.cumsum(arrivals.arrival_intervals(5, 2.0, seed=0)))
    assert arrivals.arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    for bad, match in (((3, 0.0), "request rate 0.0"), ((3, 1.0, -1.0), "burstiness -1.0"),
                       ((-1, 1.0), "got -1")):
        with pytest.raises(ValueError, match=match):
            arrivals.arrival_intervals(*bad)


def test_latency_stats_are_numpys_percentiles_in_ms():
    seconds = [0.004, 0.001, 0.003, 0.002, 0.010]
    stats = metrics.latency_stats(seconds, [50, 90, 99.9])
    ms = np.array(seconds) * 1e3
    # sorted 1, 2, 3, 4, 10 ms; p90 at rank 0.9 * 4 = 3.6: 4 + 0.6 * 6
    assert stats == pytest.approx({"mean": 4.0, "median": 3.0, "std": ms.std(), "p50": 3.0,
                                   "p90": 7.6, "p99.9": 9.976})
    assert metrics.latency_stats([], [50]) == {"mean": None, "median": None, "std": None,
                                               "p50": None}
    assert metrics.tpot(1.0, 0.2, 5) == pytest.approx(0.2) and metrics.tpot(1.0, 0.2, 1) is None
    assert metrics.parse_percentiles("50, 90,99") == [50.0, 90.0, 99.0]
    assert metrics.parse_percentile_metrics("ttft,e2el") == ["ttft", "e2el"]
    for text in ("0", "101", "p99"):
        with pytest.raises(ValueError, match=f"--metric-percentiles '{text}'"):
            metrics.parse_percentiles(text)
    with pytest.raises(ValueError, match="'ttft,goodput'"):
        metrics.parse_percentile_metrics("ttft,goodput")


def test_chunks_of_both_backends_are_read():
    chat = serve_client.request_body("openai-chat", "m", "hi", 4, ignore_eos=False)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat
    plain = serve_client.request_body("openai", "m", [5, 6], 4, ignore_eos=True)
    assert plain["prompt"] == [5, 6] and plain["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="backend 'vllm'"):
        serve_client.request_body("vllm", "m", [5], 4, ignore_eos=False)
    assert chat["stream"] and "logprobs" not in plain
    assert serve_client.request_body("openai-chat", "m", "hi", 4, False, logprobs=2)[
        "top_logprobs"] == 2
    chunk = serve_client.token_chunk
    assert chunk({"choices": [{"text": "ab"}]}) == "ab"
    assert chunk({"choices": [{"text": "", "logprobs": {"tokens": ["x"]}}]}) == ""
    assert chunk({"choices": [{"text": "", "finish_reason": "length"}]}) == ""
    assert chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) is None
    assert chunk({"choices": [{"text": ""}]}) is None  # (an empty first chunk)
    assert chunk({"choices": [{"delta": {"content": "c"}}]}) == "c"
    assert chunk({"choices": [], "usage": {"prompt_tokens": 3}}) is None
