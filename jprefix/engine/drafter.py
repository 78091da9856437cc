"""Speculative decoding with a draft model (`method: "draft_model"`), the engine's side:
which tokens each speculating row feeds the draft, and the draft's proposals written
into the rows the scheduler reserved (`core.spec_decode`).

The draft's KV cache is addressed by the target's block ids (`worker.draft_runner`), so
its K/V of a token is valid only where the draft was fed that token at that position in
that block. Two records say where:

- per request, `valid`: its leading tokens whose draft K/V are in its blocks. A call
  feeds the tokens from `valid` up to the newest (the whole uncached prompt on a
  request's first call, after a preemption, or after steps that did not speculate), and
  writes the proposals' K/V after them; the next call keeps of those the positions whose
  accepted tokens equal the proposals fed there (all but the last proposal were fed);
- per block, the prefix-trie node the block was registered as when a request's `valid`
  covered all of it. A block's tokens (and so both caches' K/V of it) stay fixed while
  it is that trie node; evicted and reused, it becomes a different node (or none). A
  request's first call starts after its leading blocks whose node is still the recorded
  one: a shared prefix computed once by the draft is reused by every request hitting it,
  and blocks the draft never saw (computed by non-speculating rows, brought back from
  the host tier or a saved cache) are fed to the draft before it proposes.

Feeding a shared block again (a request whose record ends before it) rewrites the same
K/V, so sharing needs no ordering between requests.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from typing import Any

from jprefix.core.prefix_trie import PrefixNode, PrefixTrie
from jprefix.core.sched_output import ScheduledSeq
from jprefix.core.sequence import Sequence
from jprefix.core.spec_config import SpeculativeConfig
from jprefix.core.spec_decode import set_proposals
from jprefix.engine.args import resolve_dtype
from jprefix.worker.draft_runner import DraftRow, DraftRunner
from jprefix.worker.pack import BucketConfig
from models.loader import LoadedModel, load


class _Fed:
    """What the last call fed a request: `n` its tokens then (the newest last), the
    proposals `drafts` written after them, its preemption count then, and how many of
    its leading blocks had their trie nodes recorded."""

    __slots__ = ("n", "drafts", "num_preemptions", "recorded")

    def __init__(self, n: int, drafts: list[int], num_preemptions: int, recorded: int):
        self.n, self.drafts, self.num_preemptions = n, drafts, num_preemptions
        self.recorded = recorded

    def valid(self, token_ids: list[int]) -> int:
        """Leading positions of `token_ids` (grown since) whose draft K/V are valid."""
        j, n = 0, self.n
        last = min(len(self.drafts) - 1, len(token_ids) - 1 - n)  # (the newest is unfed)
        while j < last and token_ids[n + j] == self.drafts[j]:
            j += 1
        return n + j


class Drafter:
    """Fills each step's reserved proposal slots with the draft model's proposals."""

    def __init__(self, runner: DraftRunner, trie: PrefixTrie):
        self.runner, self.trie = runner, trie
        self.block_size = runner.block_size
        self._fed: weakref.WeakKeyDictionary[Sequence, _Fed] = weakref.WeakKeyDictionary()
        self._nodes: dict[int, PrefixNode] = {}  # block -> its trie node when draft-fed
        self.num_fed_tokens = 0  # tokens fed to the draft before its proposals, all calls

    def fill(self, scheduled: Seq[ScheduledSeq]) -> None:
        """Proposes for every row with reserved slots (one draft call per proposal
        count: rows near max_tokens or the token budget reserve fewer)."""
        groups: dict[int, list[Sequence]] = {}
        for sc in scheduled:
            if sc.seq.spec_token_ids:
                groups.setdefault(len(sc.seq.spec_token_ids), []).append(sc.seq)
        for d, seqs in groups.items():
            fed = [self._feed(seq) for seq in seqs]
            proposals = self.runner.propose([row for row, _ in fed], d).tolist()
            for seq, (_, recorded), tokens in zip(seqs, fed, proposals, strict=True):
                set_proposals(seq, tokens)
                self._fed[seq] = _Fed(seq.num_tokens, tokens, seq.num_preemptions, recorded)

    def _feed(self, seq: Sequence) -> tuple[DraftRow, int]:
        """seq's draft row (the tokens from its first without valid draft K/V), and how
        many of its leading blocks have their trie nodes recorded now."""
        ids = seq.all_token_ids
        fed = self._fed.get(seq)
        if fed is None or fed.num_preemptions != seq.num_preemptions:
            valid, recorded = self._cached(seq), 0
        else:
            valid, recorded = fed.valid(ids), fed.recorded
        recorded = self._record(seq, valid, recorded)
        self.num_fed_tokens += len(ids) - valid
        return DraftRow(ids[valid:], valid, seq.block_table), recorded

    def _cached(self, seq: Sequence) -> int:
        """Tokens of seq's leading blocks that hold the draft's K/V (recorded nodes that
        are still those blocks' nodes), at most all but its newest token."""
        node_of, nodes, n = self.trie.node_of, self._nodes, 0
        for block in seq.block_table[: (seq.num_tokens - 1) // self.block_size]:
            node = nodes.get(block)
            if node is None or node_of(block) is not node:
                break
            n += 1
        return n * self.block_size

    def _record(self, seq: Sequence, valid: int, start: int) -> int:
        """Records the trie nodes of seq's full blocks from `start` up to `valid` (fed
        to the draft); returns up to where they are recorded (registration, and so
        recording, stops at the first block not in the trie)."""
        node_of, nodes, table = self.trie.node_of, self._nodes, seq.block_table
        end = valid // self.block_size
        while start < end and (node := node_of(table[start])) is not None:
            nodes[table[start]] = node
            start += 1
        return start


def load_draft(args: Any, target: LoadedModel, buckets: BucketConfig, device: Any = None
               ) -> DraftRunner | None:
    """The draft model's runner (weights placed, no cache yet: `allocate_cache` once the
    target's pool is sized) for a "draft_model" `args.speculative_config`, else None.
    Refuses, naming them, the setups the draft does not support: it runs in its own
    float dtype, beside a target whose blocks hold every token."""
    spec: SpeculativeConfig | None = args.speculative_config
    if spec is None or spec.method != "draft_model":
        return None  # (EngineArgs refuses a draft under tensor or data parallelism)
    if target.config.uniform_sliding_window is not None:
        raise ValueError(f"speculative_config draft_model with the sliding-window target "
                         f"{target.name!r} is not supported (its blocks leave the window)")
    draft = load(spec.model, resolve_dtype(args.dtype, spec.model), args.load_format)
    if draft.config.checkpoint_quantization:
        raise ValueError(f"speculative_config draft model {spec.model!r} is an "
                         f"{draft.config.checkpoint_quantization} checkpoint: an fp8 draft "
                         "is not supported (use its float checkpoint)")
    return DraftRunner(draft, target, None, args.block_size, backend=args.attention_backend,
                       buckets=buckets, unroll_layers=args.unroll_layers, device=device,
                       donate_params=True)
