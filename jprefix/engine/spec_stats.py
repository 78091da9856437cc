"""Speculative decoding's counters (vLLM's `SpecDecodingStats`) and the engine's use of
a verify step's output.

`num_drafts`: verify rows (rows that carried proposals); `num_draft_tokens`: proposals
verified; `num_accepted_tokens`: proposals accepted; `accepted_per_pos[j]`: rows whose
proposal j was accepted (non-increasing in j: acceptance stops at the first rejection).
The acceptance rate is accepted / draft tokens; the mean accepted length is 1 + accepted
/ drafts (every verify row emits its accepted proposals and one token of its own).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


class SpecDecodingStats:
    def __init__(self, k: int = 0):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One verify row: its proposals and how many were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        k = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + [0] * (k - len(self.accepted_per_pos))
        for j, n in enumerate(other.accepted_per_pos):
            mine[j] += n
        self.accepted_per_pos = mine

    def summary(self) -> dict[str, Any]:
        """/stats' `spec_decode` entry."""
        drafts, tokens = self.num_drafts, self.num_draft_tokens
        return {"num_drafts": drafts, "num_draft_tokens": tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.num_accepted_tokens / tokens if tokens else 0.0,
                "acceptance_rate_per_pos": [n / drafts if drafts else 0.0
                                            for n in self.accepted_per_pos],
                "mean_accepted_length": 1 + self.num_accepted_tokens / drafts if drafts
                else 0.0}


def apply_verified(scheduled: Iterable[Any], tokens: list[Any], verified: tuple[
        np.ndarray, np.ndarray], stats: SpecDecodingStats) -> tuple[list[Any], int]:
    """`tokens` (one per scheduled row) with each verify row's entry replaced by the list
    of tokens it emitted (accepted proposals, then the target's token), which the
    scheduler's `update` takes; counts the rows in `stats`. Returns (tokens, tokens
    emitted beyond one per row)."""
    out, extra = list(tokens), 0
    target, accepted = verified
    for i, sc in enumerate(scheduled):
        d = len(sc.seq.spec_token_ids)
        if d and sc.sample:
            a = int(accepted[i])
            out[i] = target[i, : a + 1].tolist()
            stats.observe(d, a)
            extra += a
    return out, extra
