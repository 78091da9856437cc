"""The jitted step donates the KV cache and updates it in place (no per-step copy)."""

import jprefix
from jprefix import LLM
from jprefix.memcheck import step_memory_report


def test_step_updates_kv_cache_in_place():
    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    llm = LLM(tiny, block_size=8, num_kv_blocks=4096)  # cache far larger than anything else
    report = step_memory_report(llm.engine.runner)
    assert report["alias_bytes"] == report["kv_bytes"]  # both K and V buffers are reused
    assert report["temp_bytes"] < report["kv_bytes"] // 8  # no scratch copy of the cache


def test_unrolled_layers_match_scanned_layers_and_stay_in_place():
    import numpy as np

    from jprefix import SamplingParams

    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    prompts = [np.random.default_rng(i).integers(3, 200, 13 + i).tolist() for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for unroll in (False, True):
        llm = LLM(tiny, block_size=8, num_kv_blocks=64, unroll_layers=unroll)
        assert isinstance(llm.engine.runner.params.layers, tuple) == unroll
        outs[unroll] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs[True] == outs[False]
    report = step_memory_report(llm.engine.runner)
    assert report["alias_bytes"] == report["kv_bytes"]
