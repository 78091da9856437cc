"""Cascade decode in the engine: grouping on the host, and greedy tokens identical with
cascade on and off (multi-level prefixes, sequences joining and leaving groups)."""

from types import SimpleNamespace

import numpy as np
import pytest

import jprefix
from jprefix import LLM, SamplingParams
from jprefix.core.cascade import plan_cascade, shared_blocks
from jprefix.worker.pack import pack_cascade
from models.reference import dense_generate

BS = 8


def _decode(blocks, kv_len, registered=None):
    """A decode row; its blocks are prefix-trie blocks (`registered`: all by default)."""
    seq = SimpleNamespace(block_table=blocks, request_id=f"r{blocks}",
                          num_registered_blocks=len(blocks) if registered is None else registered)
    return SimpleNamespace(seq=seq, start=kv_len - 1, num_new_tokens=1)


def test_shared_blocks_is_the_leading_run_of_shared_refs():
    refs = {1: 3, 2: 3, 3: 2, 4: 1, 5: 1}
    assert shared_blocks([1, 2, 3, 4, 5], 5, refs.get) == 3
    assert shared_blocks([1, 2, 3, 4, 5], 2, refs.get) == 2  # capped before the query
    assert shared_blocks([4, 5], 2, refs.get) == 0


def test_plan_groups_by_shared_prefix_and_orders_groups_first():
    refs = {b: 1 for b in range(100)} | {1: 3, 2: 3, 3: 2, 7: 2}
    scheduled = [
        _decode([9, 10], 12),  # alone
        _decode([1, 2, 3, 20], 30),  # group A (3 blocks)
        _decode([1, 2, 21], 20),  # shares 2 blocks, different last block -> own key
        _decode([1, 2, 3, 22], 26),  # group A
        _decode([7, 23], 9),  # block 7 shared, but a group of one
    ]
    plan = plan_cascade(scheduled, BS, refs.get, min_group=2, min_blocks=1)
    assert plan.group_sizes == [2]
    assert plan.order[:2] == [1, 3] and sorted(plan.order) == list(range(5))
    assert plan.prefix_blocks == [3, 3, 0, 0, 0]
    ordered = [scheduled[i] for i in plan.order]
    arrays = pack_cascade(ordered, plan, BS, 8, 4)
    assert arrays["prefix_block_tables"][0, :3].tolist() == [1, 2, 3]
    assert arrays["prefix_kv_lens"][0] == 24
    assert arrays["prefix_cu_q_lens"][:2].tolist() == [0, 2]
    assert arrays["suffix_block_tables"][0, :1].tolist() == [20]
    assert arrays["suffix_kv_lens"][:5].tolist() == [30 - 24, 26 - 24, 12, 20, 9]
    assert plan_cascade(scheduled, BS, refs.get, min_group=3, min_blocks=1) is None
    # a shared block counts only up to the sequence's registered (trie) blocks
    capped = [_decode([1, 2, 3, 20], 30, registered=2), _decode([1, 2, 3, 22], 26)]
    assert plan_cascade(capped, BS, refs.get, min_group=1, min_blocks=1).prefix_blocks == [2, 3]
    prefill = [SimpleNamespace(seq=SimpleNamespace(block_table=[1]), start=0, num_new_tokens=5)]
    assert plan_cascade(prefill, BS, refs.get, min_group=1, min_blocks=0) is None


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")


@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_greedy_tokens_identical_with_cascade_on_and_off(tiny, backend):
    rng = np.random.default_rng(0)
    V = tiny.config.vocab_size
    policy = rng.integers(3, V, 24).tolist()
    depts = [policy + rng.integers(3, V, 16).tolist() for _ in range(2)]
    prompts = [d + rng.integers(3, V, int(n)).tolist()
               for d in depts for n in rng.integers(1, 12, 3)]
    prompts += [policy + rng.integers(3, V, 5).tolist(), rng.integers(3, V, 30).tolist()]
    # different lengths: sequences leave their groups at different steps
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True)
              for n in rng.integers(3, 9, len(prompts))]
    results = {}
    for cascade in (False, True):
        llm = LLM(tiny, block_size=BS, num_kv_blocks=128, attention_backend=backend,
                  enable_cascade=cascade, cascade_min_group=2, cascade_min_blocks=1,
                  unroll_layers=True)  # (as on a GPU: fused Q/K/V, rope_write_kv)
        llm.generate(prompts[:1], params[:1], use_tqdm=False)  # a first wave fills the cache
        results[cascade] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        used = any(s[4] for s in llm.engine.runner.shapes_seen)
        assert used == cascade
    assert results[True] == results[False]
    for p, sp, toks in zip(prompts, params, results[True], strict=True):
        assert toks == dense_generate(tiny.params, tiny.config, p, sp.max_tokens,
                                      eos_token_ids=())


def test_decode_steps_of_the_same_sequences_reuse_the_plan(tiny):
    # 6 requests over one shared 3-block prefix, all decoding together: the plan is made
    # once their decoding starts, reused by the following steps (same object), and
    # dropped once nothing runs (no finished sequence is kept)
    rng = np.random.default_rng(3)
    V = tiny.config.vocab_size
    shared = rng.integers(3, V, 3 * BS).tolist()
    llm = LLM(tiny, block_size=BS, num_kv_blocks=128, attention_backend="xla",
              enable_cascade=True, cascade_min_group=2, cascade_min_blocks=1)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = llm.engine
    for _ in range(6):
        engine.add_request(None, shared + rng.integers(3, V, 5).tolist(), sp, 3 * BS)
    plans = []
    while engine.has_unfinished_requests():
        engine.step()
        plans.append(engine.cascade_planner.last)
    made = [p for p in plans if p is not None]
    assert made, "no cascade step"
    assert len({id(p[1]) for p in made}) < len(made)  # reused across steps
    assert all(len(p[0]) == 6 for p in made) and engine.cascade_planner.last is None
