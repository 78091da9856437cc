"""RequestRows: the packer's per-request arrays, kept between steps by request id (the
worker's part of a request's state, as vLLM's `CachedRequestState`; the sequence itself
is the scheduler's and is only read here).

Kept per request: its block table as an int32 array (and the suffix a cascade step
reads), its prompt's distinct tokens and a buffer of its output tokens (penalties).
A block-table list only grows (by `append`/`extend`) until the scheduler replaces it by
another list (preemption), so an array is rebuilt only for a new list and extended by
the new tail otherwise; an array is never modified once returned (a longer table is a
new array), so a packer can tell changed rows by identity. Output tokens are only ever
appended, so the output buffer takes only the new ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_MIN_ENTRIES = 16


class _Row:
    __slots__ = ("seq", "table", "array", "suffix", "distinct_prompt", "outputs",
                 "num_outputs")

    def __init__(self, seq: Any):
        self.seq = seq  # (a request id reused by a later request starts a new row)
        self.table: list[int] | None = None  # the list `array` was built from
        self.array = np.zeros(0, np.int32)
        self.suffix: tuple[np.ndarray, int, np.ndarray] | None = None
        self.distinct_prompt: np.ndarray | None = None
        self.outputs: np.ndarray | None = None
        self.num_outputs = 0


class RequestRows:
    """Per-request arrays of the requests the packer has seen lately: `retain` drops the
    requests absent from a step once there are many more entries than rows, so the
    memory follows the batch, not the requests ever served."""

    def __init__(self):
        self._rows: dict[str, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, seq: Any) -> _Row:
        row = self._rows.get(seq.request_id)
        if row is None or row.seq is not seq:
            row = self._rows[seq.request_id] = _Row(seq)
        return row

    def table(self, seq: Any) -> np.ndarray:
        """`seq.block_table` as an int32 array: the same object while the list does not
        change, extended by its new tail when it grows."""
        row, table = self._row(seq), seq.block_table
        arr = row.array
        if row.table is table:
            if len(arr) == len(table):
                return arr
            if len(arr) < len(table):
                arr = row.array = np.concatenate(
                    [arr, np.asarray(table[len(arr):], np.int32)])
                return arr
        row.table, row.suffix = table, None
        arr = row.array = np.asarray(table, np.int32).reshape(-1)
        return arr

    def suffix(self, seq: Any, start: int) -> np.ndarray:
        """`table(seq)[start:]`, the same object while neither changes."""
        full, row = self.table(seq), self._rows[seq.request_id]
        cached = row.suffix
        if cached is not None and cached[0] is full and cached[1] == start:
            return cached[2]
        suffix = full[start:]
        row.suffix = (full, start, suffix)
        return suffix

    def distinct_prompt(self, seq: Any) -> np.ndarray:
        """The distinct prompt tokens of `seq` (computed once)."""
        row = self._row(seq)
        if row.distinct_prompt is None:
            row.distinct_prompt = np.unique(np.asarray(seq.prompt_token_ids, np.int32))
        return row.distinct_prompt

    def output_tokens(self, seq: Any) -> np.ndarray:
        """`seq`'s known output tokens as int32: a view of a buffer that takes only the
        tokens appended since the last call and doubles when full. A view's tokens never
        change: later calls write past them, or into a new buffer."""
        row = self._row(seq)
        num, start = seq.num_output_tokens, seq.num_prompt_tokens
        buf, done = row.outputs, row.num_outputs
        if buf is None:
            buf, done = np.empty(max(2 * num, _MIN_ENTRIES), np.int32), 0
        elif num > len(buf):
            grown = np.empty(2 * num, np.int32)
            grown[:done] = buf[:done]
            buf = grown
        if done < num:
            buf[done:num] = seq.all_token_ids[start + done:start + num]
        row.outputs, row.num_outputs = buf, num
        return buf[:num]

    def retain(self, seqs: Any) -> None:
        """Drops the requests not in `seqs` (a step's sequences) when the entries exceed
        twice the step's rows plus a margin (amortised: not every step)."""
        rows = self._rows
        if len(rows) <= 2 * len(seqs) + 64:
            return
        self._rows = {s.request_id: rows[s.request_id] for s in seqs if s.request_id in rows}
