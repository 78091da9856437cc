"""Speculative decoding, the scheduler's side (pure Python): which running sequences
propose, how many tokens their verify row computes, and the rollback after verification.

A speculating sequence's row computes 1 + d tokens: its newest token (known on the host:
a step with proposals is scheduled after the previous step's tokens arrived) and its d
proposals (`seq.spec_token_ids`, never in `all_token_ids`). The row's logits at all
1 + d positions come back; `accept` appends the tokens the verification emitted (the
accepted proposals, then the target's own token) in order, stopping at the first stop
token or at max_tokens, and rolls back the rest: `num_computed_tokens` returns to the
accepted length and the blocks past what the known tokens need are freed.

Cache exactness: only blocks full of known (accepted) tokens ever enter the prefix trie,
because `PrefixPool.register_blocks` registers at most `num_shareable_blocks` and a
proposal is never in `all_token_ids`; a block holding a rejected proposal's K/V is past
the accepted tokens, so it is either freed here or rewritten at the same position by
the next step before its block fills and is registered.

Which requests speculate (`speculates`): all but those with structured output or stop
strings. The
verify step gives every position the distribution a normal step would sample from
(logit bias, penalties counting the proposals before the position, min-p, temperature,
top-k, top-p; `worker.spec_verify`); greedy rows accept by argmax, sampled ones by
rejection sampling (`worker.rejection_sampler`), and the logprobs of the emitted
tokens are the target's at their positions. Prompt logprobs are computed by prefill
rows, never by a verify row. A grammar's bitmask at a position depends on the
proposals before it (the matcher would have to advance through them and roll back),
and a stop string is matched on the text after each token (a verify row appends
several at once, so tokens after the one completing it would stay in the output): such
a request runs non-speculatively, exactly as without speculation, in the same batches.

Proposers: "ngram" fills `spec_token_ids` here; "draft_model" runs on the device, so
the scheduler only reserves the row's d slots (`spec_token_ids` of d placeholder ids,
`DRAFT_PLACEHOLDER`), and the engine's drafter (`engine.drafter`) overwrites them with
the draft's proposals once the step's blocks are allocated, before the step is packed.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from jprefix.core.ngram_proposer import NgramProposer
from jprefix.core.sequence import Sequence, SequenceStatus
from jprefix.core.spec_config import SpeculativeConfig

PROBE_HOLD = 8  # probes without a proposal before steps overlap again (`probe`)
DRAFT_PLACEHOLDER = 0  # a reserved draft-model slot's id until the engine's drafter fills it


def speculates(seq: Sequence) -> bool:
    """Whether seq's decode steps may carry proposals (see the module docstring)."""
    sp = seq.sampling_params
    return sp is not None and sp.structured_outputs is None and not sp.stop


def pins_sync(seq: Sequence) -> bool:
    """Whether seq keeps the engine's steps synchronous while it is live (async
    scheduling): a seeded sampled request's draws depend on where its proposals fall, so
    they must fall where its own tokens alone decide (every decode row, as without async
    scheduling), never where another request's proposals made a step wait."""
    sp = seq.sampling_params
    return speculates(seq) and sp.seed is not None and sp.temperature > 0


class Speculator:
    """Makes a running sequence's proposals for its next row (the scheduler's hook)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)  # (None: the draft model's)
        # each sequence's tokens as int64, extended by the tokens appended since its last
        # row: the n-gram search reads them every step, and converting the whole list
        # again would cost O(context) per row per step
        self._arrays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # each sequence's last n-gram lookup (its token count, the up to k tokens found),
        # so a `probe` and the `propose` that follows it on the same tokens search once
        self._lookups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._hold = 0  # probes left before steps overlap again (`probe`)

    def _token_array(self, seq: Sequence) -> np.ndarray:
        ids = seq.all_token_ids
        buf, n = self._arrays.get(seq, (None, 0))
        if n > len(ids):  # (tokens only grow; anything else starts over)
            n = 0
        if buf is None or len(buf) < len(ids):
            grown = np.empty(max(2 * len(ids), 64), np.int64)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        buf[n:len(ids)] = ids[n:]
        self._arrays[seq] = (buf, len(ids))
        return buf[:len(ids)]

    def propose(self, seq: Sequence, budget: int) -> int:
        """Sets seq's proposals for a decode row with `budget` tokens to spare; returns
        their count d (the row computes 1 + d tokens). At most k, the budget, and one
        fewer than the tokens max_tokens leaves (the verification emits d + 1)."""
        k = min(self.k, budget, seq.token_limit - len(seq.all_token_ids) - 1)
        if k <= 0 or seq.num_pending or not speculates(seq):
            seq.spec_token_ids = []
            return 0
        seq.spec_token_ids = (self._lookup(seq)[:k] if self.proposer is not None
                              else [DRAFT_PLACEHOLDER] * k)
        return len(seq.spec_token_ids)

    def _lookup(self, seq: Sequence) -> list[int]:
        """The n-gram proposer's up to k tokens for seq's known tokens (pending ignored)."""
        n = len(seq.all_token_ids)
        last = self._lookups.get(seq)
        if last is None or last[0] != n:
            last = self._lookups[seq] = (n, self.proposer.propose(self._token_array(seq),
                                                                   self.k))
        return last[1]

    def probe(self, seqs: Any) -> bool:
        """Whether the next step should wait for the one in flight (async scheduling) so
        that proposals can be made: some of seqs (sequences just given their step's
        tokens) would propose from the tokens known now, or did within the last
        `PROBE_HOLD` probes (a lookup that misses once often matches again a token
        later, and an overlapped step proposes nothing). A draft model always proposes."""
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING and speculates(seq) and (
                    self.proposer is None or self._lookup(seq)):
                self._hold = PROBE_HOLD
                return True
        self._hold = max(0, self._hold - 1)
        return self._hold > 0


def set_proposals(seq: Sequence, tokens: list[int]) -> None:
    """The draft model's proposals for the d slots `propose` reserved (the drafter's)."""
    if len(tokens) != len(seq.spec_token_ids):
        raise ValueError(f"{len(tokens)} proposals for {seq.request_id!r}, which reserved "
                         f"{len(seq.spec_token_ids)}")
    seq.spec_token_ids = list(tokens)


def truncate(seq: Sequence, n: int) -> None:
    """The row got blocks for n tokens only: keep n - 1 proposals."""
    del seq.spec_token_ids[max(0, n - 1):]


def accept(seq: Sequence, emitted: list[int], block_manager: Any) -> str | None:
    """Appends a verify row's emitted tokens (its accepted proposals, then the target's
    token) up to the first that finishes seq; rolls back the rejected positions. Returns
    the finish reason ('stop', 'length') or None."""
    ids, reason = seq.all_token_ids, None
    for token in emitted:
        ids.append(token)
        if token in seq.stop_ids and seq.num_output_tokens >= seq.sampling_params.min_tokens:
            reason = "stop"
        elif len(ids) >= seq.token_limit:
            reason = "length"
        else:
            continue
        break
    seq.spec_token_ids = []
    if reason is None:  # (a finished sequence frees every block)
        seq.num_computed_tokens = len(ids) - 1  # the newest token is the next row's input
        keep = block_manager.blocks_for(len(ids))
        if len(seq.block_table) > keep:  # a new list: the packer keys tables by identity
            block_manager.free(seq.block_table[keep:])
            seq.block_table = seq.block_table[:keep]
    return reason
