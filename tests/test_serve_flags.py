"""`jprefix serve`: one flag per EngineArgs field under vLLM's name, parsed into the LLM's
engine arguments, and the server's own flags handed to the app."""

import dataclasses

import pytest

import jprefix
from jprefix.engine.args import EngineArgs
from jprefix.entrypoints import cli
from jprefix.entrypoints.cli_args import engine_kwargs


def test_every_engine_arg_is_a_serve_flag_with_its_default():
    args = cli._build_parser().parse_args(["serve"])
    assert engine_kwargs(args) == dataclasses.asdict(EngineArgs())
    help_text = cli._build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in help_text, f.name


def test_serve_passes_the_flags_to_the_llm_and_the_app(monkeypatch):
    seen = {}

    class FakeLLM:
        def __init__(self, model, **kwargs):
            seen["model"], seen["engine"] = model, kwargs

    def fake_serve(llm, host, port, **app_kwargs):
        seen["serve"] = (host, port, app_kwargs)

    monkeypatch.setattr(jprefix, "LLM", FakeLLM)
    monkeypatch.setattr("jprefix.entrypoints.openai_server.serve", fake_serve)
    argv = ["serve", "--model", "tiny-llama", "--served-model-name", "tiny", "--host",
            "0.0.0.0", "--port", "9001", "--api-key", "k", "--max-model-len", "512",
            "--num-kv-blocks", "100", "--gpu-memory-utilization", "0.5", "--max-num-seqs",
            "8", "--no-enable-prefix-caching", "--tensor-parallel-size", "2",
            "--max-num-batched-tokens", "1024", "--no-async-scheduling", "--dtype", "float32"]
    assert cli.main(argv) == 0
    engine = seen["engine"]
    assert seen["model"] == "tiny-llama"
    assert (engine["max_model_len"], engine["num_kv_blocks"], engine["max_num_seqs"]) == \
        (512, 100, 8)
    assert engine["gpu_memory_utilization"] == 0.5 and engine["tensor_parallel_size"] == 2
    assert engine["enable_prefix_caching"] is False and engine["async_scheduling"] is False
    assert engine["max_num_batched_tokens"] == 1024 and engine["dtype"] == "float32"
    assert EngineArgs(**engine).max_model_len == 512  # (what LLM builds from them)
    host, port, app = seen["serve"]
    assert (host, port) == ("0.0.0.0", 9001)
    assert {k: app[k] for k in ("model_name", "api_key", "max_request_bytes")} == {
        "model_name": "tiny", "api_key": "k", "max_request_bytes": 4 * 1024 * 1024}


def test_a_bad_flag_value_is_refused():
    with pytest.raises(SystemExit):
        cli._build_parser().parse_args(["serve", "--max-num-seqs", "many"])
