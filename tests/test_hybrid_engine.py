"""The hybrid KV cache end to end on a tiny Gemma 3 (two 16-token window layers, one full
layer: three groups of one layer per page): greedy tokens with the prefix cache off,
explicit and automatic (a cached prefix longer than the window is hit) equal to the dense
reference and to one block table for every layer (`disable_hybrid_kv_cache_manager`);
window pages freed as a sequence decodes; the same memory serving sequences that one
table must preempt, and a hybrid run that preempts; the host tier, saved caches and
speculative decoding refused by name (speculation over one table equals the reference).
(Pallas kernels on the hybrid cache: tests/test_gemma3.py; two devices:
tests/test_window_model.py.)
"""

import numpy as np
import pytest
from hf_parity import dense_tokens, greedy, shared_prefix_prompts
from test_gemma3 import gemma  # noqa: F401  (the module fixture)

from jprefix import LLM
from jprefix.core.block_manager import NULL_BLOCK

WINDOW, BS = 16, 8


@pytest.mark.parametrize("mode", ["off", "explicit", "auto", "one table"])
def test_hybrid_greedy_equals_dense_and_one_table(gemma, mode):  # noqa: F811
    _, model = gemma
    prompts = shared_prefix_prompts(4, 3 * WINDOW, [2, 13, 27])  # 50-75 tokens, windows of 16
    llm = LLM(model, block_size=BS, num_kv_blocks=160, enable_prefix_caching=mode != "off",
              disable_hybrid_kv_cache_manager=mode == "one table", enable_cascade=True,
              cascade_min_group=2, cascade_min_blocks=1)
    engine = llm.engine
    assert (engine.kv_groups is None) == (mode == "one table")
    if engine.kv_groups is not None:  # a page holds one layer: [P=1, K, N, B, D]
        assert engine.kv_groups.windows == (None, WINDOW, WINDOW)
        assert engine.runner.kv_cache[0].shape[:3] == (1, 2, 160)
    prefix = 3 * WINDOW if mode == "explicit" else None
    want = dense_tokens(model, prompts, 12)
    for _ in range(2):  # the second round hits the 48-token prefix: 3 windows long
        outs = llm.generate(prompts, greedy(12), prefix_pos=prefix, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
    if mode != "off":
        assert all(o.num_cached_tokens >= 3 * WINDOW for o in outs)
    # cascade plans only for one table (a hybrid group's shared table would not hold its
    # members' window pages: they free them at their own positions)
    cascade = any(shape[4] for shape in engine.runner.shapes_seen)
    assert cascade == (mode == "one table")
    bm = engine.scheduler.block_manager
    engine.prefix_pool.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks - 1


def test_window_pages_are_freed_as_a_sequence_decodes(gemma):  # noqa: F811
    _, model = gemma
    (prompt,) = shared_prefix_prompts(6, 40, [1])
    llm = LLM(model, block_size=BS, num_kv_blocks=64, enable_prefix_caching=False,
              async_scheduling=False)
    engine = llm.engine
    engine.add_request("a", prompt, greedy(40))
    tokens, decodes = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids if out.finished else tokens
        for seq in engine.scheduler.running.values():
            if seq.num_computed_tokens <= len(prompt):  # (the prefill step)
                continue
            decodes += 1  # the step freed what its query at start no longer reaches
            start = seq.num_computed_tokens - 1
            dead = max(0, start - WINDOW + 1) // BS
            assert NULL_BLOCK not in seq.block_table  # the full layer keeps every block
            for table in seq.group_tables:  # the window layers: only their window's
                assert table[:dead] == [NULL_BLOCK] * dead
                assert len(table) - dead <= WINDOW // BS + 2
            held = len(seq.block_table) + sum(len(t) - t.count(NULL_BLOCK)
                                              for t in seq.group_tables)
            assert engine.scheduler.block_manager.num_used_blocks == held
    assert decodes == 38 and tokens == dense_tokens(model, [prompt], 40)[0]


def test_same_memory_serves_without_the_preemptions_one_table_needs(gemma):  # noqa: F811
    """Three 98-105-token sequences: 39 blocks of 8. One table per layer-block keeps all
    39 (3 layers each: 117 layer-blocks), so 30 blocks of 3 layers = 90 layer-blocks
    preempt; the hybrid cache's 90 one-layer pages hold the full layer's 39 and each
    window layer's ~3 per sequence."""
    _, model = gemma
    prompts = shared_prefix_prompts(7, 40, [18, 21, 25])
    sp = greedy(40)
    want = dense_tokens(model, prompts, 40)
    runs = {}
    for hybrid, blocks in ((True, 90), (False, 30), (True, 48)):  # (48: hybrid preempts)
        llm = LLM(model, block_size=BS, num_kv_blocks=blocks, max_num_batched_tokens=32,
                  enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid)
        assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
        runs[hybrid, blocks] = llm.engine.stats.num_preemptions
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks - 1
    assert runs[True, 90] == 0 < runs[False, 30] and runs[True, 48] > 0


_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
          "prompt_lookup_min": 1}


@pytest.mark.parametrize("kw", [dict(kv_offloading_size=0.001),
                                dict(prefix_cache_path="/nonexistent/cache.jpc"),
                                dict(speculative_config=_NGRAM)])
def test_host_tier_is_refused_for_a_hybrid_cache(gemma, kw):  # noqa: F811
    _, model = gemma
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        LLM(model, block_size=BS, num_kv_blocks=32, **kw)


def test_save_prefix_cache_is_refused_for_a_hybrid_cache(gemma, tmp_path):  # noqa: F811
    _, model = gemma
    llm = LLM(model, block_size=BS, num_kv_blocks=32)
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager"):
        llm.save_prefix_cache(str(tmp_path / "c.jpc"))


def test_speculation_over_one_table_equals_dense(gemma):  # noqa: F811
    """n-gram speculation on the window model with one block table (the hybrid cache
    refuses it): verify rows attend each layer within its window, as decode steps do."""
    _, model = gemma
    rng = np.random.default_rng(7)
    motif = rng.integers(3, 128, 6).tolist()
    prompts = [motif * 6 + rng.integers(3, 128, n).tolist() for n in (3, 11)]  # > window
    llm = LLM(model, block_size=BS, num_kv_blocks=64, speculative_config=_NGRAM,
              disable_hybrid_kv_cache_manager=True)
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert [o.token_ids for o in outs] == dense_tokens(model, prompts, 24)
    assert llm.engine.stats.spec.num_drafts > 0
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks - 1
