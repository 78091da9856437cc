"""The server's sampling fields through the official `openai` client against a real uvicorn
server (127.0.0.1, a free port): logprobs (completions and chat, streamed and not) equal
log_softmax of the dense model's logits, echo returns the prompt's logprobs, n > 1
choices are seeded and indexed, penalties / min_p / logit_bias reach SamplingParams,
and bad values are 400s naming the field."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import server_harness  # noqa: E402

import jprefix  # noqa: E402
from jprefix import LLM, SamplingParams  # noqa: E402
from jprefix.engine.input_processor import render_chat  # noqa: E402
from models.reference import dense_forward  # noqa: E402

pytestmark = pytest.mark.usefixtures("full_opt_steps")  # (real-model steps: conftest)

PROMPT = np.random.default_rng(0).integers(3, 200, 21).tolist()


class Server(server_harness.Server):
    """The shared test server; `client` is an openai.OpenAI for it."""

    def __init__(self, llm):
        super().__init__(llm)
        self.client = openai.OpenAI(api_key="unused", base_url=f"{self.url}/v1",
                                    max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tiny(sharp_tiny):
    server = Server(LLM(sharp_tiny, block_size=8, num_kv_blocks=96))
    yield server
    server.stop()


def _ref(model, tokens):
    logits = dense_forward(model.params, model.config, jnp.asarray([tokens], jnp.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def _complete(server, **kwargs):
    body = dict(model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0)
    return server.client.completions.create(**(body | kwargs), extra_body={
        "ignore_eos": True, "return_token_ids": True})


def test_completion_logprobs_equal_the_dense_log_softmax(tiny, sharp_tiny):
    out = _complete(tiny, logprobs=3, temperature=1.0, seed=2)
    choice = out.choices[0]
    ids = choice.model_dump()["token_ids"]
    ref = _ref(sharp_tiny, PROMPT + ids)
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]  # (a model without a tokenizer)
    for i, t in enumerate(ids):
        row = ref[len(PROMPT) - 1 + i]
        np.testing.assert_allclose(lp.token_logprobs[i], row[t], atol=2e-4)
        top = {int(k.removeprefix("token_id:")) for k in lp.top_logprobs[i]}
        assert set(np.argsort(-row)[:3].tolist()) <= top <= set(np.argsort(-row)[:3]) | {t}
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(ids))]


def test_echo_returns_the_prompt_with_its_logprobs(tiny, sharp_tiny):
    out = _complete(tiny, echo=True, logprobs=2, max_tokens=2)
    lp = out.choices[0].logprobs
    ids = out.choices[0].model_dump()["token_ids"]
    assert len(lp.tokens) == len(PROMPT) + 2 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    ref = _ref(sharp_tiny, PROMPT + ids)
    want = [ref[p - 1][t] for p, t in enumerate(PROMPT + ids) if p > 0]
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=2e-4)
    assert out.choices[0].text.startswith("".join(f"token_id:{t}" for t in PROMPT))


def test_n_choices_are_seeded_indexed_and_equal_the_engine(tiny):
    kwargs = dict(n=3, seed=4, temperature=1.0, max_tokens=4)
    first = _complete(tiny, **kwargs)
    second = _complete(tiny, **kwargs)
    ids = [c.model_dump()["token_ids"] for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert ids == [c.model_dump()["token_ids"] for c in second.choices]
    assert len({tuple(x) for x in ids}) == 3
    assert first.usage.completion_tokens == 12 and first.usage.prompt_tokens == len(PROMPT)
    engine = tiny.llm.generate([PROMPT], SamplingParams(n=3, seed=4, temperature=1.0,
                                                        max_tokens=4, ignore_eos=True),
                               use_tqdm=False)[0]
    assert ids == [o.token_ids for o in engine.outputs]


def test_penalties_min_p_and_logit_bias_reach_the_sampler(tiny):
    fields = dict(presence_penalty=0.5, frequency_penalty=0.8)
    extra = {"repetition_penalty": 1.4, "min_p": 0.05, "ignore_eos": True}
    out = tiny.client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={"9": 2.5},
        extra_body=extra | {"return_token_ids": True}, **fields)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={9: 2.5},
                        repetition_penalty=1.4, min_p=0.05, **fields)
    want = tiny.llm.generate([PROMPT], sp, use_tqdm=False)[0].token_ids
    plain = tiny.llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert out.choices[0].model_dump()["token_ids"] == want != plain.token_ids


def test_streamed_logprobs_and_choices_equal_the_plain_response(tiny):
    kwargs = dict(n=2, seed=9, temperature=1.0, max_tokens=5, logprobs=2)
    plain = _complete(tiny, **kwargs)
    stream = _complete(tiny, stream=True, **kwargs)
    tokens: dict[int, list] = {0: [], 1: []}
    lps: dict[int, list] = {0: [], 1: []}
    finish = {}
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens[c.index] += c.logprobs.tokens
                lps[c.index] += c.logprobs.token_logprobs
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for c in plain.choices:
        assert tokens[c.index] == c.logprobs.tokens
        np.testing.assert_allclose(lps[c.index], c.logprobs.token_logprobs, atol=1e-6)
    assert finish == {0: "length", 1: "length"}


@pytest.mark.parametrize("kwargs, param", [
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logprobs": 30}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": -1}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
])
def test_bad_sampling_values_are_400_naming_the_field(tiny, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        tiny.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2,
                                       **kwargs)
    assert info.value.response.json()["error"]["param"] == param
    assert param in info.value.response.json()["error"]["message"]


def test_chat_logprobs_on_the_real_model(smollm2_gguf):
    model = jprefix.load(smollm2_gguf, dtype="float32")
    server = Server(LLM(model, num_kv_blocks=64))
    try:
        messages = [{"role": "user", "content": "Name a colour."}]
        kwargs = dict(model=model.name, messages=messages, max_tokens=6, temperature=0,
                      logprobs=True, top_logprobs=2)
        out = server.client.chat.completions.create(**kwargs)
        content = out.choices[0].logprobs.content
        assert "".join(e.token for e in content) == out.choices[0].message.content
        ids = render_chat(model.tokenizer, messages)
        gen = server.llm.chat(messages, SamplingParams(temperature=0, max_tokens=6),
                              use_tqdm=False)[0].token_ids
        ref = _ref(model, ids + gen)
        for i, e in enumerate(content):
            assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2
            assert e.top_logprobs[0].token == e.token  # greedy: the top token
            np.testing.assert_allclose(e.logprob, ref[len(ids) - 1 + i].max(), atol=1e-3)
        streamed = []
        for chunk in server.client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed += [e.token for e in chunk.choices[0].logprobs.content]
        assert streamed == [e.token for e in content]
        with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
            server.client.chat.completions.create(model=model.name, messages=messages,
                                                  top_logprobs=2)
    finally:
        server.stop()


def test_leaving_an_n_stream_aborts_every_sample(tiny, monkeypatch):
    llm = tiny.llm
    aborted, steps, gate = [], [], threading.Event()
    original_abort, original_step = llm.engine.abort_request, llm.engine.step

    def step():  # after 4 steps the engine waits (at most 60 s) until the test opens the gate
        steps.append(1)
        if len(steps) > 4:
            gate.wait(60)
        return original_step()

    monkeypatch.setattr(llm.engine, "abort_request",
                        lambda rid: (aborted.append(rid), original_abort(rid)))
    monkeypatch.setattr(llm.engine, "step", step)
    stream = tiny.client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=200,
                                            n=3, temperature=1.0, stream=True, logprobs=0,
                                            extra_body={"ignore_eos": True})
    for chunk in stream:  # (the tiny model has no tokenizer: its tokens show as logprobs)
        if chunk.choices[0].logprobs is not None:
            break
    stream.close()  # the client goes away mid-stream, while the engine is held
    deadline = time.monotonic() + 60
    while len(aborted) < 3:
        assert time.monotonic() < deadline, f"aborted only {aborted}"
        time.sleep(0.05)
    gate.set()
    while llm.engine.has_unfinished_requests() or llm._driver.thread is not None:
        assert time.monotonic() < deadline, "the samples kept running"
        time.sleep(0.05)
    assert sorted(rid.rsplit("-", 1)[1] for rid in aborted) == ["0", "1", "2"]
    assert len({rid.rsplit("-", 1)[0] for rid in aborted}) == 1
    bm = llm.engine.scheduler.block_manager
    assert all(bm.ref_count(b) == 0 for b in range(1, bm.num_blocks))
