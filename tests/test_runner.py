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
