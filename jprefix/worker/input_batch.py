"""StepPacker: the one place a scheduled step becomes the device's input arrays.

The packer orders the step's rows for the device, packs them (`jprefix.worker.pack`, or
`jprefix.worker.repack` for a steady decode batch), flattens the arrays into one buffer
(`jprefix.worker.flat_batch`), and remembers what the next step needs: the reusable
tables and constants, the last decode step's buffers, and where each sampled token sits
in this step's device output (a sequence's newest token may still be on the device when
the next step is packed: async scheduling). Imports run one way:
input_batch -> repack -> pack -> flat_batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from jprefix.core.cascade import CascadePlan
from jprefix.core.kv_groups import KVCacheGroups
from jprefix.core.scheduler import ScheduledSeq, is_decode_step
from jprefix.worker.flat_batch import PackedStep, pack_flat
from jprefix.worker.hybrid_kv import pack_group_tables
from jprefix.worker.pack import BucketConfig, PackCache, pack_cascade, pack_step
from jprefix.worker.pack_sampling import pack_sampling
from jprefix.worker.repack import DecodeStep, remember_decode, repack_decode
from jprefix.worker.request_rows import RequestRows
from jprefix.worker.spec_verify import pack_spec


class StepKind(NamedTuple):
    """What the jitted step compiles for: `decode` (every row computes one token: the
    decode tiling), `cascade` (the batch carries a cascade plan's arrays), and
    `num_decode` (> 0 in a mixed step: its one-token rows come first and run with the
    decode tiling, `mixed_paged_attention`), `extra` (some row processes its logits or
    wants logprobs: the batch carries `pack_sampling`'s arrays), `greedy` (every row's
    temperature is 0: the step skips the sampling machinery). The packer is the one
    place a step's kind is decided."""

    decode: bool
    cascade: bool
    num_decode: int
    extra: bool = False
    greedy: bool = False


class PackedRows(NamedTuple):
    """A packed step: its rows in device order, the packed buffers, the device order as
    indices into the scheduled list (None when unchanged), the step's kind, and (an extra
    step) the (sequence, prompt position) of each prompt-logprobs entry."""

    rows: list[ScheduledSeq]
    packed: PackedStep
    order: list[int] | None
    kind: StepKind
    prompt_positions: list[tuple[Any, int]] = []


class StepPacker:
    """Packs the steps of one runner, in dispatch order.

    `reuse=False` packs every step afresh (no state carried between steps besides the
    pending rows); the packed buffers are the same either way. `kv_groups`: a hybrid KV
    cache's (`worker.hybrid_kv`): every step also carries the other groups' tables, and
    is packed afresh (window groups replace their tables as they free)."""

    def __init__(self, block_size: int, buckets: BucketConfig, reuse: bool = True,
                 num_speculative_tokens: int = 0, kv_groups: KVCacheGroups | None = None):
        self.block_size, self.buckets = block_size, buckets
        self.spec_k = num_speculative_tokens  # a verify step's K (`spec_verify`)
        self.num_groups = 1 if kv_groups is None else kv_groups.num_groups
        self.cache = PackCache() if reuse else None
        self.decode: DecodeStep | None = None  # the last step, if a reusable decode step
        self.penalty_entries = 0  # the most penalty entries an extra step has sent
        # sequence -> its sampled token's row in the last packed step's device output
        self.pending_rows: dict[Any, int] = {}

    def pack(self, scheduled: Seq[ScheduledSeq], plan: CascadePlan | None = None
             ) -> PackedRows:
        """Packs one step. A cascade plan puts its groups first; a step that mixes
        one-token rows with longer ones puts the one-token rows first. A pending token
        reads the previous packed step's output row; afterwards each sampling row of
        this step becomes the pending row of its sequence."""
        order = plan.order if plan is not None else None
        rows = list(scheduled) if order is None else list(map(scheduled.__getitem__, order))
        extra = any(map(_SAMPLING_EXTRA, map(_SEQ, rows)))
        spec = self.spec_k > 0 and any(sc.seq.spec_token_ids for sc in rows)
        packed = None if extra or spec or self.num_groups > 1 else self._repack(rows, plan)
        num_decode, positions = 0, []
        if packed is None:
            if plan is None:
                rows, order, num_decode = _decode_rows_first(rows)
            packed, positions = self._pack(rows, plan, num_decode, extra, spec)
        seqs, _, num_new, samples = zip(*rows, strict=True) if rows else ((),) * 4
        if all(samples):  # (C-level when every row samples, as in decode steps)
            self.pending_rows = dict(zip(seqs, range(len(seqs)), strict=True))
        else:
            self.pending_rows = {sc.seq: i for i, sc in enumerate(rows) if sc.sample}
        decode = is_decode_step(num_new)
        greedy = not packed.arrays["temperature"].any()
        return PackedRows(rows, packed, order,
                          StepKind(decode, plan is not None, num_decode, extra, greedy),
                          positions)

    def _repack(self, rows: list[ScheduledSeq], plan: CascadePlan | None) -> PackedStep | None:
        """A steady decode step's buffers advanced from the last step's, or None."""
        if self.cache is None:
            return None
        packed = repack_decode(rows, plan, self.block_size, self.buckets.min_blocks,
                               self.cache, self.decode, self.pending_rows)
        if packed is None:
            self.decode = None  # (kept again by `_pack` if this step decodes)
        return packed

    def _pack(self, rows: list[ScheduledSeq], plan: CascadePlan | None, num_decode: int,
              extra: bool = False, spec: bool = False
              ) -> tuple[PackedStep, list[tuple[Any, int]]]:
        cache = self.cache
        batch = pack_step(rows, self.block_size, self.buckets, cache, self.pending_rows)
        if spec:  # a verify step (never repacked: its `spec_idx` changes every step)
            batch |= pack_spec(rows, len(batch["kv_lens"]), batch["cu_q_lens"],
                               batch["counters"], self.spec_k)
        positions: list[tuple[Any, int]] = []
        if self.num_groups > 1:
            batch |= pack_group_tables(rows, batch, self.block_size, self.num_groups)
        if extra:
            arrays, positions = pack_sampling(
                rows, len(batch["kv_lens"]), batch["cu_q_lens"],
                cache.rows if cache is not None else RequestRows(), self.penalty_entries)
            self.penalty_entries = len(arrays["pen_ids"])  # (never shrinks: no recompile)
            batch |= arrays
        if plan is not None:
            batch |= pack_cascade(rows, plan, self.block_size, len(batch["kv_lens"]),
                                  self.buckets.min_blocks, cache)
        if num_decode:
            batch["num_decode"] = np.array([num_decode], np.int32)
        packed = pack_flat(batch)
        if cache is not None:  # (an extra step's arrays change every step: never repacked)
            self.decode = (None if extra or spec
                           else remember_decode(cache, rows, plan, packed))
            cache.rows.retain([sc.seq for sc in rows])
        return packed, positions


_SEQ = attrgetter("seq")
_SAMPLING_EXTRA = attrgetter("sampling_extra")


def _decode_rows_first(rows: list[ScheduledSeq]
                       ) -> tuple[list[ScheduledSeq], list[int] | None, int]:
    """A mixed step's rows with its one-token rows first, that order (None if unchanged)
    and their count (0 unless the step mixes one-token rows with longer ones)."""
    ones = [i for i, sc in enumerate(rows) if sc.num_new_tokens == 1]
    if not ones or len(ones) == len(rows):
        return rows, None, 0
    taken = set(ones)
    order = ones + [i for i in range(len(rows)) if i not in taken]
    return [rows[i] for i in order], order, len(ones)
