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


def greedy_verify(target_logits: jax.Array, draft_tokens: jax.Array, num_draft: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """target_logits [S, K+1, V], draft_tokens [S, K], num_draft [S] -> (tokens [S, K+1]
    int32, num_accepted [S] int32): row s accepts proposals while each equals the
    target's argmax, then emits the argmax at the first mismatch (or after its last
    proposal): exactly the tokens non-speculative greedy decoding emits."""
    K = draft_tokens.shape[1]
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [S, K+1]
    pos = jnp.arange(K, dtype=jnp.int32)
    match = (target[:, :K] == draft_tokens) & (pos < num_draft[:, None])
    num_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    emitted = jnp.arange(K + 1, dtype=jnp.int32) <= num_accepted[:, None]
    return jnp.where(emitted, target, -1), num_accepted.astype(jnp.int32)


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
