"""Incremental detokenization: text deltas of a growing token list, in time proportional
to the new tokens (re-decoding the whole output every step is quadratic in its length)."""

from __future__ import annotations

from typing import Any

_LOOKBACK = 6  # tokens decoded again before the new ones, so merges at the seam are seen
_RESYNC = 16  # tokens held back before decoding everything once to catch up


class IncrementalDetokenizer:
    """Feeds token ids in, returns the text they add.

    Each `push` decodes a short window: a few already-emitted tokens (whose text is
    subtracted again) and the new ones. Decoding from the same window start on both
    sides cancels tokenizer effects at a window's start (SentencePiece drops a leading
    space there), and a byte-level token that ends inside a multi-byte character is held
    back ("\\ufffd") until the rest arrives. The deltas concatenate to `decode(all ids)`.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # the text emitted so far
        self._start = 0  # window start: ids[_start:_read] decode to _window_text
        self._read = 0  # ids before this are emitted
        self._window_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        """Appends `ids`; returns the text they complete ("" while a character is partial)."""
        self.ids += ids
        if self.tokenizer is None:
            return ""
        window = self._decode(self.ids[self._start :])
        if window.endswith("\ufffd") or not window.startswith(self._window_text):
            if len(self.ids) - self._read < _RESYNC:
                return ""  # a partial character (or a seam still settling): wait for more
            full = self._decode(self.ids)  # held back long: catch up from the start once
            if full.endswith("\ufffd") or not full.startswith(self.text):
                return ""  # still partial, or emitted text rewritten: the final text has all
            window, self._start, self._window_text = full, 0, self.text
        delta = window[len(self._window_text) :]
        self.text += delta
        self._read = len(self.ids)
        self._start = max(self._start, self._read - _LOOKBACK)
        self._window_text = self._decode(self.ids[self._start : self._read])
        return delta
