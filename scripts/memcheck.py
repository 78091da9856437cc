"""Checks from the compiled step that the KV cache is updated in place, never copied."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import ScheduledSeq, is_decode_step
from jprefix.core.sequence import Sequence
from jprefix.worker.flat_batch import flatten_batch
from jprefix.worker.model_runner import ModelRunner
from jprefix.worker.pack import pack_step
from jprefix.worker.step import step


def compile_step(runner: ModelRunner, scheduled) -> jax.stages.Compiled:
    """The compiled step the runner would run for `scheduled` (plain attention)."""
    batch = pack_step(scheduled, runner.block_size, runner.buckets)
    flat, layout = flatten_batch(batch)
    decode = is_decode_step([sc.num_new_tokens for sc in scheduled])
    return step.lower(runner.params, runner.kv_cache, flat,
                      jnp.zeros(runner.max_rows, jnp.int32), layout=layout, cfg=runner.cfg,
                      backend=runner.backend, decode=decode, greedy=True,
                      mesh=runner.mesh, kv_format=runner.kv_format).compile()


def step_memory_report(runner: ModelRunner, num_tokens: int = 16) -> dict[str, int]:
    """Compiles one prefill step and returns the KV bytes, the bytes aliased between the
    donated cache and the output, and the step's temporary bytes."""
    blocks = list(range(1, -(-num_tokens // runner.block_size) + 1))
    analysis = compile_step(runner, synthetic_rows([[1] * num_tokens], [blocks],
                                                   [num_tokens])).memory_analysis()
    return dict(
        kv_bytes=sum(x.nbytes for x in runner.kv_cache),
        alias_bytes=analysis.alias_size_in_bytes,
        temp_bytes=analysis.temp_size_in_bytes,
    )


def synthetic_rows(contexts, block_tables, num_new, sampling_params=None,
                   seeds=None) -> list[ScheduledSeq]:
    """Rows that compute the last `num_new[i]` tokens of `contexts[i]` (all sampled),
    over the given block tables: for benchmarks and checks that drive the runner
    without a scheduler. Greedy unless `sampling_params` says otherwise."""
    sp = sampling_params or SamplingParams(temperature=0.0, max_tokens=1)
    rows = []
    for i, (ctx, table, n) in enumerate(zip(contexts, block_tables, num_new, strict=True)):
        seq = Sequence(f"synthetic-{i}", list(ctx), sp, seed=0 if seeds is None else seeds[i])
        seq.block_table = list(table)
        rows.append(ScheduledSeq(seq, len(ctx) - n, n, True))
    return rows
