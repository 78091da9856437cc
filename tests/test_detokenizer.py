"""Incremental detokenization: the deltas, fed a token at a time or in chunks, concatenate
to the full decode (byte-level BPE with multi-byte characters split across tokens, and a
SentencePiece-style decoder that strips the leading space of whatever it decodes)."""

import random

import pytest

from jprefix.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world! The year 2024 had 366 days; pi=3.14159.",
    "Ünïcödé — 漢字 emoji 🎉🎉 and more 😀 text after it",
    "  leading spaces\n\nnew lines\ttabs  <|im_end|> after a special token",
    "def f(x):\n    return x**2  # comment " * 5,
]


def _feed(tokenizer, ids, rng) -> tuple[str, list[str]]:
    det, deltas, i = IncrementalDetokenizer(tokenizer), [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 7])
        deltas.append(det.push(ids[i : i + n]))
        i += n
    return det.text, deltas


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    from models.gguf_tokenizer import gguf_tokenizer

    return gguf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A small BPE trained here, with Llama-2's decoder (▁ -> space, strip one leading)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"])
    tok.train_from_iterator([t for t in TEXTS if t.isascii()] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("kind", ["smollm2_tokenizer", "metaspace_tokenizer"])
@pytest.mark.parametrize("seed", [0, 1])
def test_deltas_concatenate_to_the_full_decode(kind, seed, request):
    tokenizer = request.getfixturevalue(kind)
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        full = tokenizer.decode(ids, skip_special_tokens=True)
        got, deltas = _feed(tokenizer, ids, rng)
        assert got == "".join(deltas) == full, (kind, text)
        assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_random_ids_never_emit_more_than_the_full_decode(smollm2_tokenizer):
    rng = random.Random(3)
    vocab = smollm2_tokenizer.vocab_size
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        got, _ = _feed(smollm2_tokenizer, ids, rng)
        full = smollm2_tokenizer.decode(ids, skip_special_tokens=True)
        assert full.startswith(got)  # held-back text only ever at the end


def test_no_tokenizer_gives_no_text():
    det = IncrementalDetokenizer(None)
    assert det.push([1, 2]) == "" and det.text == "" and det.ids == [1, 2]


def test_a_long_run_of_partial_bytes_then_the_rest_still_matches(smollm2_tokenizer):
    """Lone continuation bytes (never a character), then an emoji split across pushes,
    reaching the resync point in the middle of the emoji: no half character is emitted,
    and the text keeps up with the full decode instead of freezing."""
    tok = smollm2_tokenizer
    byte_ids = [tok.convert_tokens_to_ids(t) for t in tok.convert_ids_to_tokens(
        tok("🎉", add_special_tokens=False).input_ids)]
    lone = tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(tok("\x80",
                                     add_special_tokens=False).input_ids))
    ids = tok("hello world", add_special_tokens=False).input_ids
    det = IncrementalDetokenizer(tok)
    det.push(ids)
    for _ in range(15):  # the emoji's first byte then makes 16 held-back tokens
        det.push(lone[-1:])
    for t in byte_ids:
        det.push([t])
    tail = tok(" and more text", add_special_tokens=False).input_ids
    for t in tail:
        det.push([t])
    full = tok.decode(det.ids, skip_special_tokens=True)
    assert det.text == full and "🎉" in det.text
