"""The real SmolLM2-135M: cached == uncached == dense greedy generation, and the CLI."""

import asyncio

import pytest

import jprefix
from jprefix import LLM, SamplingParams
from jprefix.entrypoints.cli import main as cli_main
from models.reference import dense_generate

pytestmark = pytest.mark.usefixtures("full_opt_steps")  # (real-model steps: conftest)

SYSTEM = (
    "You are a support assistant for a bookshop. Answer briefly and politely. Orders ship "
    "within five business days and returns are accepted for thirty days after delivery. "
    "We sell new and used books, sheet music and audiobooks; gift cards never expire; "
    "customers with an account can track every parcel from the orders page."
)
USERS = ["Where is my order?", "Can I return a book?", "Do you sell music?"]


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return jprefix.load(smollm2_gguf, dtype="float32")


def _chat(tok, user):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def test_smollm2_greedy_identical_cached_uncached_dense(smol):
    prompts = [_chat(smol.tokenizer, u) for u in USERS]
    n = 16
    dense = [dense_generate(smol.params, smol.config, p, n, eos_token_ids=()) for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for mode, prefix in (("explicit", 64), ("auto", None), ("off", None)):
        llm = LLM(smol, enable_prefix_caching=mode != "off", num_kv_blocks=64)
        llm.generate(prompts[:1], sp, prefix_pos=prefix, use_tqdm=False)  # fill the cache
        outs = llm.generate(prompts, sp, prefix_pos=prefix, use_tqdm=False)
        assert [o.token_ids for o in outs] == dense, mode
        if mode != "off":
            assert all(o.num_cached_tokens >= 64 for o in outs)
        assert outs[0].text == smol.tokenizer.decode(dense[0], skip_special_tokens=True)


def test_smollm2_string_prompts_and_stop_strings(smol):
    llm = LLM(smol, num_kv_blocks=64)
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out.prompt == "The capital of France is" and out.text
    word = out.text.split()[1] if len(out.text.split()) > 1 else out.text.split()[0]
    cut = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=24, stop=[word]),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and word not in cut.text
    assert cut.text == out.text[: out.text.find(word)]  # cut right before the stop string


def test_cli_generate_prints_outputs_and_cache_table(capsys):
    assert cli_main(["generate", "--prompt", "Hi!", "--prompt", "Name a colour.",
                     "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "### Hi!" in printed and "### Name a colour." in printed
    assert "served from prefix cache" in printed and "hit rate" in printed
    served = int(next(ln for ln in printed.splitlines() if "served from" in ln).split()[-1])
    assert served > 0  # the second prompt reused the system prompt's blocks
    rows = {ln.rsplit(None, 1)[0]: ln.rsplit(None, 1)[1] for ln in printed.splitlines()
            if ln.startswith(("load", "compile", "generate"))}
    assert set(rows) == {"load (s)", "generate (s, excl. compile)"} | {
        k for k in rows if k.startswith("compile (s, ") and k.endswith(" programs)")}
    assert len(rows) == 3 and all(float(v) >= 0 for v in rows.values())
    assert "loading smollm2-135m" in captured.err and "loaded in" in captured.err
    assert "max model len" in captured.err and "PyTorch" not in captured.err


def test_smollm2_stop_strings_wait_for_min_tokens(smol):
    """A stop string in the first `min_tokens` tokens' text does not stop the request (as
    stop token ids do not); streamed as deltas, the same text."""
    llm = LLM(smol, num_kv_blocks=64)
    prompt = ["The capital of France is"]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    first = smol.tokenizer.decode(free.token_ids[:1], skip_special_tokens=True).strip()
    assert first, free.text
    early = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[first]),
                         use_tqdm=False)[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    gated = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=6,
                                                stop=[first]), use_tqdm=False)[0]
    assert len(gated.token_ids) >= 6 and gated.token_ids[:6] == free.token_ids[:6]
    assert gated.text == free.text[: len(gated.text)] and first in gated.text[:len(free.text)]
    async def streamed(min_tokens: int) -> list:
        sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=min_tokens, stop=[first])
        return [out async for out in llm.stream_async(prompt[0], sp)]

    for min_tokens, final in ((0, early), (6, gated)):
        deltas = asyncio.run(streamed(min_tokens))
        assert "".join(d.text for d in deltas) == final.text, (min_tokens, deltas)
        assert sum((d.token_ids for d in deltas), []) == final.token_ids
        reasons = [d.finish_reason for d in deltas]
        assert reasons == [None] * (len(deltas) - 1) + [final.finish_reason]


def test_streamed_deltas_equal_the_whole_output(smol):
    """The Python API's stream (the engine's DELTA outputs) joins to exactly what
    `generate` returns for the same seed: text with a stop string, tokens, logprobs, and
    every one of n samples."""
    llm = LLM(smol, num_kv_blocks=64)
    prompt = "Write a short list of fruits:"
    stops = [",", "\n"]
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=16, stop=stops, logprobs=2, n=2)
    whole = llm.generate([prompt], sp, use_tqdm=False)[0]

    async def streamed() -> list:
        return [out async for out in llm.stream_async(prompt, sp)]

    deltas = asyncio.run(streamed())
    ids = sorted({d.request_id for d in deltas})
    assert len(ids) == 2
    for sample, rid in zip(whole.outputs, ids, strict=True):
        mine = [d for d in deltas if d.request_id == rid]
        assert "".join(d.text for d in mine) == sample.text
        assert not any(s in sample.text for s in stops)
        assert sum((d.token_ids for d in mine), []) == sample.token_ids
        joined = sum((d.logprobs for d in mine), [])
        assert [{t: lp.logprob for t, lp in p.items()} for p in joined] == \
            [{t: lp.logprob for t, lp in p.items()} for p in sample.logprobs]
        assert mine[-1].finish_reason == sample.finish_reason
        assert all(d.finish_reason is None for d in mine[:-1])
