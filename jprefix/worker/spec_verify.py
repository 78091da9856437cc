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


def verify(target_logits: jax.Array, batch: dict[str, jax.Array], greedy: bool
           ) -> jax.Array:
    """A verify step's acceptance: target_logits [S * (K+1), V] (the raw logits at
    `spec_idx`; speculating rows have no logits processing) -> [S * (K+1) + S] int32, the
    emitted tokens [S, K+1] (accepted proposals, then the target's token, -1 after) and
    num_accepted [S], flattened. `greedy` (every row of the step has temperature 0) takes
    the argmax rule only; otherwise sampled rows use the rejection rule against the
    distribution the normal sampler draws from (temperature, top-k, top-p; `seeds` and
    `counters` as a normal step's, so a request's draws stay its own), greedy rows the
    argmax rule (`rejection_sampler`). The proposals are deterministic (n-gram lookup, a
    greedy draft): one-hot draft distributions."""
    draft, num_draft = batch["draft_tokens"], batch["num_draft"]
    logits = target_logits.reshape(draft.shape[0], draft.shape[1] + 1, -1)
    if greedy:
        out, accepted = greedy_accept(logits, draft, num_draft)
    else:
        out, accepted = rejection_sample(
            logits, draft, num_draft, batch["temperature"], batch["top_k"], batch["top_p"],
            None, batch["seeds"], batch["counters"])
    return jnp.concatenate([out.reshape(-1), accepted])


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
