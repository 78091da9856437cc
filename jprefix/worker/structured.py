"""Structured output on the device: a packed token bitmask applied to the logits.

The host (`jprefix.engine.structured_output`) fills one row of int32 words per sampling
row that follows a grammar; `place_bitmask` lays those rows out in the step's device row
order (every other row allows every token), and the jitted step runs `apply_token_bitmask`
on its logits before sampling, as a stage of its own: steps without a bitmask trace
without it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def place_bitmask(rows: Seq[Any], masks: dict[Any, np.ndarray], num_rows: int,
                  words: int) -> np.ndarray:
    """[num_rows, words] int32: row i is `masks[rows[i].seq]` where there is one, all
    bits set (every token allowed) elsewhere, padding rows included. `rows` are the
    step's ScheduledSeq rows in device order; `num_rows` >= len(rows) is the step's
    bucketed row count (the logits' rows)."""
    out = np.full((num_rows, words), -1, np.int32)
    for i, sc in enumerate(rows):
        mask = masks.get(sc.seq)
        if mask is not None:
            out[i] = mask
    return out


def step_bitmask(rows: Seq[Any], masks: dict[Any, np.ndarray] | None,
                 num_rows: int) -> np.ndarray | None:
    """`place_bitmask` for a step: None when no row has a mask (the step then traces no
    mask stage)."""
    if not masks:
        return None
    return place_bitmask(rows, masks, num_rows, next(iter(masks.values())).size)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [S, V] float; bitmask [S, W] int32 with W * 32 >= V, bit t % 32 of word
    t // 32 set where token t is allowed. Disallowed tokens get -inf."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [S, W, 32]; >> is arithmetic: & 1 fixes it
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]] != 0
    return jnp.where(allowed, logits, -jnp.inf)
