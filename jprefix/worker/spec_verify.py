"""Speculative decoding on the worker: a verify step's extra arrays (host, numpy) and
the acceptance of its proposals (device, jit-able).

A verify row (`core.spec_decode`) computes 1 + d tokens: its newest token and d
proposals. The step needs the target's logits at all 1 + d positions (logits after
each prefix of the proposals), so beside `logits_idx [S]` a verify step carries
`spec_idx [S, K+1]` (flat token index of row s's j-th logits position; positions past
its d + 1 repeat its last), `draft_tokens [S, K]` and `num_draft [S]` (0 for the
step's rows without proposals), K the engine's `num_speculative_tokens` (fixed: one
compiled shape). The step returns, after its usual tokens [P], the verified tokens
[S, K+1] (accepted proposals, then the target's token, -1 after) and num_accepted [S].
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jprefix.core.sampling_params import MAX_LOGPROBS
from jprefix.worker.logits_processing import apply_penalties, penalty_counts, token_logprobs
from jprefix.worker.rejection_sampler import greedy_accept, rejection_sample
from jprefix.worker.step_handle import StepHandle, unorder


def pack_spec(rows: Seq[Any], num_seqs: int, cu_q_lens: np.ndarray, counters: np.ndarray,
              k: int) -> dict[str, np.ndarray]:
    """The verify arrays of a step whose rows (ScheduledSeq, device order) include
    proposals; fixes `counters` in place (a verify row's first emitted token is output
    token number start + 1 - prompt length, not the one after its last proposal)."""
    num_draft = np.zeros(num_seqs, np.int32)
    num_draft[: len(rows)] = [len(sc.seq.spec_token_ids) for sc in rows]
    draft_tokens = np.zeros((num_seqs, k), np.int32)
    for i, sc in enumerate(rows):
        if num_draft[i]:
            draft_tokens[i, : num_draft[i]] = sc.seq.spec_token_ids
    counters -= num_draft
    last = np.maximum(cu_q_lens[1:] - 1, 0)
    first = last - num_draft
    spec_idx = np.minimum(first[:, None] + np.arange(k + 1, dtype=np.int32), last[:, None])
    return dict(spec_idx=spec_idx.astype(np.int32), draft_tokens=draft_tokens,
                num_draft=num_draft)


def verify(target_logits: jax.Array, batch: dict[str, jax.Array], token_ids: jax.Array,
           greedy: bool, extra: bool) -> tuple[jax.Array, tuple | None]:
    """A verify step's acceptance. `target_logits` [S * (K+1), V]: the raw logits at
    `spec_idx`. Returns ([S * (K+1) + S] int32: the emitted tokens [S, K+1] (accepted
    proposals, then the target's token, -1 after) and num_accepted [S], flattened; and
    with `extra` the emitted tokens' logprobs (`verify_logprobs`), else None).

    Each position's distribution is the one a normal step samples that token from:
    with `extra` the logit bias and penalties (`process_verify_logits`) and min-p, then
    temperature, top-k and top-p. `greedy` (every row of the step has temperature 0)
    takes the argmax rule only; otherwise sampled rows use the rejection rule with a
    normal step's `seeds` and `counters` (a request's draws stay its own), greedy rows
    the argmax rule (`rejection_sampler`). Proposals are deterministic (n-gram lookup, a
    greedy draft): one-hot draft distributions."""
    draft, num_draft = batch["draft_tokens"], batch["num_draft"]
    S, K = draft.shape
    raw = target_logits.reshape(S, K + 1, -1)
    logits = process_verify_logits(raw, batch, token_ids, draft) if extra else raw
    if greedy:
        out, accepted = greedy_accept(logits, draft, num_draft)
    else:
        out, accepted = rejection_sample(
            logits, draft, num_draft, batch["temperature"], batch["top_k"], batch["top_p"],
            batch["min_p"] if extra else None, batch["seeds"], batch["counters"])
    flat = jnp.concatenate([out.reshape(-1), accepted])
    return flat, (verify_logprobs(target_logits, out, accepted, num_draft) if extra else None)


def process_verify_logits(logits: jax.Array, batch: dict[str, jax.Array],
                          token_ids: jax.Array, draft: jax.Array) -> jax.Array:
    """`logits_processing.process_logits` at each verify position: logits [S, K+1, V];
    position j's output-token counts are the row's (as a normal step's) plus its
    proposals 0..j-1, the tokens before that position (the bias is the same at all)."""
    S, K1, V = logits.shape
    logits = logits.at[batch["bias_rows"], :, batch["bias_ids"]].add(
        batch["bias_vals"][:, None], mode="drop")
    counts, listed = penalty_counts(batch, token_ids, S, V)
    drafted = jnp.cumsum(jax.nn.one_hot(draft, V, dtype=jnp.int32), axis=1)  # [S, K, V]
    counts = counts[:, None] + jnp.pad(drafted, ((0, 0), (1, 0), (0, 0)))  # [S, K+1, V]
    return apply_penalties(logits, counts, listed[:, None], batch)


def verify_logprobs(target_logits: jax.Array, tokens: jax.Array, accepted: jax.Array,
                    num_draft: jax.Array) -> tuple[jax.Array, ...]:
    """The emitted tokens' logprobs under the target's raw distribution at their
    positions (what a normal step reports): (logprob [S, K+1], rank [S, K+1], top ids
    [S, K+1, k], top logprobs [S, K+1, k], emitted [S] = num_accepted + 1 for rows with
    proposals, else 0), k = min(MAX_LOGPROBS, V); entries past a row's emitted are junk."""
    S, K1 = tokens.shape
    k = min(MAX_LOGPROBS, target_logits.shape[-1])
    lp = token_logprobs(target_logits, jnp.maximum(tokens.reshape(-1), 0), k)
    emitted = jnp.where(num_draft > 0, accepted + 1, 0).astype(jnp.int32)
    return (*(a.reshape(S, K1, *a.shape[1:]) for a in lp), emitted)


def fetch_verify_logprobs(handle: StepHandle) -> tuple[np.ndarray, ...] | None:
    """A fetched extra verify step's `verify_logprobs` in scheduled order (the first R
    rows), or None for another step."""
    result = handle.tokens.result()
    if handle.verify_rows is None or not isinstance(result, tuple) or len(result[1]) < 3:
        return None
    arrays = tuple(np.asarray(a)[: handle.num_rows] for a in result[1][2])
    return arrays if handle.order is None else tuple(unorder(a, handle.order) for a in arrays)


def fetch_verified(handle: StepHandle, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A fetched verify step's (tokens [R, K+1], num_accepted [R]) in scheduled order
    (R its rows; `ModelRunner.fetch` has waited for it), or None for another step."""
    P = handle.verify_rows
    if P is None:
        return None
    result = handle.tokens.result()
    out = np.asarray(result[0] if isinstance(result, tuple) else result)
    S, K1, n = (len(out) - P) // (k + 2), k + 1, handle.num_rows
    tokens = out[P : P + S * K1].reshape(S, K1)[:n]
    accepted = out[P + S * K1 : P + S * K1 + S][:n]
    if handle.order is None:
        return tokens, accepted
    return unorder(tokens, handle.order), unorder(accepted, handle.order)
