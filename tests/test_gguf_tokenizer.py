"""The GGUF tokenizer built from metadata (no torch) equals transformers' GGUF tokenizer."""

import pytest

from models.gguf_tokenizer import gguf_tokenizer

TEXTS = [
    "Hello world!",
    "The year 2024 had 366 days; pi=3.14159.",
    "  leading spaces\n\nnew lines\ttabs  ",
    "Ünïcödé — 漢字 emoji 🎉",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x**2  # comment",
    "don't won't I'm y'all",
]


@pytest.fixture(scope="module")
def pair(smollm2_gguf):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    return gguf_tokenizer(smollm2_gguf), hf


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_round_trip_match_transformers(pair, text):
    ours, hf = pair
    ids = ours(text).input_ids
    assert ids == hf(text).input_ids
    assert ours.decode(ids) == hf.decode(ids)


def test_chat_template_and_special_tokens_match_transformers(pair):
    ours, hf = pair
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 42"}]
    a = ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert a == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours(a, add_special_tokens=False).input_ids == hf(a, add_special_tokens=False).input_ids
    assert (ours.eos_token_id, ours.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert ours.decode(ours(a).input_ids, skip_special_tokens=True) == \
        hf.decode(hf(a).input_ids, skip_special_tokens=True)


def test_gguf_without_tokenizer_metadata_is_rejected(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no tokenizer"):
        gguf_tokenizer(path)
