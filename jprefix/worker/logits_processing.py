"""The step's logits processing and logprobs (device side), for steps where some request
asks for them (the step's `extra` variant; a plain step runs none of this).

Arrays of the step (`jprefix.worker.pack_sampling` packs them), S rows, V vocab:
- presence, frequency, repetition [S] float32: each row's penalties (0, 0, 1 = off);
- pen_rows, pen_ids, pen_out, pen_prompt [P] int32, pen_bias [P] float32: sparse
  (row, token) entries: the token's count among the row's known output tokens, whether
  the prompt holds it, its logit bias (padding entries add 0 to row 0, token 0). A row's
  newest output token may still be pending on the host (async scheduling): it is the
  row's last input token, read from the previous step's output (`token_src` >= 0), and
  counted here;
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
    rows, ids = batch["pen_rows"], batch["pen_ids"]
    logits = logits.at[rows, ids].add(batch["pen_bias"], mode="drop")
    counts = jnp.zeros((num_rows, vocab), jnp.int32).at[rows, ids].add(batch["pen_out"],
                                                                     mode="drop")
    last = batch["logits_idx"]
    pending = (batch["token_src"][last] >= 0).astype(jnp.int32)
    counts = counts.at[jnp.arange(num_rows), token_ids[last]].add(pending, mode="drop")
    in_prompt = jnp.zeros((num_rows, vocab), jnp.int32).at[rows, ids].add(
        batch["pen_prompt"], mode="drop")
    seen = (counts > 0) | (in_prompt > 0)
    rep = batch["repetition"][:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - batch["frequency"][:, None] * counts
            - batch["presence"][:, None] * (counts > 0))


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
