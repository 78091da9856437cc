"""A stand-in grammar for models without a tokenizer (imported by tests): every row may
sample only the token ids t with t % M == (its previous token + 1) % M, so a mask filled
from a stale token (one step behind) shows in the output. It has the interface the
engine uses of `StructuredOutputManager` (prepare, admit, needs_sync, bitmasks, accept,
forget) and constrains every request."""

from __future__ import annotations

import numpy as np

from jprefix.engine.structured_output import bitmask_words


class NextResidue:
    def __init__(self, vocab_size: int, m: int = 5):
        self.vocab, self.m, self.words = vocab_size, m, bitmask_words(vocab_size)
        self.last: dict = {}  # sequence -> its last accepted token

    def prepare(self, seq) -> None:
        pass

    def admit(self, seq) -> None:
        self.last[seq] = seq.all_token_ids[seq.num_prompt_tokens - 1]

    def needs_sync(self) -> bool:
        return any(seq.num_pending for seq in self.last)

    def bitmasks(self, scheduled):
        rows = [sc.seq for sc in scheduled
                if sc.sample and sc.seq in self.last and not sc.seq.is_finished()]
        if not rows:
            return None
        ids = np.arange(self.words * 32)
        return {seq: np.packbits((ids % self.m == (self.last[seq] + 1) % self.m)
                                 & (ids < self.vocab), bitorder="little").view(np.int32)
                for seq in rows}

    def accept(self, scheduled, tokens) -> list:
        for sc, token in zip(scheduled, tokens, strict=True):
            if sc.sample and sc.seq in self.last and not sc.seq.is_finished():
                self.last[sc.seq] = token
        return []

    def forget(self, seqs) -> None:
        for seq in seqs:
            self.last.pop(seq, None)


def follows(prompt: list[int], output: list[int], m: int = 5) -> bool:
    """Whether `output` keeps the rule after `prompt`."""
    prev = [prompt[-1], *output[:-1]]
    return all(t % m == (p + 1) % m for p, t in zip(prev, output, strict=True))
