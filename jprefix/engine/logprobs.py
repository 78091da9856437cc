"""Logprobs on the host: an extra step's device logprobs attached to its sequences, and
turned into vLLM's per-position dicts of `Logprob` when a request finishes.

A sequence keeps one raw entry (token, logprob, rank, top ids, top logprobs) per output
token and per prompt position. Entries are attached by position, so a step whose token
was dropped (its request aborted or finished meanwhile) or a prompt position computed
again (a preempted request recomputes its prompt) adds nothing twice.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from jprefix.core.outputs import Logprob, PositionLogprobs


def attach_logprobs(scheduled: Seq, logprobs: tuple[tuple, tuple] | None,
                    prompt_positions: list[tuple[Any, int]] | None) -> None:
    """Attaches a processed step's logprobs (`ModelRunner.fetch_logprobs`): row i's to
    `scheduled[i]`'s sequence if it sampled, wants logprobs and has just appended the
    token they are of; each prompt entry to its sequence if it is the next position."""
    if logprobs is None:
        return
    (lp, rank, top_ids, top_lp), prompt = logprobs
    for i, (seq, _, _, sample) in enumerate(scheduled):
        k = seq.num_logprobs
        if not sample or k is None or len(seq.output_logprobs) != seq.num_output_tokens - 1:
            continue
        seq.output_logprobs.append((seq.all_token_ids[-1], float(lp[i]), int(rank[i]),
                                    top_ids[i, :k].tolist(), top_lp[i, :k].tolist()))
        seq.cumulative_logprob += float(lp[i])
    p_lp, p_rank, p_ids, p_top = prompt
    for j, (seq, p) in enumerate(prompt_positions or ()):
        if len(seq.prompt_logprobs) == p:
            k = seq.num_prompt_logprobs
            seq.prompt_logprobs.append((seq.prompt_token_ids[p + 1], float(p_lp[j]),
                                        int(p_rank[j]), p_ids[j, :k].tolist(),
                                        p_top[j, :k].tolist()))


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
