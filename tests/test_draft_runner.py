"""The draft model's proposer: its proposals are the draft's own dense greedy continuation,
over consecutive calls, rows of different lengths and rows sharing the target's prefix
blocks (their draft K/V written once, by the row that computed them)."""

import dataclasses

import numpy as np
import pytest

import jprefix
from jprefix.worker.draft_runner import DraftRow, DraftRunner, target_memory_fraction
from jprefix.worker.kv_cache import kv_block_bytes
from models.reference import dense_generate

B = 4  # block size: prefixes of whole blocks are shared


@pytest.fixture(scope="module")
def target():
    """The target: another tiny Llama with the draft's vocabulary (tiny-llama's)."""
    return jprefix.load("tiny-smollm2", dtype="float32", load_format="dummy")


@pytest.fixture(scope="module")
def runner(sharp_tiny, target):
    return DraftRunner(sharp_tiny, target, num_blocks=48, block_size=B)


def _dense(draft, context, k):
    return dense_generate(draft.params, draft.config, list(context), k, eos_token_ids=())


class _Row:
    """A request's context and its block table (ids of the target's pool), and what the
    draft has not been fed yet."""

    def __init__(self, context, table, cached=0):
        self.context, self.table, self.fed = list(context), table, cached

    def draft_row(self):
        return DraftRow(self.context[self.fed :], self.fed, self.table)

    def accept(self, proposals, num_accepted, target_token):
        """The verify step's outcome: the accepted drafts, then the target's token."""
        self.fed = len(self.context)
        self.context += [*proposals[:num_accepted], target_token]


def _check(runner, draft, rows, k):
    proposals = runner.propose([r.draft_row() for r in rows], k)
    assert proposals.shape == (len(rows), k) and proposals.dtype == np.int32
    for row, got in zip(rows, proposals, strict=True):
        assert list(got) == _dense(draft, row.context, k), row.context
    return proposals


def test_proposals_are_the_drafts_greedy_continuation_across_calls(runner, sharp_tiny):
    rng = np.random.default_rng(0)
    prompt = lambda n: list(rng.integers(1, 256, n))  # noqa: E731
    a = _Row(prompt(11), [1, 2, 3, 4, 5])
    b = _Row(prompt(5), [6, 7, 8])
    c = _Row(prompt(1), [9, 10, 17])
    # shares a's first full block, fed in the same step (written, then attended)
    e = _Row(a.context[:4] + prompt(6), [1, 11, 12, 13], cached=4)
    rows = [a, b, c, e]
    proposals = _check(runner, sharp_tiny, rows, 3)
    for row, p, accepted in zip(rows, proposals, [2, 0, 3, 1], strict=True):
        row.accept(p, accepted, int(rng.integers(1, 256)))
    # d shares a's first two blocks, written by the first call: fed only its suffix
    d = _Row(a.context[:8] + prompt(3), [1, 2, 14, 15, 16], cached=8)
    rows = [a, b, c, e, d]
    proposals = _check(runner, sharp_tiny, rows, 4)
    # a call where every row brings one token (the one-token step's shapes, compiled)
    for row, p in zip(rows, proposals, strict=True):
        row.accept(p, 0, int(p[0]))
    seen = set(runner.shapes_seen)
    _check(runner, sharp_tiny, rows, 4)
    assert runner.shapes_seen == seen  # no new compilation


def test_a_draft_of_another_vocabulary_is_refused(sharp_tiny):
    other = jprefix.load("tiny-baichuan2-rope", dtype="float32", load_format="dummy")
    with pytest.raises(ValueError, match="tiny-llama.*tiny-baichuan2-rope"):
        DraftRunner(sharp_tiny, other, num_blocks=8, block_size=B)


def test_a_draft_with_another_tokenizer_is_refused(sharp_tiny, target):
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    mine = dataclasses.replace(sharp_tiny, tokenizer=Tok({"a": 0, "b": 1}))
    theirs = dataclasses.replace(target, tokenizer=Tok({"a": 1, "b": 0}))
    with pytest.raises(ValueError, match="tiny-llama.*tiny-smollm2.*different tokenizers"):
        DraftRunner(mine, theirs, num_blocks=8, block_size=B)


def test_a_block_table_short_of_the_lookahead_is_refused(runner):
    with pytest.raises(ValueError, match="does not cover position 8"):
        runner.propose([DraftRow([5, 6, 7], 4, [1, 2])], 3)
    with pytest.raises(ValueError, match="outside the pool of 48"):
        runner.propose([DraftRow([5, 6, 7], 0, [1, 48])], 2)


def test_the_pool_split_leaves_room_for_the_draft_cache(sharp_tiny, target):
    t = kv_block_bytes(target.config, 16, np.float32)
    d = kv_block_bytes(sharp_tiny.config, 16, np.float32)
    share = target_memory_fraction(0.9, t, d)
    free = 10_000 * (t + d)  # blocks sized as ModelRunner sizes them, then the draft's
    blocks = int(free * share) // t
    assert blocks * (t + d) <= 0.9 * free < (blocks + 2) * (t + d)


def test_the_gpu_path_proposes_the_same(sharp_tiny):
    """The Pallas kernels (interpreted) over fused per-layer weights, as on a GPU; the
    second row reads the first's block written in the same step."""
    runner = DraftRunner(sharp_tiny, sharp_tiny, num_blocks=16, block_size=B,
                         backend="pallas-interpret", unroll_layers=True)
    first = [3, 5, 7, 9, 11, 13]
    rows = [_Row(first, [1, 2, 3]), _Row(first[:4] + [3, 5, 7, 9, 2], [1, 4, 5], cached=4)]
    _check(runner, sharp_tiny, rows, 2)


def test_load_by_name_with_dummy_weights(target):
    runner = DraftRunner.load("tiny-llama", target, num_blocks=None, block_size=B,
                              dtype="float32", load_format="dummy")
    with pytest.raises(RuntimeError, match="allocate_cache"):
        runner.propose([DraftRow([1], 0, [1])], 1)
    runner.allocate_cache(8)  # (once the target's pool is sized)
    assert runner.name == "tiny-llama" and runner.kv_cache[0].shape == (2, 2, 8, B, 16)
    assert runner.block_bytes == kv_block_bytes(runner.cfg, B, np.float32)
