"""Which grammar library fills a token mask fastest on the SmolLM2 vocabulary (49,152)?

For a few JSON schemas and a regex, builds each library's matcher, walks a valid output
token by token and times the per-token mask fill (the host work of a structured row in
every step) and the grammar's compile. Libraries missing from the environment are skipped.

    python scripts/probes/probe_grammar.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/probes/NAME.py`: this checkout first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import json
import statistics
import time

from models.loader import load

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "tags"]},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"]}),
    "nested": ({"type": "object", "properties": {"id": {"type": "string",
        "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "items": {"type": "array", "items": {
            "type": "object", "properties": {"sku": {"type": "string"},
            "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}}},
        "required": ["id", "items"]},
        {"id": "ABC-1234", "items": [{"sku": "x1", "qty": 2}, {"sku": "y22", "qty": 10}]}),
}
REGEX = (r"\d{3}-\d{3}-\d{4}", "555-867-5309")


def _walk(name, tok, text, make, fill, consume):
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    t0 = time.perf_counter()
    state = make()
    compile_s = time.perf_counter() - t0
    times = []
    for t in ids[:-1]:
        t0 = time.perf_counter()
        fill(state)
        times.append(time.perf_counter() - t0)
        consume(state, t)
    print(f"  {name:14s} compile {compile_s * 1e3:8.1f} ms   mask median "
          f"{statistics.median(times) * 1e6:8.1f} us  max {max(times) * 1e6:8.1f} us "
          f"({len(times)} tokens)")


def llguidance_rows(tok):
    import llguidance
    import llguidance.numpy as lln
    ll_tok = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=len(tok),
                                    eos_token=tok.eos_token_id)
    mask = lln.allocate_token_bitmask(1, len(tok))

    def run(label, grammar, text):
        _walk(label, tok, text, lambda: llguidance.LLMatcher(ll_tok, grammar, log_level=0),
              lambda m: lln.fill_next_token_bitmask(m, mask, 0),
              lambda m, t: m.consume_token(t))
    return run, llguidance.LLMatcher.grammar_from_json_schema, \
        llguidance.LLMatcher.grammar_from_regex


def outlines_rows(tok):
    import numpy as np
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    vocab = {}
    for t, i in tok.get_vocab().items():
        if i != tok.eos_token_id:
            vocab.setdefault(tok.convert_tokens_to_string([t]), []).append(i)
    v = Vocabulary(tok.eos_token_id, vocab)
    mask = np.zeros((len(tok) + 31) // 32, np.int32)

    def run(label, regex, text):
        _walk(label, tok, text, lambda: Guide(Index(regex, v)),
              lambda g: g.write_mask_into(mask.ctypes.data, mask.size, 4),
              lambda g, t: g.advance(t, return_tokens=False))
    return run, lambda s: build_regex_from_schema(json.dumps(s)), lambda r: r


def xgrammar_rows(tok):
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    mask = xgr.allocate_token_bitmask(1, len(tok))

    def run(label, compiled, text):
        _walk(label, tok, text, lambda: xgr.GrammarMatcher(compiled),
              lambda m: m.fill_next_token_bitmask(mask), lambda m, t: m.accept_token(t))
    return run, lambda s: compiler.compile_json_schema(json.dumps(s)), \
        compiler.compile_regex


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # (--help)
    tok = load("smollm2-135m", "float32").tokenizer
    for lib, rows in (("llguidance", llguidance_rows), ("outlines-core", outlines_rows),
                      ("xgrammar", xgrammar_rows)):
        try:
            run, from_schema, from_regex = rows(tok)
        except ImportError as exc:
            print(f"{lib}: not installed ({exc})")
            continue
        print(lib)
        for name, (schema, value) in SCHEMAS.items():
            run(name, from_schema(schema), json.dumps(value))
        run("regex", from_regex(REGEX[0]), REGEX[1])


if __name__ == "__main__":
    main()
