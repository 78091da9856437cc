"""Logprobs on the host: an extra step's device logprobs kept per request (the output
processor's `LogprobState`), and turned into vLLM's per-position dicts of `Logprob`.

A request keeps one raw entry (token, logprob, rank, top ids, top logprobs) per output
token and per prompt position. Entries are attached by position, so a step whose token
was dropped (its request aborted or finished meanwhile) or a prompt position computed
again (a preempted request recomputes its prompt) adds nothing twice.
"""

from __future__ import annotations

from typing import Any

from jprefix.core.outputs import Logprob, PositionLogprobs
from jprefix.core.sequence import Sequence


class LogprobState:
    """One request's logprobs: `num_logprobs` top-k per output token (None: none; 0: the
    sampled token's own only) and `num_prompt_logprobs` per prompt position >= 1."""

    def __init__(self, num_logprobs: int | None, num_prompt_logprobs: int | None):
        self.num_logprobs, self.num_prompt_logprobs = num_logprobs, num_prompt_logprobs
        self.output: list[tuple] = []
        self.prompt: list[tuple] = []
        self.cumulative = 0.0  # the sum over output tokens

    def attach_output(self, seq: Sequence, lp: float, rank: int, top_ids: Any,
                      top_lps: Any, index: int | None = None) -> None:
        """The entry of `seq`'s output token number `index` (None: its newest), if it
        wants logprobs and the entry is the next one (the token was appended, not
        dropped)."""
        k = self.num_logprobs
        index = seq.num_output_tokens - 1 if index is None else index
        if k is None or len(self.output) != index:
            return
        token = seq.all_token_ids[len(seq.prompt_token_ids) + index]
        self.output.append((token, lp, rank, top_ids[:k].tolist(), top_lps[:k].tolist()))
        self.cumulative += lp

    def attach_outputs(self, seq: Sequence, entries: list[Any]) -> None:
        """A verify row's entries (logprob [K+1], rank [K+1], top ids [K+1, k], top
        logprobs [K+1, k]) for the tokens it appended to `seq` (the first of its emitted
        tokens: a stop may end them early), if its first is the next entry."""
        lp, rank, top_ids, top_lps = entries
        first = len(self.output)
        n = seq.num_output_tokens - first
        if self.num_logprobs is None or not 0 < n <= len(lp):
            return
        for j in range(n):
            self.attach_output(seq, float(lp[j]), int(rank[j]), top_ids[j], top_lps[j],
                               index=first + j)

    def attach_prompt(self, seq: Sequence, p: int, prompt: tuple, j: int) -> None:
        """Entry j of a step's prompt logprobs (lp, rank, top ids, top logprobs arrays),
        the logprob of prompt token p + 1, if it is the next position."""
        if len(self.prompt) != p:
            return
        p_lp, p_rank, p_ids, p_top = prompt
        k = self.num_prompt_logprobs
        self.prompt.append((seq.prompt_token_ids[p + 1], float(p_lp[j]), int(p_rank[j]),
                            p_ids[j, :k].tolist(), p_top[j, :k].tolist()))


def position_dicts(entries: list[tuple], tokenizer: Any) -> list[PositionLogprobs]:
    """Raw entries -> one dict per position: the chosen token first, then the top-k
    tokens (rank 1..k) not already in it; each with its decoded text."""
    texts: dict[int, str | None] = {}

    def text(token: int) -> str | None:
        if token not in texts:
            texts[token] = (None if tokenizer is None
                            else tokenizer.decode([token], skip_special_tokens=False))
        return texts[token]

    out = []
    for token, lp, rank, top_ids, top_lps in entries:
        d = {token: Logprob(lp, rank, text(token))}
        for r, (t, v) in enumerate(zip(top_ids, top_lps, strict=True), start=1):
            if t not in d:
                d[t] = Logprob(v, r, text(t))
        out.append(d)
    return out
