"""On-device sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds.

Everything here runs inside the jitted step, so only the sampled ids cross to the host.
Each request's randomness is `fold_in(key(seed), num_generated)`: a request draws the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array,  # [S, V] float32
    temperature: jax.Array,  # [S] float32, 0 = greedy
    top_k: jax.Array,  # [S] int32, -1 = off
    top_p: jax.Array,  # [S] float32, 1 = off
    seeds: jax.Array,  # [S] uint32
    counters: jax.Array,  # [S] int32, tokens generated so far
    min_p: jax.Array | None = None,  # [S] float32, 0 = off; None: no row has one
) -> jax.Array:  # [S] int32
    """Samples one token per row; rows with temperature 0 take the argmax.

    (The engine skips this for all-greedy batches, a fact it knows on the host.)
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = _sample_random(logits, temperature, top_k, top_p, seeds, counters, min_p)
    return jnp.where(temperature > 0, sampled, greedy)


def _sample_random(logits, temperature, top_k, top_p, seeds, counters, min_p=None):
    order, sorted_logits = sorted_sampling_logits(logits, temperature, top_k, top_p, min_p)
    picked = jax.vmap(jax.random.categorical)(sampling_keys(seeds, counters), sorted_logits)
    return jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sampling_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """[S] PRNG keys `fold_in(PRNGKey(seed), counter)`: the draw of a request's output
    token number `counter`, whatever else shares its batch."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)


def sorted_sampling_logits(
    logits: jax.Array,  # [S, V] float32
    temperature: jax.Array,  # [S] float32 (0 rows are scaled by 1)
    top_k: jax.Array,  # [S] int32, -1 = off
    top_p: jax.Array,  # [S] float32, 1 = off
    min_p: jax.Array | None = None,  # [S] float32, 0 = off
) -> tuple[jax.Array, jax.Array]:  # order [S, V] int32, sorted logits [S, V] float32
    """The distribution a random row samples from, in descending logit order: temperature,
    then min-p, top-k and top-p (vLLM's order); dropped tokens hold -inf. `order[s, i]` is
    the token id at sorted index i. (`sample` and the rejection sampler both use it.)"""
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_t[:, None]
    if min_p is not None:
        scaled = mask_min_p(scaled, min_p)
    order = jnp.argsort(-scaled, axis=-1)  # [S, V] descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    sorted_logits = _mask_top_k(sorted_logits, top_k)
    return order, _mask_top_p(sorted_logits, top_p)


def sampling_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                   top_p: jax.Array, min_p: jax.Array | None = None) -> jax.Array:
    """[S, V] float32, in vocab order: the probabilities `sample` draws a random row's
    token with (`sorted_sampling_logits`' softmax); dropped tokens have exactly 0."""
    return unsorted_probs(*sorted_sampling_logits(logits, temperature, top_k, top_p, min_p))


def unsorted_probs(order: jax.Array, sorted_logits: jax.Array) -> jax.Array:
    """[S, V] the softmax of `sorted_sampling_logits`' result, back in vocab order."""
    rows = jnp.arange(order.shape[0])[:, None]
    return jnp.zeros_like(sorted_logits).at[rows, order].set(
        jax.nn.softmax(sorted_logits, axis=-1))


def _mask_top_k(sorted_logits, top_k):
    rank = jnp.arange(sorted_logits.shape[-1])[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    return jnp.where(keep, sorted_logits, -jnp.inf)


def _mask_top_p(sorted_logits, top_p):
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly better tokens
    keep = mass_before < top_p[:, None]  # always keeps the best token
    return jnp.where(keep, sorted_logits, -jnp.inf)


def mask_min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """vLLM's min-p on temperature-scaled logits [S, V]: drops (-inf) the tokens whose
    probability is below `min_p` [S] times the row's top probability (min_p 0 keeps all)."""
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(keep, scaled, -jnp.inf)
