"""The step's logits processing and logprobs (device side), for steps where some request
asks for them (the step's `extra` variant; a plain step runs none of this).

Arrays of the step (`jprefix.worker.pack_sampling` packs them), S rows, V vocab:
- presence, frequency, repetition, min_p [S] float32: each row's penalties and min_p
  (0, 0, 1, 0 = off);
- pen_ids [P] int32, pen_bounds [2S+1] int32: penalty entries, token ids laid out row
  by row; row i's known output tokens (one entry per token, repeats kept: counted) are
  entries [b[2i], b[2i+1]), the distinct tokens of its prompt (repetition penalty only)
  [b[2i+1], b[2i+2]), b = pen_bounds (non-decreasing, b[0] = 0; a row without
  penalties has empty segments); entries from b[2S] on are padding and count nowhere. A
  row's newest output token may still be pending on the host (async scheduling): it is
  the row's last input token, read from the previous step's output (`token_src` >= 0),
  and counted here;
- bias_rows, bias_ids [B] int32, bias_vals [B] float32: logit-bias (row, token, bias)
  entries, one per (row, token) at most (padding rows are S: dropped);
- plp_idx, plp_target [Q] int32: flat token positions whose prompt logprobs are wanted
  and the prompt token that follows each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def process_logits(logits: jax.Array, batch: dict[str, jax.Array], token_ids: jax.Array
                   ) -> jax.Array:
    """vLLM's order: logit bias, then repetition, frequency and presence penalties.
    `logits` [S, V] float32; `token_ids` [T] the step's input ids (pending ones resolved)."""
    num_rows, vocab = logits.shape
    logits = logits.at[batch["bias_rows"], batch["bias_ids"]].add(batch["bias_vals"],
                                                                  mode="drop")
    counts, listed = penalty_counts(batch, token_ids, num_rows, vocab)
    return apply_penalties(logits, counts, listed, batch)


def penalty_counts(batch: dict[str, jax.Array], token_ids: jax.Array, num_rows: int,
                   vocab: int) -> tuple[jax.Array, jax.Array]:
    """(counts [S, V] int32: each row's output tokens, a pending newest one included;
    listed [S, V] bool: the tokens of its penalty entries, prompt and output)."""
    ids, bounds = batch["pen_ids"], batch["pen_bounds"]
    # entry j lies in segment k (row k // 2: its output tokens if k is even, its prompt's
    # if odd); padding entries get k = 2S: row S, out of range, dropped. (Unrolled: a
    # few elementwise steps over the entries, log2(2S + 1) of them, no device loop.)
    k = jnp.searchsorted(bounds, jnp.arange(ids.shape[0], dtype=bounds.dtype),
                         side="right", method="scan_unrolled") - 1
    rows = k // 2
    out_rows = jnp.where(k % 2 == 0, rows, num_rows)
    counts = jnp.zeros((num_rows, vocab), jnp.int32).at[out_rows, ids].add(1, mode="drop")
    last = batch["logits_idx"]
    pending = (batch["token_src"][last] >= 0).astype(jnp.int32)
    counts = counts.at[jnp.arange(num_rows), token_ids[last]].add(pending, mode="drop")
    listed = jnp.zeros((num_rows, vocab), jnp.bool_).at[rows, ids].set(True, mode="drop")
    return counts, listed


def apply_penalties(logits: jax.Array, counts: jax.Array, listed: jax.Array,
                    batch: dict[str, jax.Array]) -> jax.Array:
    """Repetition, frequency and presence penalties on `logits` [S, ..., V] given the
    output-token `counts` and `listed` tokens of the same shape (broadcast)."""
    seen = (counts > 0) | listed  # (the output tokens are listed too: no matter)
    per_row = (logits.shape[0],) + (1,) * (logits.ndim - 1)
    rep, freq, pres = (batch[n].reshape(per_row) for n in ("repetition", "frequency",
                                                            "presence"))
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * counts - pres * (counts > 0)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """log_softmax of raw `logits` [R, V] at `tokens` [R]: (logprob [R] float32, rank [R]
    int32 (1 + the tokens strictly more likely), top-k ids [R, k] int32, top-k logprobs
    [R, k] float32), k <= V."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(lp > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return chosen, rank, top_ids.astype(jnp.int32), top_lp
