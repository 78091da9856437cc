"""The verify step's logits processing: at each verify position j the logits are exactly
a normal step's processed logits for the context plus proposals 0..j-1 (logit bias,
repetition / frequency / presence penalties counting those proposals)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jprefix.worker.logits_processing import process_logits
from jprefix.worker.spec_verify import process_verify_logits

V, K = 16, 3
OUTPUTS = [[1, 2, 2], [5], []]  # each row's known output tokens
PROMPTS = [[3, 4], [], [6]]  # each row's distinct prompt tokens (repetition penalty)
DRAFTS = [[2, 6, 6], [5, 5, 9], [6, 1, 0]]


def _batch(outputs):
    S = len(outputs)
    lengths = [n for o, p in zip(outputs, PROMPTS, strict=True) for n in (len(o), len(p))]
    ids = [t for o, p in zip(outputs, PROMPTS, strict=True) for t in (*o, *p)]
    return dict(
        pen_ids=jnp.array(ids + [0] * 4, jnp.int32),  # (padding entries count nowhere)
        pen_bounds=jnp.array(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32),
        logits_idx=jnp.arange(S, dtype=jnp.int32), token_src=jnp.full(S, -1, jnp.int32),
        bias_rows=jnp.array([0, 2, S], jnp.int32), bias_ids=jnp.array([7, 6, 0], jnp.int32),
        bias_vals=jnp.array([1.5, -2.0, 9.0], jnp.float32),
        repetition=jnp.array([1.3, 1.0, 1.5], jnp.float32),
        frequency=jnp.array([0.4, 0.1, 0.0], jnp.float32),
        presence=jnp.array([0.2, 0.0, 0.3], jnp.float32))


@pytest.mark.parametrize("seed", [0, 1])
def test_each_verify_position_is_the_normal_steps_processing(seed):
    logits = jnp.asarray(np.random.default_rng(seed).normal(size=(3, K + 1, V)), jnp.float32)
    token_ids = jnp.zeros(3, jnp.int32)
    got = process_verify_logits(logits, _batch(OUTPUTS), token_ids,
                                jnp.array(DRAFTS, jnp.int32))
    for j in range(K + 1):
        outputs = [o + d[:j] for o, d in zip(OUTPUTS, DRAFTS, strict=True)]
        want = process_logits(logits[:, j], _batch(outputs), token_ids)
        np.testing.assert_allclose(got[:, j], want, rtol=1e-6)
