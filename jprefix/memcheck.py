"""Checks from the compiled step that the KV cache is updated in place, never copied."""

from __future__ import annotations

from types import SimpleNamespace

from jprefix.batch import flatten_batch, pack_step
from jprefix.runner import ModelRunner, step


def step_memory_report(runner: ModelRunner, num_tokens: int = 16) -> dict[str, int]:
    """Compiles one prefill step and returns the KV bytes, the bytes aliased between the
    donated cache and the output, and the step's temporary bytes."""
    greedy = SimpleNamespace(temperature=0.0, top_k=-1, top_p=1.0)
    blocks = list(range(1, -(-num_tokens // runner.block_size) + 1))
    seq = SimpleNamespace(all_token_ids=[1] * num_tokens, block_table=blocks,
                          sampling_params=greedy, seed=0, output_token_ids=[])
    sched = [SimpleNamespace(seq=seq, start=0, num_new_tokens=num_tokens)]
    ints, floats, layout = flatten_batch(pack_step(sched, runner.block_size, runner.buckets))
    compiled = step.lower(runner.params, runner.kv_cache, ints, floats, layout=layout,
                          cfg=runner.cfg, backend=runner.backend, mesh=runner.mesh).compile()
    analysis = compiled.memory_analysis()
    return dict(
        kv_bytes=sum(x.nbytes for x in runner.kv_cache),
        alias_bytes=analysis.alias_size_in_bytes,
        temp_bytes=analysis.temp_size_in_bytes,
    )
