"""Paged attention of one sequence's query rows in plain jnp: the XLA path of one stream.

`paged_attention_reference` gathers every query row's pages on its own ([T, K, M*B, D]
per step), which keeps a many-sequence step's memory bounded but makes one sequence's
rows gather the same pages T times: a (k+1)-token speculative verify or a short chunk
on the CPU spends more in that gather than in its matmuls. With one sequence
(`block_tables` [1, M]) the pages are gathered once ([K, M*B, D]) and every row's
logits are one matmul against them (`tiled_attention.sequence_rows_attention`, the body
the many-sequence XLA path runs per tile). Same contract and numerics as
`paged_attention_reference` (float32 softmax, rows past `cu_q_lens[1]` come out as
zeros) for causal attention with `alibi_slopes`, `soft_cap`, fp8 scales and
`sliding_window`.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.alibi import check_slopes
from pallas_kernels.common import check_window
from pallas_kernels.paged_attention import token_positions
from pallas_kernels.tiled_attention import sequence_rows_attention


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap"))
def one_sequence_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, B, D]
    v_cache: jax.Array,  # [L, K, N, B, D]
    layer: jax.Array,  # int32 scalar
    block_tables: jax.Array,  # [1, M] int32
    kv_lens: jax.Array,  # [1] int32
    cu_q_lens: jax.Array,  # [2] int32
    *,
    scale: float,
    soft_cap: float | None = None,
    alibi_slopes: jax.Array | None = None,  # [H] float32
    k_scale: jax.Array | None = None,  # [L, K, N, B] float32 (fp8 caches)
    v_scale: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,  # int32 scalar >= 1
) -> jax.Array:
    """Causal attention of the rows `cu_q_lens[0]:cu_q_lens[1]` of one sequence against
    its `kv_lens[0]` cached keys (the rows sit at the last q_len positions)."""
    if block_tables.ndim != 2 or block_tables.shape[0] != 1:
        raise ValueError(f"block_tables {block_tables.shape}: one sequence ([1, M]) only")
    check_slopes(alibi_slopes, q.shape[1])
    check_window(sliding_window, True)
    _, pos, valid = token_positions(cu_q_lens, kv_lens, q.shape[0])
    return sequence_rows_attention(q, k_cache, v_cache, layer, block_tables[0], pos, valid,
                                   scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                                   k_scale=k_scale, v_scale=v_scale,
                                   sliding_window=sliding_window)
