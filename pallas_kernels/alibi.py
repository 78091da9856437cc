"""ALiBi (attention with linear biases) in the kernels: the bias contract, the check of the
slopes a call passes, and the kernel's per-tile bias terms. The slopes themselves are the
model's (`models.alibi.alibi_slopes`: the caller passes them as an [H] float32 array).

With slopes, every attention op here adds `slope_h * (k_pos - q_pos)` to the scaled (and
soft-capped) logit of query head h at absolute position q_pos against the key at cache
position k_pos, before the causal mask and the softmax. The bias depends only on
positions, so prefill with a cached prefix and without it compute the same logits.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

LOG2E = math.log2(math.e)


def check_slopes(alibi_slopes, num_heads: int) -> None:
    """Raises ValueError unless `alibi_slopes` is None or a float32 [num_heads] array
    (one slope per query head of this call's q: a tensor-parallel shard passes its
    heads' slopes)."""
    if alibi_slopes is None:
        return
    shape, dtype = tuple(jnp.shape(alibi_slopes)), jnp.result_type(alibi_slopes)
    if shape != (num_heads,) or dtype != jnp.float32:
        raise ValueError(f"alibi_slopes must be float32 [{num_heads}] (one per query head), "
                         f"got {dtype}{list(shape)}")



def alibi_tile_terms(slopes, tok, first_pos, kv_len, *, causal: bool, unit: float):
    """The ALiBi terms of one kernel tile (`paged_attention_kernel`), whose rows have
    the slopes `slopes` ([R], or a scalar when every row is one head's) and sit `tok`
    [R] int32 after the tile's first position `first_pos` (`causal=False`: every row at
    kv_len). Returns the per-row slope in the step's logit units (log2 units over
    `unit`), float32 [R] (or scalar); the tile's anchor, int32 scalar; and per row
    `slope * (q_pos - anchor)` in log2 units, float32 [R]. A scalar
    slope stays a scalar: the step then adds one [block_kv] bias row to every logit row
    (one add per logit) instead of a [R] x [block_kv] outer product (a multiply-add).

    `slope * (key_pos - q_pos)` is split into `slope * (key_pos - anchor)`, added to
    each logit, and the per-row constant `-slope * (q_pos - anchor)`, which leaves the
    softmax unchanged and is subtracted from the running max once at the end. The anchor
    is the tile's first row's position (`causal=False`: kv_len, every row's q_pos), so
    the terms stay small near the diagonal, where the weights are large.
    """
    slope = slopes * LOG2E
    step_slope = slope / unit if unit != 1.0 else slope
    if causal:
        return step_slope, first_pos, slope * tok.astype(jnp.float32)
    return step_slope, kv_len, jnp.zeros_like(slope)
