"""The OpenAI-compatible server: completions (plain and streamed) equal the engine's greedy
output, bad requests get HTTP 400 naming the value while others are served, a client that
leaves a stream aborts its request, and chat completions use the chat template."""

import json

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import jprefix  # noqa: E402
from jprefix import LLM, SamplingParams  # noqa: E402
from jprefix.entrypoints.openai_server import build_app  # noqa: E402
from models.reference import dense_generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("full_opt_steps")  # (real-model steps: conftest)

PROMPT = np.random.default_rng(0).integers(3, 200, 21).tolist()


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama", dtype="float32", load_format="dummy")


@pytest.fixture(scope="module")
def client(tiny):
    llm = LLM(tiny, block_size=8, num_kv_blocks=64)
    with TestClient(build_app(llm)) as c:
        c.llm = llm
        yield c


def _events(response):
    lines = [ln for ln in response.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_completion_matches_dense_greedy_and_reports_usage(client, tiny):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "prefix_pos": 16}
    first = client.post("/v1/completions", json=body).json()
    second = client.post("/v1/completions", json=body).json()
    assert first["object"] == "text_completion"
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["prompt_tokens"] == 21 and first["usage"]["completion_tokens"] == 6
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    out = client.llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == dense_generate(tiny.params, tiny.config, PROMPT, 6,
                                           eos_token_ids=())


@pytest.mark.parametrize("include_usage", [True, False, None])
def test_streamed_completion_sends_chunks_then_usage_if_asked_and_done(client, include_usage):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True}
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = _events(r)
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    if include_usage:  # OpenAI's contract: one last chunk with usage and no choices
        assert events[-1]["usage"]["completion_tokens"] == 5 and events[-1]["choices"] == []
        assert all(e["usage"] is None for e in events[:-1])
    else:
        assert all("usage" not in e for e in events)


@pytest.mark.parametrize(
    "body, match",
    [
        ({"prompt": [], "max_tokens": 2}, "empty"),
        ({"prompt": [1, 2, 10**7], "max_tokens": 2}, "10000000"),
        ({"prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 10**6}, "exceeds the model context"),
        ({"prompt": PROMPT, "prefix_pos": 99}, "prefix_pos 99"),
        ({"prompt": PROMPT, "n": 0}, "n must be in [1, 128]"),
        ({"prompt": PROMPT, "n": 2, "best_of": 1}, "best_of must be None or an int in [n=2"),
        ({"prompt": PROMPT, "logprobs": 21}, "logprobs must be None or an int in [0, 20]"),
        ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"prompt": PROMPT, "min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"prompt": PROMPT, "frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"prompt": PROMPT, "logit_bias": {"7": 101}}, "logit_bias[7] must be a number"),
        ({"prompt": PROMPT, "logit_bias": {"tok": 1}}, "logit_bias key 'tok'"),
        ({"prompt": PROMPT, "logit_bias": {"256": 1}}, "logit_bias token id 256 is outside"),
        ({"prompt": PROMPT, "top_logprobs": 2}, "top_logprobs 2 is not supported"),
        ({"prompt": PROMPT, "stream": True, "n": 2, "best_of": 3}, "best_of 3 must equal n"),
        ({"prompt": PROMPT, "stop": [""]}, "stop"),
        ({"prompt": PROMPT, "stop_options": {}}, "stop_options is not a field"),
        ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream: true"),
        ({"prompt": {"a": 1}}, "prompt: must be a string, a list of token ids"),
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens: input should be"),
        ({"prompt": "text", "max_tokens": 2}, "tokenizer"),
        ({"max_tokens": 2}, "prompt"),
        ({"prompt": PROMPT, "stream": True, "top_k": 0}, "top_k"),
    ],
)
def test_bad_requests_get_400_naming_the_value(client, body, match):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    ok = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200  # the engine carries on


def test_leaving_a_stream_aborts_the_request_and_frees_its_blocks(client):
    body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if '"text"' in line:
                break  # the client goes away mid-stream
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code \
        == 200
    driver = client.llm._driver
    if driver.thread is not None:
        driver.thread.join(10)
    bm = client.llm.engine.scheduler.block_manager
    assert not client.llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks - 1


def test_models_health_and_stats(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"
    assert "num_hit_tokens" in client.get("/stats").json()


def test_chat_completion_with_the_real_chat_template(smollm2_gguf):
    llm = LLM(jprefix.load(smollm2_gguf, dtype="float32"), num_kv_blocks=64)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hello."}]
    with TestClient(build_app(llm)) as c:
        body = {"messages": messages, "max_tokens": 8, "temperature": 0}
        reply = c.post("/v1/chat/completions", json=body).json()
        with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            events = _events(r)
    text = reply["choices"][0]["message"]["content"]
    assert reply["object"] == "chat.completion" and text
    streamed = "".join(e["choices"][0]["delta"].get("content", "")
                       for e in events if e["choices"])
    assert streamed == text
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize("field, value", [
    ("top_logprobs", 3), ("suffix", "x"), ("tools", [{"type": "function"}]),
])
def test_unsupported_fields_get_400_naming_them_and_neutral_values_pass(client, field, value):
    body = {"prompt": PROMPT, "max_tokens": 2}
    r = client.post("/v1/completions", json=body | {field: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and f"{field} " in error["message"]
    assert "not supported" in error["message"]
    neutral = {"logprobs": None, "echo": False, "n": 1, "presence_penalty": 0, "best_of": 1,
               "top_logprobs": 0, "suffix": "", "tools": []}
    assert client.post("/v1/completions", json=body | neutral).status_code == 200


@pytest.mark.parametrize("method, path, body, status, match", [
    ("POST", "/v1/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("GET", "/v1/completions", None, 405, "method GET is not allowed"),
    ("GET", "/v2/nothing", None, 404, "no route /v2/nothing"),
])
def test_every_error_is_openai_error_json(client, method, path, body, status, match):
    r = client.request(method, path, content=body,
                       headers={"Content-Type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and match in error["message"]
    assert "detail" not in r.json()


def test_api_key_guards_every_route_but_health(tiny, monkeypatch):
    llm = LLM(tiny, block_size=8, num_kv_blocks=64)
    body = {"prompt": PROMPT, "max_tokens": 2}
    with TestClient(build_app(llm, api_key="sekrit")) as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        ok = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
    monkeypatch.setenv("JPREFIX_API_KEY", "from-env")
    with TestClient(build_app(llm)) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code \
            == 200
