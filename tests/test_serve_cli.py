"""`jprefix serve` and `jprefix generate` as a user runs them: vLLM's serve flags reaching
the server (refused ones saying why), the app options they set (TestClient on a tiny
dummy model), a real `jprefix serve` process stopped by SIGTERM (bounded drain, clean
final chunk) and by two SIGINTs (at once, quietly), and generate's one-line errors and
sampling flags."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

import jprefix
from jprefix.entrypoints import cli, cli_serve
from jprefix.entrypoints.cli_generate import sampling_params

ROOT = Path(__file__).resolve().parent.parent


def test_help_describes_the_program_and_the_default_model():
    text = cli._build_parser().format_help()
    assert "prefix" in text and "generate" in text and "serve" in text
    assert "Q4_1 GGUF" in text
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"  # (set by importing cli)


def test_refused_and_conflicting_flags_say_why(capsys):
    for argv, words in ((["serve", "--swap-space", "4"], "swapped"),
                        (["serve", "--enable-lora"], "LoRA"),
                        (["serve", "a", "--model", "b"], "given twice")):
        with pytest.raises(SystemExit) as exc:
            cli_serve.model_of(cli._build_parser().parse_args(argv))
        assert words in capsys.readouterr().err + str(exc.value.code), argv


def test_serve_flags_reach_the_llm_and_the_server(monkeypatch, tmp_path):
    seen = {}

    class Tok:
        chat_template = None

    class FakeLLM:
        tokenizer = Tok()

        def __init__(self, model, **kwargs):
            seen["model"] = model

    monkeypatch.setattr(jprefix, "LLM", FakeLLM)
    monkeypatch.setattr("jprefix.entrypoints.openai_server.serve",
                        lambda llm, host, port, **kw: seen.update(kw))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7, "do_sample": True}))
    argv = ["serve", "tiny-llama", "--chat-template", "{{ messages[0]['content'] }}",
            "--generation-config", str(tmp_path), "--max-logprobs", "5",
            "--allowed-origins", '["https://a.example"]', "--response-role", "bot",
            "--return-tokens-as-token-ids", "--enable-log-requests", "--disable-log-stats",
            "--disable-fastapi-docs", "--root-path", "/api", "--uds", "/tmp/x.sock",
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
            "--shutdown-timeout", "2.5", "--enforce-eager"]
    monkeypatch.setenv("XLA_FLAGS", "")
    assert cli.main(argv) == 0
    assert seen["model"] == "tiny-llama" and FakeLLM.tokenizer.chat_template.startswith("{{")
    assert seen["defaults"] == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert (seen["max_logprobs"], seen["allowed_origins"], seen["response_role"]) == \
        (5, ["https://a.example"], "bot")
    assert seen["tokens_as_ids"] and seen["log_requests"] and not seen["log_stats"]
    assert (seen["docs"], seen["root_path"], seen["uds"], seen["log_level"]) == \
        (False, "/api", "/tmp/x.sock", "warning")
    assert seen["access_log"] is False and seen["shutdown_timeout"] == 2.5
    assert os.environ["XLA_FLAGS"].split()[-1] == "--xla_gpu_enable_command_buffer="
    with pytest.raises(SystemExit, match="--max-logprobs"):
        cli.main(["serve", "--max-logprobs", "50"])
    with pytest.raises(SystemExit, match="--chat-template"):
        cli.main(["serve", "--chat-template", "no-such-file.jinja"])


@pytest.fixture(scope="module")
def tiny_llm():
    from jprefix import LLM

    return LLM(jprefix.load("tiny-llama", dtype="float32", load_format="dummy"),
               block_size=8, num_kv_blocks=32)


def test_app_options_role_logprobs_defaults_token_ids_cors_docs(tiny_llm):
    from fastapi.testclient import TestClient

    from jprefix.entrypoints.openai_server import build_app

    app = build_app(tiny_llm, max_logprobs=2, defaults={"max_tokens": 3},
                    tokens_as_ids=True, allowed_origins=["https://a.example"], docs=False)
    body = {"prompt": [5, 6, 7], "ignore_eos": True}
    with TestClient(app) as c:
        out = c.post("/v1/completions", json=body | {"logprobs": 2}).json()
        assert out["usage"]["completion_tokens"] == 3  # (the generation config's default)
        assert all(t.startswith("token_id:") for t in out["choices"][0]["logprobs"]["tokens"])
        err = c.post("/v1/completions", json=body | {"logprobs": 3}).json()["error"]
        assert err["param"] == "logprobs" and "--max-logprobs" in err["message"]
        cors = c.get("/health", headers={"Origin": "https://a.example"})
        assert cors.headers["access-control-allow-origin"] == "https://a.example"
        assert c.get("/docs").status_code == 404
    with TestClient(build_app(tiny_llm)) as c:  # (defaults: no CORS, the docs page)
        assert "access-control-allow-origin" not in c.get(
            "/health", headers={"Origin": "https://a.example"}).headers
        assert c.get("/docs").status_code == 200


def test_generate_errors_are_one_line_naming_the_flag(monkeypatch):
    for model, fmt, words in (("no-such-model-xyz", "auto", "--model 'no-such-model-xyz'"),
                              ("tiny-llama", "auto", "--load-format dummy")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--model", model, "--load-format", fmt])
        message = str(exc.value)
        assert words in message and "\n" not in message, message
        # the compile watch (a process-wide jax listener) is gone with the failed run
        from jprefix.entrypoints.cli_progress import CompileWatch
        assert CompileWatch._instances == []
    args = cli._build_parser().parse_args([
        "generate", "--seed", "3", "--top-p", "0.5", "--top-k", "4", "--min-p", "0.1",
        "--repetition-penalty", "1.2", "--presence-penalty", "0.3", "--frequency-penalty",
        "0.4", "--stop", "\n", "--stop", "END"])
    sp = sampling_params(args)
    assert (sp.seed, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == \
        (3, 0.5, 4, 0.1, 1.2)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.stop) == (0.3, 0.4, ["\n", "END"])
    with pytest.raises(SystemExit, match="--top-p"):
        sampling_params(cli._build_parser().parse_args(["generate", "--top-p", "2"]))


# ---- a real `jprefix serve` process and signals ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(timeout_s: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "jprefix.entrypoints.cli", "serve", "tiny-llama-4k",
           "--load-format", "dummy", "--dtype", "float32", "--block-size", "8",
           "--num-kv-blocks", "256", "--port", str(port), "--shutdown-timeout", str(timeout_s)]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}"


def _wait_up(proc: subprocess.Popen, url: str) -> None:
    for _ in range(600):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        threading.Event().wait(0.2)
    raise AssertionError("the server did not start")


LONG = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}


def _running(url: str, results: dict) -> list[threading.Thread]:
    """A streamed and a plain long request, answers into `results`."""
    def stream():
        lines = []
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=LONG | {"stream": True},
                              timeout=120) as r:
                lines += [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        except httpx.HTTPError:  # (the server exited at once)
            pass
        results["stream"] = lines

    def plain():
        try:
            r = httpx.post(f"{url}/v1/completions", json=LONG | {"prompt": [5, 6, 8]},
                           timeout=120)
            results["plain"] = (r.status_code, r.json())
        except httpx.HTTPError as exc:
            results["plain"] = (None, str(exc))

    threads = [threading.Thread(target=f) for f in (stream, plain)]
    for t in threads:
        t.start()
    return threads


def _wait_first_tokens(url: str) -> None:
    for _ in range(600):
        if httpx.get(f"{url}/stats").json()["replicas"][0]["running"] == 2:
            return
        threading.Event().wait(0.1)
    raise AssertionError("the requests did not start")


def test_sigterm_drains_then_aborts_and_two_sigints_exit_at_once():
    (term, term_url), (twice, twice_url) = _start(1), _start(600)
    try:
        for proc, url in ((term, term_url), (twice, twice_url)):
            _wait_up(proc, url)
            httpx.post(f"{url}/v1/completions", json=LONG | {"max_tokens": 40}, timeout=120)
        results: dict = {}
        threads = _running(term_url, results)
        _wait_first_tokens(term_url)
        term.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        out, err = term.communicate(timeout=120)
        assert term.returncode == 0, err[-3000:]
        last = json.loads(results["stream"][-2][6:])
        assert results["stream"][-1] == "data: [DONE]"
        assert last["choices"][0]["finish_reason"] == "abort"
        status, body = results["plain"]
        assert status == 503 and body["error"]["code"] == "server_shutting_down"
        assert "Traceback" not in err and "CancelledError" not in err
        assert "loaded in" in err and "KV cache 256 blocks" in err and "max model len" in err
        assert "POST /v1/completions" in out and "/health" not in out + err  # (access log)

        threads = _running(twice_url, {})
        _wait_first_tokens(twice_url)
        twice.send_signal(signal.SIGINT)
        threading.Event().wait(0.5)
        twice.send_signal(signal.SIGINT)
        _, err = twice.communicate(timeout=60)  # (a 600 s drain, cut short)
        assert twice.returncode == 128 + signal.SIGINT
        assert "Traceback" not in err and "CancelledError" not in err
        assert "exiting now" in err
        for t in threads:
            t.join(30)
    finally:
        for proc in (term, twice):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
