"""Structured output on the host: one grammar matcher per request, through llguidance.

`StructuredOutputManager` compiles a request's `StructuredOutputsParams` when the request
is made (a bad schema, regex or choice list raises ValueError before anything is
scheduled), fills each step's packed token bitmask for the rows that sample under a
grammar (`bitmasks`: bit t of row r, word t // 32, allows token t), and feeds every
sampled token back to its matcher (`accept`), finishing a request whose grammar is
complete. The device applies the bitmask before sampling (`jprefix.worker.structured`).

A mask depends on every token sampled before it, so while a structured request's token
is in flight (`needs_sync`) the engine dispatches the next step up to its logits, then
processes the step in flight and fills the masks while the device runs the model, and
the runner samples once they are there (`LLMEngine._masks_later`): the masks overlap
the device step and steps keep async scheduling.

llguidance: a Rust grammar engine with no Python dependencies (JSON Schema incl. patterns,
nested objects and $ref, regexes and Lark grammars); it builds each grammar's lexer
lazily, so compiling takes about a millisecond and a mask about ten microseconds on a
49k vocabulary (docs/ARCHITECTURE.md, "Structured output").
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import weakref
from typing import Any

import numpy as np

from jprefix.core.sequence import Sequence
from jprefix.core.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not yet checked: see `compile`)."""
    import llguidance

    matcher = llguidance.LLMatcher
    if params.regex is not None:
        return matcher.grammar_from_regex(params.regex)
    if params.choice is not None:  # a Lark rule whose alternatives are the literal strings
        options = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return matcher.grammar_from_lark(f"start: {options}")
    return matcher.grammar_from_json_schema(params.schema(), defaults={
        "whitespace_flexible": False})  # compact JSON: no runs of whitespace to sample


def short_error(message: str, limit: int = 200) -> str:
    """llguidance's error's first line, at most `limit` characters: its later lines dump
    the matcher's state (the grammar, the tokens), which may hold a user's schema and
    grow with it."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return first if len(first) <= limit else first[: limit - 3] + "..."


class StructuredOutputManager:
    """The grammar matchers of one engine's requests (created on any thread, used on the
    engine's)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._hf_tokenizer, self._eos = tokenizer, list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._executor: Any = None  # llguidance's thread pool for many rows' masks
        self._lock = threading.Lock()
        self._matchers: weakref.WeakKeyDictionary[Sequence, Any] = weakref.WeakKeyDictionary()
        self._active: set[Sequence] = set()  # matchers of sequences in the scheduler

    def replica_view(self) -> StructuredOutputManager:
        """A manager for another data-parallel replica: the same compiled matchers (the
        front prepares each request once, before routing it), its own admitted
        sequences (so `needs_sync`, `bitmasks` and `accept` see only that replica's) and
        its own mask thread pool (replicas step on their own threads)."""
        view = copy.copy(self)
        view._active, view._executor = set(), None
        return view

    def _tokenizer(self) -> Any:
        """llguidance's view of the vocabulary (built once, on the first grammar)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                if self._hf_tokenizer is None or not hasattr(self._hf_tokenizer,
                                                             "backend_tokenizer"):
                    raise ValueError("structured output needs the model's (fast) tokenizer, "
                                     "and this model has none")
                spec = self._hf_tokenizer.backend_tokenizer.to_str()
                self._ll_tokenizer = llguidance.LLTokenizer(
                    spec, n_vocab=self.vocab_size, eos_token=self._eos[0])
            return self._ll_tokenizer

    def prepare(self, seq: Sequence) -> None:
        """Compiles `seq`'s grammar, if it has one; ValueError naming what is wrong."""
        params = getattr(seq.sampling_params, "structured_outputs", None)
        if params is None:
            return
        import llguidance

        tokenizer = self._tokenizer()
        try:
            grammar = grammar_text(params)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {exc}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        error = short_error(matcher.get_error(), 500) if matcher.is_error() \
            else self._probe(matcher)
        if error:
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {error}")
        with self._lock:
            self._matchers[seq] = matcher

    def _probe(self, matcher: Any) -> str | None:
        """Why the grammar cannot be followed, found by a dry run of its first token on a
        copy of the matcher, or None. llguidance builds its lexer and parser rows
        lazily, so limits (more than 2,000 alternatives in a parser row, a regex whose
        lexer grows past its budget) show only when a token is consumed: caught here,
        they are a 400 before generation instead of a matcher stopped mid-output."""
        import llguidance.numpy as lln

        probe = matcher.deep_copy()
        mask = np.zeros((1, self.words), np.int32)
        lln.fill_next_token_bitmask(probe, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        tokens = [int(t) for t in allowed[:2] if t < self.vocab_size and t not in self._eos]
        if not probe.is_error() and tokens:
            probe.consume_token(tokens[0])
        return short_error(probe.get_error()) if probe.is_error() else None

    def admit(self, seq: Sequence) -> None:
        """`seq` enters the scheduler (engine thread)."""
        if seq in self._matchers:
            self._active.add(seq)

    def needs_sync(self) -> bool:
        """Whether a structured request's newest token is still in flight (its next mask
        needs it)."""
        return any(seq.num_pending for seq in self._active)

    def bitmasks(self, scheduled: Any) -> dict[Sequence, np.ndarray] | None:
        """Each sampling structured row's allowed tokens ([words] int32), or None when
        the step has none. Every token sampled before the step has been accepted (the
        engine calls this before the dispatch, or after processing the step in flight
        while the step runs its model: `needs_sync`)."""
        if not self._active:
            return None
        import llguidance.numpy as lln

        rows = [sc.seq for sc in scheduled  # (a row finished by the step before: no mask)
                if sc.sample and sc.seq in self._active and not sc.seq.is_finished()]
        if not rows:
            return None
        masks = np.empty((len(rows), self.words), np.int32)
        if len(rows) == 1:
            lln.fill_next_token_bitmask(self._matchers[rows[0]], masks, 0)
        else:  # rows in parallel, in llguidance's threads (outside the GIL)
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            lln.fill_next_token_bitmask_par(
                self._executor, [(self._matchers[s], i) for i, s in enumerate(rows)], masks)
        return dict(zip(rows, masks, strict=True))

    def accept(self, scheduled: Any, tokens: list[int]) -> list[Sequence]:
        """Feeds each structured row's sampled token to its matcher; returns the live
        sequences whose grammar is now complete (the caller finishes them)."""
        done: list[Sequence] = []
        if not self._active:
            return done
        for sc, token in zip(scheduled, tokens, strict=True):
            seq = sc.seq
            if not sc.sample or seq not in self._active:
                continue
            matcher = self._matchers[seq]
            if matcher.is_stopped():
                continue  # (the token after a complete grammar: EOS, or one in flight)
            if not matcher.consume_token(token):
                # once per request (the matcher is stopped from now on); the first line
                # of llguidance's error, never the grammar or its state
                logger.info("request %s: its grammar cannot be followed (%s); it ends "
                            "with finish reason 'error'", seq.request_id,
                            short_error(matcher.get_error()))
            if matcher.is_stopped() and not seq.is_finished():
                done.append(seq)
        return done

    def finish_reason(self, seq: Sequence) -> str:
        """The finish reason of a request `accept` returned: "stop" when its grammar is
        complete, "error" when the matcher failed (the output does not complete it)."""
        matcher = self._matchers.get(seq)
        return "error" if matcher is not None and matcher.is_error() else "stop"

    def forget(self, seqs: list[Sequence]) -> None:
        """Drops the matchers of finished (or aborted) sequences."""
        for seq in seqs:
            self._active.discard(seq)
            self._matchers.pop(seq, None)
