"""Sequence: one request's tokens, cache blocks and lifecycle (pure Python)."""

from __future__ import annotations

import enum
import sys
import time
from typing import Any

import numpy as np


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, its blocks freed (recompute)
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # can never fit in the KV cache


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "error",
}
FINISHED_STATUS = {reason: status for status, reason in _FINISH_REASONS.items()}
_UNFINISHED = tuple(s for s in SequenceStatus if s not in _FINISH_REASONS)


class Sequence:
    """One request. Tokens `all_token_ids[:num_computed_tokens]` have K/V in the cache, in
    the physical blocks `block_table` (token i lives in block_table[i // block_size]).
    `all_token_ids` (prompt + output) is the live list: read it; only `append_token` and
    the scheduler's `update` grow it (a plain attribute, not a property: the scheduler
    reads it once per row per step).

    `prefix_len` None is automatic prefix caching (every full block shareable); an int
    makes only the first `prefix_len // block_size` blocks shareable. `cache_salt`
    isolates tenants: sequences with different salts never share blocks.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        prefix_len: int | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        seed: int = 0,
        prompt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.prefix_len = prefix_len
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_registered_blocks = 0  # leading blocks of block_table that are trie nodes
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        # Async scheduling: tokens sampled by steps in flight, not yet appended (the
        # runner's packer knows which device output row holds the newest of them)
        self.num_pending = 0
        sp = sampling_params
        # `all_token_ids` never grows past this length (prompt + max_tokens) ...
        self.token_limit = (len(self.prompt_token_ids) + sp.max_tokens if sp is not None
                            else sys.maxsize)
        # ... and a token in stop_ids stops it once min_tokens are out (the sampling params'
        # stop_token_ids; the scheduler adds the model's EOS ids unless ignore_eos)
        self.stop_ids = frozenset(sp.stop_token_ids or ()) if sp is not None else frozenset()
        self.seed = seed  # sampling stream: fold_in(key(seed), num_output_tokens)
        # logprobs: top-k per output token (None: none; 0: the sampled token's own only)
        # and per prompt token; `sampling_extra`: the step's logits-processing variant runs
        self.num_logprobs: int | None = sp.logprobs if sp is not None else None
        self.num_prompt_logprobs: int | None = sp.prompt_logprobs if sp is not None else None
        self.sampling_extra = sp is not None and (
            sp.processes_logits or self.num_logprobs is not None
            or self.num_prompt_logprobs is not None)
        # per output token (token, logprob, rank, top ids, top logprobs), as the device
        # computed them; per prompt position >= 1 the same; their sum over output tokens
        self.output_logprobs: list[tuple] = []
        self.prompt_logprobs: list[tuple] = []
        self.cumulative_logprob = 0.0
        # when its latest token was sampled (host clock; `engine.stats` times TTFT/ITL)
        self.last_token_time: float | None = None
        self.prompt = prompt  # the prompt text, when it was given as text
        self.first_token_time: float | None = None
        self.stop_text: str | None = None  # output text cut before a matched stop string
        self.detokenizer: Any = None  # IncrementalDetokenizer, when stop strings are watched
        self._table_array: tuple[list[int], np.ndarray] | None = None  # block_table_array
        self._suffix_array: tuple[np.ndarray, int, np.ndarray] | None = None  # its suffix

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Known tokens plus those that steps in flight are sampling."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status not in _UNFINISHED  # (tuple identity test: no enum hashing)

    def block_table_array(self) -> np.ndarray:
        """`block_table` as an int32 array, kept between steps: a block table list only
        grows (by `append`/`extend`) until it is replaced by another list, so the array is
        rebuilt only for a new list and extended by the new tail otherwise."""
        table, cached = self.block_table, self._table_array
        if cached is not None and cached[0] is table:
            arr = cached[1]
            if len(arr) == len(table):
                return arr
            if len(arr) < len(table):
                arr = np.concatenate([arr, np.asarray(table[len(arr):], np.int32)])
                self._table_array = (table, arr)
                return arr
        arr = np.asarray(table, np.int32).reshape(-1)
        self._table_array = (table, arr)
        return arr

    def block_table_suffix(self, start: int) -> np.ndarray:
        """`block_table_array()[start:]`, the same object while neither changes (so a
        packer can tell which rows changed since the last step by identity)."""
        full, cached = self.block_table_array(), self._suffix_array
        if cached is not None and cached[0] is full and cached[1] == start:
            return cached[2]
        suffix = full[start:]
        self._suffix_array = (full, start, suffix)
        return suffix

    def set_finished(self, reason: str) -> None:
        """Marks the sequence finished: reason is 'stop', 'length', 'abort' or 'error'."""
        if reason not in FINISHED_STATUS:
            raise ValueError(f"finish reason {reason!r} is not one of {sorted(FINISHED_STATUS)}")
        self.status = FINISHED_STATUS[reason]
        self.finish_reason = reason

    def reset_blocks(self) -> list[int]:
        """Forgets the sequence's cache state (preemption); returns the blocks it held."""
        blocks, self.block_table = self.block_table, []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        return blocks

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
