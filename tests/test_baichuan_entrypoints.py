"""Baichuan2 through the entrypoints: its checkpoints carry no tokenizer jprefix can load
(theirs is remote code), so `tokenizer` (EngineArgs, `LLM`, `jprefix serve --tokenizer`,
`jprefix generate --tokenizer`) names one; text prompts then run as their token ids do,
and without one the API and the server refuse text clearly while token ids still run."""

from __future__ import annotations

import pytest

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import jprefix  # noqa: E402
from jprefix import LLM, SamplingParams  # noqa: E402
from jprefix.entrypoints import cli  # noqa: E402
from jprefix.entrypoints.openai_server import build_app  # noqa: E402
from models.gguf_tokenizer import gguf_tokenizer  # noqa: E402

MODEL = "tiny-baichuan2-alibi"
TEXT = "The prefix cache serves the system prompt once."
SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_gguf, tmp_path_factory):
    """A tokenizer directory AutoTokenizer loads (SmolLM2's: ids fit Baichuan2's vocab)."""
    path = tmp_path_factory.mktemp("tokenizer")
    gguf_tokenizer(smollm2_gguf).save_pretrained(path)
    return str(path)


def _llm(**kw):
    return LLM(MODEL, dtype="float32", load_format="dummy", block_size=8, num_kv_blocks=64,
               **kw)


def test_llm_by_name_takes_a_tokenizer_and_text_runs_as_its_ids(tokenizer_dir):
    llm = _llm(tokenizer=tokenizer_dir)
    assert llm.tokenizer is not None
    ids = llm.tokenizer(TEXT).input_ids
    by_text = llm.generate([TEXT], SP, use_tqdm=False)[0]
    by_ids = llm.generate([ids], SP, use_tqdm=False)[0]
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids
    with TestClient(build_app(llm)) as client:
        body = {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        reply = client.post("/v1/completions", json=body).json()
    assert reply["choices"][0]["token_ids"] == by_ids.token_ids
    assert reply["choices"][0]["text"] == llm.tokenizer.decode(by_ids.token_ids)


def test_without_a_tokenizer_text_is_refused_and_token_ids_run():
    llm = _llm()
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate([TEXT], SP, use_tqdm=False)
    with TestClient(build_app(llm)) as client:
        bad = client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 2})
        good = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2,
                                                    "ignore_eos": True,
                                                    "return_token_ids": True})
    assert bad.status_code == 400 and "no tokenizer" in bad.json()["error"]["message"]
    assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) == 2


def test_a_tokenizer_for_a_model_passed_in_is_refused(tokenizer_dir):
    model = jprefix.load(MODEL, dtype="float32", load_format="dummy")
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model, tokenizer=tokenizer_dir, block_size=8, num_kv_blocks=64)


def test_cli_generate_and_serve_take_the_tokenizer(tokenizer_dir, monkeypatch, capsys):
    argv = ["generate", "--model", MODEL, "--load-format", "dummy", "--dtype", "float32",
            "--max-tokens", "2", "--block-size", "8", "--prompt", TEXT]
    assert cli.main(argv + ["--tokenizer", tokenizer_dir]) == 0
    assert "served from prefix cache" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--tokenizer"):
        cli.main(argv)
    seen = {}
    monkeypatch.setattr(jprefix, "LLM", lambda model, **kw: seen.update(kw))
    monkeypatch.setattr("jprefix.entrypoints.openai_server.serve", lambda *a, **k: None)
    assert cli.main(["serve", "--model", MODEL, "--tokenizer", tokenizer_dir]) == 0
    assert seen["tokenizer"] == tokenizer_dir
