"""N-gram (prompt lookup) proposals: a request's own tokens predict its next ones.

The longest suffix of the request's tokens (prompt + output), `prompt_lookup_max` tokens
down to `prompt_lookup_min`, that also occurred earlier: the proposal is the up to k
tokens that followed its most recent earlier occurrence. One numpy pass per suffix
length over the candidate ends (the positions holding the last token), so a step costs
O(occurrences of the last token * max) vectorised work, not O(n^2) Python.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np


class NgramProposer:
    """Proposes from prompt lookup; stateless, so one serves every sequence."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {prompt_lookup_min} and prompt_lookup_max "
                             f"{prompt_lookup_max} need 1 <= min <= max")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Seq[int] | np.ndarray, k: int) -> list[int]:
        """Up to k proposed next tokens (empty: no suffix of at least `min_n` tokens
        occurred earlier, or k <= 0)."""
        n = len(token_ids)
        if k <= 0 or n <= self.min_n:
            return []
        a = np.asarray(token_ids, dtype=np.int64)
        # candidate ends e < n - 1 of an earlier occurrence: a[e] == a[-1]
        ends = np.flatnonzero(a[: n - 1] == a[n - 1])
        best = -1
        for j in range(1, min(self.max_n, n - 1) + 1):
            if len(ends) == 0:
                break
            if j >= self.min_n:
                best = int(ends[-1])  # (ascending: the last is the most recent)
            if j == self.max_n:
                break
            ends = ends[ends >= j]
            ends = ends[a[ends - j] == a[n - 1 - j]]
        if best < 0:
            return []
        return a[best + 1 : best + 1 + k].tolist()
