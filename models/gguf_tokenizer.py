"""The tokenizer of a GGUF file, built from its metadata with `tokenizers` (no torch).

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, as SmolLM2, Qwen2 and
Llama-3 GGUFs carry) are rebuilt here: vocabulary, merges, control tokens as special
tokens, BOS/EOS/UNK/PAD and the chat template. Other vocabularies (sentencepiece
"llama") go through transformers' GGUF loader, which needs torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def gguf_tokenizer(path: Path, fields: dict[str, Any] | None = None) -> Any:
    """A transformers fast tokenizer for the GGUF at `path`; ValueError if it has none.
    `fields`: the file's metadata if the caller read it already (`models.gguf_file`)."""
    if fields is None:
        from models.gguf_file import read_gguf

        fields = read_gguf(path).fields
    if "tokenizer.ggml.model" not in fields:
        raise ValueError(f"{path}: the GGUF carries no tokenizer")
    if fields["tokenizer.ggml.model"] == "gpt2":
        return _byte_level_bpe({k: v for k, v in fields.items() if k.startswith("tokenizer.")})
    return _transformers_gguf_tokenizer(path)


def _byte_level_bpe(meta: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=False) if ty == CONTROL])
    bpe.add_tokens([AddedToken(t, normalized=False)
                    for t, ty in zip(tokens, types, strict=False) if ty == USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=token("bos"), eos_token=token("eos"),
        unk_token=token("unknown"), pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _transformers_gguf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many types (torch missing, odd vocabularies)
        raise ValueError(f"{path}: could not build a tokenizer from the GGUF: {e}") from e
