"""Structured output: the device bitmask stage against a numpy reference, the request
fields' mapping, and on the real SmolLM2-135M ten JSON schemas (greedy and sampled), a
regex and a choice list whose outputs parse and validate; a grammar that completes
finishes its request; plain rows in the same batch are unchanged."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

import jprefix
from jprefix import LLM, SamplingParams, StructuredOutputsParams
from jprefix.core.scheduler import ScheduledSeq
from jprefix.entrypoints.guided import structured_params
from jprefix.entrypoints.protocol import RequestError
from jprefix.worker.structured import apply_token_bitmask, place_bitmask

pytestmark = pytest.mark.usefixtures("full_opt_steps")  # (real-model steps: conftest)

jsonschema = pytest.importorskip("jsonschema")

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
        "additionalProperties": False}),
    ("three to five small numbers", {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 99}, "minItems": 3, "maxItems": 5}),
    ("a colour", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("a user with an address", {"type": "object", "properties": {
        "user": NAME, "address": {"type": "object", "properties": {
            "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["user", "address"], "additionalProperties": False}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60},
        "ok": {"type": "boolean"}}, "required": ["celsius", "ok"],
        "additionalProperties": False}),
    ("a product code", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}),
    ("a shopping list", {"type": "array", "maxItems": 3, "minItems": 1, "items": {
        "type": "object", "properties": {"item": NAME, "qty": {
            "type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["item", "qty"], "additionalProperties": False}}),
    ("an order status", {"type": "object", "properties": {
        "status": {"enum": ["open", "shipped", "closed"]}, "version": {"const": 2},
        "note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["status", "version", "note"], "additionalProperties": False}),
    ("a yes or no answer", {"type": "boolean"}),
    ("a point", {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9},
        "label": {"anyOf": [NAME, {"type": "null"}]}},
        "required": ["x", "y", "label"], "additionalProperties": False}),
]


def test_bitmask_stage_equals_a_numpy_reference():
    rng = np.random.default_rng(0)
    vocab = 75  # not a multiple of 32: the last word's high bits are padding
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    allowed = rng.random((4, 96)) < 0.3
    allowed[3] = True  # a row without a grammar allows everything
    words = np.packbits(allowed.reshape(4, 3, 32)[..., ::-1], axis=-1, bitorder="big")
    bitmask = words.view(">u4").reshape(4, 3).astype(np.uint32).view(np.int32)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    want = np.where(allowed[:, :vocab], logits, -np.inf)
    np.testing.assert_array_equal(got, want)


def test_place_bitmask_puts_each_mask_on_its_device_row():
    a, b, c = object(), object(), object()
    rows = [ScheduledSeq(s, 0, 1, True) for s in (b, a, c)]
    masks = {a: np.full(2, 7, np.int32), c: np.full(2, 9, np.int32)}
    out = place_bitmask(rows, masks, 8, 2)
    assert out.shape == (8, 2) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:3], [[-1, -1], [7, 7], [9, 9]])
    assert (out[3:] == -1).all()


def test_request_fields_map_to_structured_outputs_params():
    schema = {"type": "object"}
    cases = [
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}}, StructuredOutputsParams(json=schema)),
        ({"guided_json": schema}, StructuredOutputsParams(json=schema)),
        ({"guided_regex": "a+"}, StructuredOutputsParams(regex="a+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        ({"structured_outputs": {"regex": "b"}}, StructuredOutputsParams(regex="b")),
    ]
    for fields, want in cases:
        assert structured_params(fields)[0] == want, fields
    assert structured_params({"response_format": {"type": "text"}}) == (None, "response_format")
    for fields, param in [({"response_format": {"type": "xml"}}, "response_format"),
                          ({"response_format": {"type": "json_schema"}},
                           "response_format.json_schema"),
                          ({"guided_choice": []}, "guided_choice"),
                          ({"guided_regex": "a", "guided_json": schema}, "guided_regex"),
                          ({"structured_outputs": {"grammar": "x"}}, "structured_outputs")]:
        with pytest.raises(RequestError) as err:
            structured_params(fields)
        assert err.value.param == param, fields
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return LLM(jprefix.load(smollm2_gguf, dtype="float32"), num_kv_blocks=512,
               max_model_len=1024)


def _chat(llm, text: str) -> list[int]:
    from jprefix.engine.input_processor import render_chat

    return render_chat(llm.tokenizer, [{"role": "user", "content": text}])


def test_ten_json_schemas_greedy_and_sampled_parse_and_validate(smol):
    prompts, params = [], []
    for i, (what, schema) in enumerate(SCHEMAS):
        for temperature in (0.0, 1.0):
            prompts.append(_chat(smol, f"Reply with {what} as JSON."))
            params.append(SamplingParams(
                temperature=temperature, seed=i, max_tokens=160,
                structured_outputs=StructuredOutputsParams(json=schema)))
    outs = smol.generate(prompts, params, use_tqdm=False)
    for (what, schema), pair in zip(SCHEMAS, zip(outs[::2], outs[1::2], strict=True),
                                    strict=True):
        for out in pair:
            assert out.finish_reason == "stop", (what, out.text)
            jsonschema.validate(json.loads(out.text), schema)


def test_regex_and_choice_outputs_match_and_a_complete_grammar_finishes(smol):
    regex, choices = r"[0-9]{3}-[a-z]{2,4}", ["yes", "no", 'maybe "later"']
    prompt = _chat(smol, "Answer.")
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = smol.generate([prompt], plain, use_tqdm=False)[0]
    outs = smol.generate([prompt] * 5, [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                       structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                       structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(choice=choices)),
        plain], use_tqdm=False)
    for out in outs[:2]:
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", out.text
    for out in outs[2:4]:
        assert out.text in choices and out.finish_reason == "stop", out.text
    # ignore_eos: only the grammar's completion can have stopped rows 0 and 2 early
    assert len(outs[0].token_ids) < 40 and len(outs[2].token_ids) < 40
    assert outs[4].token_ids == alone.token_ids  # a plain row beside them is unchanged


def test_a_bad_grammar_raises_naming_it_before_anything_runs(smol):
    for params, match in [(StructuredOutputsParams(json={"type": "sometimes"}),
                           "structured_outputs.json is invalid"),
                          (StructuredOutputsParams(regex="(["),
                           "structured_outputs.regex is invalid")]:
        with pytest.raises(ValueError, match=re.escape(match)):
            smol.generate(["Hi"], SamplingParams(structured_outputs=params), use_tqdm=False)
    assert not smol.engine.has_unfinished_requests()


def test_each_of_n_samples_follows_its_own_grammar_state(smol):
    """n > 1 fans one request out into sample sequences: each gets its own matcher (a
    shared one would see every sample's tokens and reject them)."""
    regex = r"[0-9]{2}-[a-z]{3}"
    out = smol.generate([_chat(smol, "Answer.")], SamplingParams(
        temperature=1.0, seed=3, n=4, max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=regex)), use_tqdm=False)[0]
    assert len(out.samples) == 4
    for sample in out.samples:
        assert re.fullmatch(regex, sample.text) and sample.finish_reason == "stop", sample.text
    assert len({s.text for s in out.samples}) > 1  # distinct seeds, distinct samples


def test_masks_are_filled_while_the_next_step_runs_and_equal_the_sync_path(smol):
    """While a structured token is in flight, the next step is dispatched up to its
    logits before that token is fetched, its masks are filled after, and its sampling is
    queued then (`ModelRunner.sample`): async scheduling kept. Tokens and logprobs equal
    the synchronous engine's (one program per step, masks filled before it)."""
    regex = r"[0-9]{3}-[a-z]{2,4}"
    prompt = _chat(smol, "Answer.")
    params = [SamplingParams(temperature=t, seed=s, max_tokens=30, logprobs=lp,
                             presence_penalty=pp,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[i][1])
                             if i is not None else StructuredOutputsParams(regex=regex))
              for t, s, lp, pp, i in [(0.0, 0, None, 0.0, 0), (1.0, 1, None, 0.0, None),
                                      (1.0, 2, 2, 0.5, 4), (0.0, 3, None, 0.0, 9)]]
    runner, events = smol.engine.runner, []

    def logged(name):
        method = getattr(runner, name)

        def call(*a, **kw):
            out = method(*a, **kw)
            events.append((name, out if name == "dispatch" else a[0]))
            return out
        return call

    for name in ("dispatch", "fetch", "sample"):
        setattr(runner, name, logged(name))
    try:
        outs = smol.generate([prompt] * 4, params, use_tqdm=False)
    finally:
        for name in ("dispatch", "fetch", "sample"):
            delattr(runner, name)
    handles = [h for e, h in events if e == "dispatch"]
    later = [h for h in handles if h.later is not None]
    assert len(later) >= 10  # every decode step with a structured token in flight
    order = {(e, id(h)): i for i, (e, h) in enumerate(events)}
    for prev, h in zip(handles, handles[1:], strict=False):
        if h.later is not None:  # dispatched before the step in flight was fetched
            assert order["dispatch", id(h)] < order["fetch", id(prev)] \
                < order["sample", id(h)] < order["fetch", id(h)]
    sync = LLM(smol.engine.model, num_kv_blocks=512, max_model_len=1024,
               async_scheduling=False)
    expected = sync.generate([prompt] * 4, params, use_tqdm=False)
    for out, exp in zip(outs, expected, strict=True):
        assert out.token_ids == exp.token_ids and out.finish_reason == exp.finish_reason
        assert out.finish_reason == "stop", out.text
    assert outs[2].logprobs is not None
    for got, exp in zip(outs[2].logprobs, expected[2].logprobs, strict=True):
        assert got.keys() == exp.keys()
        np.testing.assert_allclose([v.logprob for v in got.values()],
                                   [exp[k].logprob for k in got], rtol=1e-5, atol=1e-5)


def test_replica_views_share_the_matchers_but_each_waits_only_for_its_own_sequences(smol):
    """Data parallelism: the front compiles each grammar once; each replica's view finds
    every matcher but counts only the sequences admitted to it, so a replica does not
    hold its masks back for another replica's structured token in flight."""
    llm = smol
    front = llm.engine.structured
    view = front.replica_view()
    sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    a, b = (llm.engine.make_request([5, 6, 7], sp).seqs[0] for _ in range(2))
    front.admit(a)
    view.admit(b)  # b's matcher was compiled through the front
    a.num_pending, b.num_pending = 1, 0
    assert front.needs_sync() and not view.needs_sync()
    a.num_pending, b.num_pending = 0, 1
    assert view.needs_sync() and not front.needs_sync()
    rows = [ScheduledSeq(b, 3, 1, True)]
    assert set(view.bitmasks(rows)) == {b} and front.bitmasks(rows) is None
