"""Sequence: one request's tokens, cache blocks and lifecycle (pure Python)."""

from __future__ import annotations

import enum
import sys
import time
from typing import Any


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
    """One request's scheduling state (vLLM's `Request`): its tokens, blocks, prefix
    length and status. Only `jprefix.core` sets its attributes; the engine keeps the
    request's text, stop-string and logprob state (`engine.output_processor`), the worker
    its packing caches (`worker.input_batch`), each keyed by `request_id`.

    Tokens `all_token_ids[:num_computed_tokens]` have K/V in the cache, in
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
        # a hybrid model's other KV cache groups' tables (`core.kv_groups`; [] otherwise),
        # as long as block_table, null entries where a window group freed the block
        self.group_tables: list[list[int]] = []
        self.num_registered_blocks = 0  # leading blocks of block_table that are trie nodes
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        # Async scheduling: tokens sampled by steps in flight, not yet appended (the
        # runner's packer knows which device output row holds the newest of them)
        self.num_pending = 0
        # speculative decoding: the proposals its next row verifies (`core.spec_decode`),
        # never part of all_token_ids
        self.spec_token_ids: list[int] = []
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
        self.first_token_time: float | None = None  # (host clock, set by `update`)

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
    def num_shareable_tokens(self) -> int:
        """The leading tokens whose full blocks may be shared through the prefix cache:
        every token in automatic mode (`prefix_len` None), else the first `prefix_len`.
        The one definition of the rule (scheduler, queue, policies, DP router)."""
        return len(self.all_token_ids) if self.prefix_len is None else self.prefix_len

    def num_shareable_blocks(self, block_size: int) -> int:
        """Full blocks of `num_shareable_tokens`."""
        return self.num_shareable_tokens // block_size

    def num_matchable_blocks(self, block_size: int) -> int:
        """Leading blocks the scheduler may take from the cache: the shareable full
        blocks, capped so that at least one token is computed (its logits are needed)."""
        return min(self.num_shareable_blocks(block_size),
                   (len(self.all_token_ids) - 1) // block_size)

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

    def set_finished(self, reason: str) -> None:
        """Marks the sequence finished: reason is 'stop', 'length', 'abort' or 'error'."""
        if reason not in FINISHED_STATUS:
            raise ValueError(f"finish reason {reason!r} is not one of {sorted(FINISHED_STATUS)}")
        self.status = FINISHED_STATUS[reason]
        self.finish_reason = reason

    def release_blocks(self) -> list[int]:
        """Empties the block tables; returns the blocks they held in token order, a token
        block's groups together (`BlockManager.free` releases them deepest first)."""
        blocks = (self.block_table if not self.group_tables else
                  [b for blocks in zip(self.block_table, *self.group_tables, strict=True)
                   for b in blocks])
        self.block_table, self.group_tables = [], []
        return blocks

    def reset_blocks(self) -> list[int]:
        """Forgets the sequence's cache state (preemption); returns the blocks it held."""
        blocks = self.release_blocks()
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        return blocks

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
