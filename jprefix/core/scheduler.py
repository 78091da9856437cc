"""Scheduler: continuous batching with prefix matching, chunked prefill and preemption.

Each `schedule()` fills a token budget: running sequences first (a decode is one token;
a chunked prefill continues), then waiting ones in the policy's order. A sequence
admitted for the first time is matched against the prefix cache (whole blocks, at least
one prompt token left to compute: its logits are needed), then the host tier. Full
blocks computed this step enter the trie at schedule time, so a later row of the same
step shares them (K/V are written before attention). Out of blocks: evict unreferenced
cached blocks (LRU, leaves first), then preempt the newest running sequence (recompute).
A model windowed on every layer frees the blocks that left the window (null entries).

Scheduled tokens count as computed once scheduled (the device runs the steps in order),
a sampled token as pending until `update` appends it. So the next step can be scheduled
while this one runs (async scheduling): a pending token is read from the device output.
A speculating sequence's decode row also computes its proposals (`core.spec_decode`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from jprefix.core.block_manager import BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.policies import make_policy
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.sched_output import ScheduledSeq, SchedulerOutput, is_decode_step  # noqa: F401
from jprefix.core.sequence import Sequence, SequenceStatus
from jprefix.core.sliding_window import release_outside_window
from jprefix.core.spec_decode import Speculator, accept, truncate


class Scheduler:
    """Host-side scheduler; `schedule()` and `update()` alternate, one pair per step."""
    release_window = staticmethod(release_outside_window)  # (a hybrid model's: per group)

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 prefix_pool: PrefixPool, sliding_window: int | None = None,
                 speculator: Speculator | None = None):
        """`sliding_window`: every layer's window, if all have one (`sliding_window.py`);
        `speculator`: proposals for decode rows (`spec_decode`; None: no speculation)."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.config, self.block_manager, self.prefix_pool = config, block_manager, prefix_pool
        self.block_size = block_manager.block_size
        self.sliding_window, self.speculator = sliding_window, speculator
        self.waiting = make_policy(config.policy, prefix_pool)
        self.running: dict[str, Sequence] = {}  # in arrival order
        self._running_sorted = True

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.running or seq.request_id in self.waiting:
            raise ValueError(f"request_id {seq.request_id!r} is already scheduled")
        sp = seq.sampling_params
        if sp is not None and not sp.ignore_eos:
            seq.stop_ids |= self.config.eos_token_ids
        self.waiting.add(seq)

    def abort(self, request_id: str) -> bool:
        """Finishes a request with reason 'abort' and frees its blocks; False if unknown."""
        seq = self.running.get(request_id) or self.waiting.remove(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq is not None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (the engine calls this on a stop string) and frees its blocks."""
        self.running.pop(seq.request_id, None)
        self.waiting.remove(seq.request_id)
        self.block_manager.free(self.prefix_pool.release_finished(seq, seq.release_blocks()))
        seq.set_finished(reason)

    def has_unfinished(self) -> bool:  # (host-tier copies of aborted sequences too)
        return bool(self.running) or bool(len(self.waiting)) or self.prefix_pool.loads_pending()

    # -- schedule --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self._running_sorted:
            ordered = sorted(self.running.values(), key=lambda s: s.arrival_time)
            self.running = {s.request_id: s for s in ordered}
            self._running_sorted = True
        if self.prefix_pool.moves.landed:  # host tier: copies landed after the last step
            self.prefix_pool.finish_loads()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # no new admissions in a step that had to preempt
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Runs once per running sequence per step, so a row is committed inline, without
        # `_commit`'s calls, and made by tuple.__new__ (NamedTuple's own __new__ runs
        # Python code).
        running, block_size, new = SequenceStatus.RUNNING, self.block_size, tuple.__new__
        caching, append = self.config.enable_prefix_caching, out.scheduled.append
        window, spec = self.sliding_window, self.speculator
        for seq in list(self.running.values()):
            if budget == 0:
                break
            if seq.status is not running:  # preempted earlier this step
                continue
            start = seq.num_computed_tokens
            if window is not None and start >= window + block_size - 1:
                self.release_window(seq, start, window, self.block_manager)
            scheduled_tokens = len(seq.all_token_ids) + seq.num_pending
            remaining = scheduled_tokens - start
            if remaining == 0 or scheduled_tokens >= seq.token_limit:
                continue  # its pending token is its last, or the step before it runs
            n = remaining if remaining < budget else budget
            if spec is not None and remaining == 1:
                n += spec.propose(seq, budget - 1)  # the verify row: 1 + proposals
            end = start + n
            if end > len(seq.block_table) * block_size:  # needs blocks: may preempt
                n = self._grow_running(seq, n, out)
                if spec is not None:
                    truncate(seq, n)
                if n == 0:
                    continue
                end = start + n
            if caching and end // block_size > seq.num_registered_blocks and (
                    seq.num_shareable_blocks(block_size) > seq.num_registered_blocks):
                self._register(seq, end)
            sample = end >= scheduled_tokens
            seq.num_computed_tokens = end
            seq.num_pending += sample
            append(new(ScheduledSeq, (seq, start, n, sample)))
            budget -= n
        return budget

    def _grow_running(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """Takes the blocks for the next n tokens of seq, or for as many as fit after
        preempting later arrivals as needed; returns how many (0: none, no blocks)."""
        while (fit := self._tokens_that_fit(seq, n)) == 0:
            victim = next(reversed(self.running.values()))
            if victim is seq and len(self.running) == 1:
                if not seq.num_pending:  # (a pending token may yet finish it)
                    self._ignore(seq, out)  # alone and still out of blocks: can never fit
                return 0
            self._preempt(victim, out)
            if victim is seq:
                return 0
        self._allocate(seq, seq.num_computed_tokens + fit)
        return fit

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Sequences whose host-tier blocks copy back leave the queue for the round and return
        # to its front: they start once their copies land (in flight: within the budget).
        loading: list[Sequence] = []
        self.waiting.begin_round()
        try:
            self._admit_waiting(out, budget, loading)
        finally:
            for seq in reversed(loading):
                self.waiting.prepend(seq)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, loading: list[Sequence]
                       ) -> None:
        while budget > 0 and len(self.running) + len(loading) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None or seq.num_pending:  # preempted while its last token was in flight
                break
            if self._never_fits(seq):
                self._ignore(seq, out)
                continue
            started = not self.prefix_pool.is_loading(seq)
            n = self._admit(seq, budget) if started else -1
            if n < 0:  # its blocks come back from the host tier: it starts once they land
                loading.append(self.waiting.remove(seq.request_id))
                if started and (self.prefix_pool.loading_tokens()
                                >= self.config.max_num_batched_tokens):
                    break
                continue
            if n == 0:
                if not self.running:  # nothing can free blocks for it
                    if self.prefix_pool.release_loaded(self.waiting):  # (host tier)
                        continue
                    if not self.prefix_pool.loads_pending():
                        self._ignore(seq, out)
                        continue
                break
            self.waiting.remove(seq.request_id)
            self._add_running(seq)
            out.scheduled.append(self._commit(seq, n))
            budget -= n

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Matches the prefix cache and sizes the first chunk; 0 (no blocks held) if it
        cannot start this step; -1 (blocks held) if it waits for its host-tier copies."""
        loading = False  # host-tier blocks copy back (in-stream: before this step)
        if self.config.enable_prefix_caching and not seq.block_table:
            self._match(seq)
            pool = self.prefix_pool
            loads = pool.acquire_from_host(seq, seq.num_matchable_blocks(self.block_size))
            if loads < 0:  # past the step's load bound: it starts (and loads) next step
                self.block_manager.free(seq.reset_blocks())
                return 0
            if (loading := loads > 0) and not pool.loads_land_in_step():
                return -1
        if self.sliding_window is not None and seq.num_computed_tokens:  # (idempotent)
            self.release_window(seq, seq.num_computed_tokens, self.sliding_window,
                                self.block_manager)
        remaining = seq.num_tokens - seq.num_computed_tokens
        chunk = self._can_chunk(seq)
        n = self._tokens_that_fit(seq, min(remaining, budget) if chunk else remaining)
        if n == 0 or n > budget or (n < remaining and not chunk):
            if not loading:  # (else its copies go ahead: it starts once it fits)
                self.block_manager.free(seq.reset_blocks())
            return -1 if loading else 0
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            if self.config.enable_prefix_caching:
                self.prefix_pool.record_query(seq.num_prompt_tokens, seq.num_cached_tokens)
        return n

    def _match(self, seq: Sequence) -> None:
        max_blocks = seq.num_matchable_blocks(self.block_size)
        if seq.num_prompt_logprobs is not None and seq.num_output_tokens == 0:
            # every prompt position's logits are wanted: compute them all (a sequence
            # with an output token has had them all: the step that sampled it computed
            # the last prompt positions)
            max_blocks = 0
        seq.block_table = self.prefix_pool.acquire(seq.all_token_ids, max_blocks, seq.cache_salt)
        seq.num_registered_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def _commit(self, seq: Sequence, n: int) -> ScheduledSeq:
        """Allocates blocks for n more tokens, registers the blocks they fill (of known
        tokens), and counts the n tokens computed and a sampled one pending."""
        start = seq.num_computed_tokens
        end = start + n
        self._allocate(seq, end)
        if self.config.enable_prefix_caching:
            self._register(seq, end)
        sample = end == seq.num_scheduled_tokens
        seq.num_computed_tokens = end
        seq.num_pending += sample
        return ScheduledSeq(seq, start, n, sample)

    def _allocate(self, seq: Sequence, end: int) -> None:
        """Extends seq's block table to hold its first `end` tokens (they fit)."""
        table = seq.block_table
        if end > len(table) * self.block_size:
            table.extend(self.block_manager.allocate(self.block_manager.blocks_for(end)
                                                     - len(table)))

    def _register(self, seq: Sequence, end: int) -> None:
        """Inserts into the trie the shareable blocks of seq that its first `end` tokens
        fill (computed by now, or in this step) and whose tokens are known."""
        shareable = seq.num_shareable_blocks(self.block_size)
        if min(end // self.block_size, shareable) > seq.num_registered_blocks:
            self.prefix_pool.register_blocks(seq, end, shareable)

    def _tokens_that_fit(self, seq: Sequence, n: int) -> int:
        capacity = (len(seq.block_table) + self.block_manager.num_free_blocks) * self.block_size
        return max(0, min(n, capacity - seq.num_computed_tokens))

    def _can_chunk(self, seq: Sequence) -> bool:
        # A preempted sequence recomputes prompt + output, which may exceed the budget.
        return self.config.enable_chunked_prefill or seq.num_preemptions > 0

    def _never_fits(self, seq: Sequence) -> bool:
        bm = self.block_manager
        return bm.blocks_for(seq.num_tokens) > bm.num_blocks - 1 or (
            not self._can_chunk(seq) and seq.num_tokens > self.config.max_num_batched_tokens)

    def _add_running(self, seq: Sequence) -> None:
        if self.running:
            last = next(reversed(self.running.values()))
            self._running_sorted &= last.arrival_time <= seq.arrival_time
        seq.status = SequenceStatus.RUNNING
        self.running[seq.request_id] = seq

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        del self.running[seq.request_id]
        self.block_manager.free(self.prefix_pool.release_finished(seq, seq.reset_blocks()))
        seq.status, seq.num_preemptions = SequenceStatus.PREEMPTED, seq.num_preemptions + 1
        self.waiting.prepend(seq)
        out.preempted.append(seq)

    def _ignore(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.finish(seq, "error")
        out.ignored.append(seq)

    # -- update ----------------------------------------------------------------------

    def update(self, output: SchedulerOutput, tokens: Seq[int]) -> list[Sequence]:
        """Applies a step's sampled tokens, `tokens[i]` the one of row i of
        `output.scheduled` (rows that do not `sample` are skipped); stamps each
        sequence's first token time; returns the sequences they finished (not
        `output.ignored`, which were finished at schedule time)."""
        finished, running, now = [], SequenceStatus.RUNNING, time.monotonic()
        for (seq, _, _, sample), token in zip(output.scheduled, tokens, strict=True):
            if not sample:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            # skips a sequence aborted or stopped since the schedule (a running one is not
            # finished: the common row makes no call)
            if seq.status is not running and seq.is_finished():
                continue
            seq.num_pending -= 1
            ids = seq.all_token_ids
            if token.__class__ is list:  # a verify row's emitted tokens (`spec_decode`)
                if (reason := accept(seq, token, self.block_manager)) is None:
                    continue
                self.finish(seq, reason)
                finished.append(seq)
                continue
            ids.append(token)
            # stop_ids: its stop_token_ids and (unless ignore_eos) the EOS ids, from `add`
            if token in seq.stop_ids and seq.num_output_tokens >= seq.sampling_params.min_tokens:
                reason = "stop"
            elif len(ids) >= seq.token_limit:  # max_tokens reached
                reason = "length"
            else:
                continue
            self.finish(seq, reason)
            finished.append(seq)
        return finished
