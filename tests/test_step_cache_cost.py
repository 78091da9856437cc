"""No step costs in proportion to the KV cache's size: in the compiled step, for caches of
two sizes, the only instructions whose result is as large as a cache array are the
in-place scatters of the KV write (and the bitcasts, tuple plumbing and loop that carry
the donated buffers), and the step's flops do not change. (On the CPU an fp8 or bfloat16
cache used to be converted whole on every write: `worker.kv_bits`.)"""

import re

import pytest

import jprefix
from jprefix import LLM
from scripts.memcheck import compile_step, step_memory_report, synthetic_rows

# instructions that may carry a whole cache: they move no data (or update it in place)
CARRIERS = ("parameter", "bitcast", "get-tuple-element", "tuple", "while", "scatter",
            "copy-start", "copy-done")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([0-9,]*)\]\S* ([\w-]+)\(")


def _whole_cache_ops(text: str, sizes: set[int]) -> list[str]:
    """Instructions of `text` (optimized HLO) whose result has one of `sizes` elements,
    less the carriers and the fusions whose root is a scatter (the in-place write)."""
    scatter_fusions = set(re.findall(r"calls=%(wrapped_scatter_computation[\w.]*)", text))
    found = []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m or m.group(4) in CARRIERS:
            continue
        n = 1
        for d in filter(None, m.group(3).split(",")):
            n *= int(d)
        calls = re.search(r"calls=%([\w.]+)", line)
        if n in sizes and not (calls and calls.group(1) in scatter_fusions):
            found.append(line.strip()[:160])
    return found


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama", dtype="float32", load_format="dummy")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "bfloat16"])
def test_step_touches_no_more_of_the_cache_than_it_writes(tiny, kv):
    model = tiny if kv != "bfloat16" else jprefix.load("tiny-llama", dtype="bfloat16",
                                                      load_format="dummy")
    kv_cache_dtype = "auto" if kv == "bfloat16" else kv
    flops = {}
    for num_blocks in (77, 1031):  # (odd counts: no other array of the step that size)
        llm = LLM(model, block_size=8, num_kv_blocks=num_blocks, attention_backend="xla",
                  kv_cache_dtype=kv_cache_dtype)
        runner = llm.engine.runner
        sizes = {x.size for x in runner.kv_cache}  # (K/V, and an fp8 cache's scales)
        for name, rows in (("decode", synthetic_rows([[1] * 9], [[1, 2]], [1])),
                           ("prefill", synthetic_rows([[1] * 20], [[3, 4, 5]], [20]))):
            compiled = compile_step(runner, rows)
            assert _whole_cache_ops(compiled.as_text(), sizes) == [], (kv, name, num_blocks)
            cost = compiled.cost_analysis()
            flops[name, num_blocks] = (cost[0] if isinstance(cost, list) else cost)["flops"]
        report = step_memory_report(runner)
        assert report["alias_bytes"] == report["kv_bytes"]  # every cache buffer reused
    assert flops["decode", 77] == flops["decode", 1031]
    assert flops["prefill", 77] == flops["prefill", 1031]
