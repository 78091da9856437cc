"""Speculative decoding's verify-side sampling (device side, jit-able): which of a row's
K proposed tokens the target accepts, and the one token it adds after them.

The target distribution p at each of a row's K+1 positions is exactly the one the normal
sampler draws from (`sampler.sampling_probs`: temperature, min-p, top-k, top-p of the
processed logits), so speculation changes no output distribution:

- greedy rows (temperature 0) accept drafts while each equals the target's argmax, then
  emit the argmax at the first mismatch (or after the last draft): the non-speculative
  tokens exactly;
- random rows accept draft x with probability min(1, p(x) / q(x)) (q the draft's
  distribution; one-hot at x for deterministic proposers: n-gram lookup, a greedy draft
  model); at the first rejection they emit a token from normalize(max(0, p - q)) (the
  "recovered" token); if all `num_draft` drafts are accepted, a "bonus" token from p at
  position `num_draft`. The emitted tokens are then distributed as p token by token
  (Leviathan et al. 2023, Chen et al. 2023).

Randomness per request, as in `sampler`: position j of a row draws with the key
`fold_in(PRNGKey(seed), counter + j)` (the key of output token number counter + j), so a
request's draws never depend on its batch neighbours. The bonus token is drawn with that
key exactly as `sampler.sample` would, so a row with no drafts (num_draft 0) emits the
very token the normal sampler emits; the acceptance uniform and the recovered draw use
`fold_in(key, 1)` and `fold_in(key, 2)`. Keys a step consumes are below the next step's
first counter (counter + num_accepted + 1), so no draw is ever reused. A draft model that
samples its proposals must draw them from keys independent of these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jprefix.worker.sampler import sampling_keys, sorted_sampling_logits, unsorted_probs

_UNIFORM, _RECOVERED = 1, 2  # fold_in tags of a position's key (the bonus uses the key)


def rejection_sample(
    target_logits: jax.Array,  # [S, K+1, V] float32, processed, not temperature-scaled
    draft_tokens: jax.Array,  # [S, K] int32
    num_draft: jax.Array,  # [S] int32 in 0..K; drafts past it are padding
    temperature: jax.Array,  # [S] float32, 0 = greedy
    top_k: jax.Array,  # [S] int32, -1 = off
    top_p: jax.Array,  # [S] float32, 1 = off
    min_p: jax.Array | None,  # [S] float32, 0 = off; None: no row has one
    seeds: jax.Array,  # [S] uint32
    counters: jax.Array,  # [S] int32, output tokens generated so far
    draft_probs: jax.Array | None = None,  # [S, K, V] float32 q; None: one-hot drafts
) -> tuple[jax.Array, jax.Array]:
    """Returns (tokens [S, K+1] int32, num_accepted [S] int32).

    Row s emits `num_accepted[s] + 1` tokens: `tokens[s, :a]` are its accepted drafts
    (a = num_accepted[s] in 0..num_draft[s]), `tokens[s, a]` the recovered token (a <
    num_draft) or the bonus token (a == num_draft), and -1 after. `target_logits[s, j]`
    are the target's logits after the row's context plus drafts 0..j-1.
    """
    S, K1, V = target_logits.shape
    K = K1 - 1
    if draft_tokens.shape != (S, K):
        raise ValueError(f"draft_tokens {draft_tokens.shape} should be [S, K] = {(S, K)} "
                         f"for target_logits {target_logits.shape}")
    if draft_probs is not None and draft_probs.shape != (S, K, V):
        raise ValueError(f"draft_probs {draft_probs.shape} should be [S, K, V] = {(S, K, V)}")
    greedy_tokens, greedy_accepted = greedy_accept(target_logits, draft_tokens, num_draft)
    random_tokens, random_accepted = _random_accept(
        target_logits, draft_tokens, num_draft, temperature, top_k, top_p, min_p, seeds,
        counters, draft_probs)
    greedy = (temperature <= 0)[:, None]
    return (jnp.where(greedy, greedy_tokens, random_tokens),
            jnp.where(greedy[:, 0], greedy_accepted, random_accepted))


def greedy_accept(target_logits: jax.Array, draft_tokens: jax.Array, num_draft: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """`rejection_sample` for rows that are all greedy (no sampling machinery): drafts are
    accepted while each equals the argmax of `target_logits` [S, K+1, V] at its position;
    then the argmax. Returns (tokens [S, K+1], num_accepted [S]) as `rejection_sample`."""
    argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [S, K+1]
    accepted = _accepted_count(draft_tokens == argmax[:, :-1], num_draft)
    final = jnp.take_along_axis(argmax, accepted[:, None], axis=-1)[:, 0]
    return _emitted(draft_tokens, accepted, final), accepted


def _random_accept(target_logits, draft_tokens, num_draft, temperature, top_k, top_p, min_p,
                   seeds, counters, draft_probs):
    """The rejection rule for every row as if random: (tokens [S, K+1], accepted [S])."""
    S, K1, V = target_logits.shape
    K = K1 - 1

    def per_position(x):  # [S] -> [S * (K+1)], row-major like the flattened logits
        return None if x is None else jnp.repeat(x, K1)

    flat = target_logits.reshape(S * K1, V)
    params = (per_position(temperature), per_position(top_k), per_position(top_p),
              per_position(min_p))
    order, sorted_logits = sorted_sampling_logits(flat, *params)
    probs = unsorted_probs(order, sorted_logits).reshape(S, K1, V)  # p
    drafts = jnp.clip(draft_tokens, 0, V - 1)  # (padding drafts may be anything)
    positions = jnp.arange(K1, dtype=jnp.int32)
    keys = sampling_keys(per_position(seeds),
                         (counters[:, None] + positions[None, :]).reshape(-1))  # [S*(K+1)]
    keys = keys.reshape(S, K1, *keys.shape[1:])
    p_draft = jnp.take_along_axis(probs[:, :K], drafts[..., None], axis=-1)[..., 0]
    q_draft = (jnp.ones_like(p_draft) if draft_probs is None else
               jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0])
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _UNIFORM))))(
        keys[:, :K])
    accepted = _accepted_count(_acceptance(u, p_draft, q_draft), num_draft)

    rows = jnp.arange(S)
    key_a = keys[rows, accepted]  # the key of the emitted position a = accepted
    at_a = rows * K1 + accepted
    picked = jax.vmap(jax.random.categorical)(key_a, sorted_logits[at_a])
    bonus = order[at_a, picked].astype(jnp.int32)  # drawn as `sampler.sample` draws
    final = bonus
    if K > 0:
        j = jnp.minimum(accepted, K - 1)  # (rows with a == num_draft take the bonus)
        q_a = (jax.nn.one_hot(drafts[rows, j], V, dtype=probs.dtype)
               if draft_probs is None else draft_probs[rows, j])
        residual = _residual(probs[rows, accepted], q_a)
        recovered = jax.vmap(lambda k, r: jax.random.categorical(
            jax.random.fold_in(k, _RECOVERED), jnp.log(r)))(key_a, residual)
        final = jnp.where(accepted < num_draft, recovered.astype(jnp.int32), bonus)
    return _emitted(draft_tokens, accepted, final), accepted


def _acceptance(u: jax.Array, p: jax.Array, q: jax.Array) -> jax.Array:
    """Accept a draft with probability min(1, p / q): u [S, K] uniform in [0, 1), p and q
    the target's and draft's probabilities of the drafted tokens (q = 0 < p accepts)."""
    return u * q < p


def _residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """[S, V] the distribution of a recovered token, normalize(max(0, p - q)), up to
    normalisation (categorical draws from its log); p itself where it is all zero (p = q
    up to rounding: such a rejection has probability 0)."""
    residual = jnp.maximum(p - q, 0.0)
    return jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)


def _accepted_count(accept: jax.Array, num_draft: jax.Array) -> jax.Array:
    """[S] int32: the leading run of True in `accept` [S, K], capped at `num_draft`."""
    K = accept.shape[1]
    valid = accept & (jnp.arange(K)[None, :] < num_draft[:, None])
    return jnp.sum(jnp.cumprod(valid.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _emitted(draft_tokens: jax.Array, accepted: jax.Array, final: jax.Array) -> jax.Array:
    """[S, K+1]: the accepted drafts, then `final` [S] at index `accepted`, then -1."""
    S, K = draft_tokens.shape
    j = jnp.arange(K + 1)[None, :]
    drafts = jnp.pad(draft_tokens.astype(jnp.int32), ((0, 0), (0, 1)))
    a = accepted[:, None]
    return jnp.where(j < a, drafts, jnp.where(j == a, final[:, None], -1))
