"""Speculative decoding on the real SmolLM2-135M: a request that quotes its prompt is
accepted often, and batched with a structured-output request (which runs
non-speculatively) every output equals speculation off; scripts/bench_spec.py's smoke
runs."""

import pytest

import jprefix
from jprefix import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("full_opt_steps")  # (real-model steps: conftest)

TEXT = ("The lighthouse at Carrow Point was built in 1871 from granite quarried on the "
        "island itself. Its lamp burned colza oil until 1904.")


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return jprefix.load(smollm2_gguf, dtype="float32")


def test_quoting_request_speculates_and_structured_one_does_not(smol):
    convs = [[{"role": "user", "content": f"Repeat this text exactly: {TEXT}"}],
             [{"role": "user", "content": "Give a JSON object with a key name."}]]
    params = [SamplingParams(temperature=0, max_tokens=32),
              SamplingParams(temperature=0, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(json_object=True))]
    base = LLM(smol, block_size=16, num_kv_blocks=64)
    spec = LLM(smol, block_size=16, num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    want = [base.chat(c, p, use_tqdm=False)[0] for c, p in zip(convs, params, strict=True)]
    got = [o for o in spec.chat(convs, params, use_tqdm=False)]  # one batch: mixed rows
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = spec.engine.stats.spec
    assert stats.num_accepted_tokens > 10  # the quote is proposed and accepted
    assert stats.num_drafts < 32  # the structured row never speculated


def test_bench_spec_smoke(tmp_path, smollm2_gguf):
    """Both modes of scripts/bench_spec.py on tiny settings: the workload mode on the real
    model (its ShareGPT half synthetic when the dataset is not installed), the verify
    mode on tiny-llama."""
    from scripts.bench_spec import main

    out = main(["--verify", "--model", "tiny-llama", "--dtype", "float32", "--batch", "1",
                "--k", "2", "--context", "16", "--reps", "1", "--num-kv-blocks", "32",
                "--accepted-length", "2:2.5", "--output-json", str(tmp_path / "v.json")])
    (row,) = out["rows"]
    assert row["k"] == 2 and row["verify_ms"] > 0 and row["decode_ms"] > 0
    assert row["implied_speedup"] == 2.5 / row["verify_over_decode"]
    assert (tmp_path / "v.json").exists()
    out = main(["--model", str(smollm2_gguf), "--k", "2", "--num-prompts", "1",
                "--max-tokens", "8", "--num-kv-blocks", "64"])
    assert {r["workload"] for r in out["rows"]} == {"lookup", out["sharegpt_source"]}
    assert all(r["same_as_off"] and r["output_tokens"] > 0 for r in out["rows"])
    assert sum(r["num_drafts"] for r in out["rows"] if r["k"] == 2) > 0
