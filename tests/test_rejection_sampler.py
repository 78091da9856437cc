"""Speculative decoding's rejection sampler: greedy rows take the argmax chain, rows without
drafts are the normal sampler, and sampled rows emit tokens distributed as the target
(chi-square over many draws; broken acceptance rules fail the same statistic)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import gammaincc

from jprefix.worker import rejection_sampler
from jprefix.worker.rejection_sampler import rejection_sample
from jprefix.worker.sampler import sample, sampling_probs

V = 7
TEMPERATURE, TOP_K, TOP_P = 0.8, 6, 0.97


def _run(logits, drafts, num_draft, temperature, top_k=-1, top_p=1.0, min_p=None, seeds=None,
         counters=None, draft_probs=None):
    """`rejection_sample` jitted afresh (so a monkeypatched rule is traced), host outputs."""
    S = logits.shape[0]
    col = lambda x, dt: jnp.asarray(np.broadcast_to(x, (S,)), dt)  # noqa: E731
    args = (jnp.asarray(logits, jnp.float32), jnp.asarray(drafts, jnp.int32),
            col(num_draft, jnp.int32), col(temperature, jnp.float32), col(top_k, jnp.int32),
            col(top_p, jnp.float32), None if min_p is None else col(min_p, jnp.float32),
            col(np.arange(S) if seeds is None else seeds, jnp.uint32),
            col(0 if counters is None else counters, jnp.int32),
            None if draft_probs is None else jnp.asarray(draft_probs, jnp.float32))
    tokens, accepted = jax.jit(lambda *a: rejection_sample(*a))(*args)
    return np.asarray(tokens), np.asarray(accepted)


def test_greedy_rows_accept_the_argmax_chain_then_emit_the_argmax():
    rng = np.random.default_rng(0)
    S, K, Vb = 8, 4, 32
    logits = rng.normal(size=(S, K + 1, Vb)).astype(np.float32)
    argmax = logits.argmax(-1)
    num_draft = np.array([0, 1, 4, 4, 3, 2, 4, 1])
    match = np.array([0, 1, 4, 2, 3, 0, 1, 0])  # leading drafts equal to the argmax
    drafts = (argmax[:, :K] + 1) % Vb  # all wrong...
    for s in range(S):
        drafts[s, : match[s]] = argmax[s, : match[s]]  # ...but the first match[s]
    drafts[0] = -5  # padding drafts may hold anything
    temps = np.where(np.arange(S) % 2 == 0, 0.0, 1.0)  # odd rows sample: ignored here
    tokens, accepted = _run(logits, drafts, num_draft, temps)
    for s in range(0, S, 2):
        a = min(match[s], num_draft[s])
        assert accepted[s] == a
        expect = [*drafts[s, :a], argmax[s, a]] + [-1] * (K - a)
        np.testing.assert_array_equal(tokens[s], expect)
    greedy = _run(logits, drafts, num_draft, 0.0)
    np.testing.assert_array_equal(greedy[0][::2], tokens[::2])
    g_tokens, g_accepted = jax.jit(rejection_sampler.greedy_accept)(
        jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_draft))
    np.testing.assert_array_equal(g_tokens, greedy[0])
    np.testing.assert_array_equal(g_accepted, greedy[1])


@pytest.mark.parametrize("min_p", [None, 0.1])
def test_rows_without_drafts_are_the_normal_sampler(min_p):
    rng = np.random.default_rng(1)
    S, K, Vb = 16, 3, 40
    logits = (rng.normal(size=(S, K + 1, Vb)) * 2).astype(np.float32)
    temps = np.where(np.arange(S) % 4 == 0, 0.0, 0.9).astype(np.float32)
    top_k = np.where(np.arange(S) % 3 == 0, 5, -1)
    top_p = np.where(np.arange(S) % 5 == 0, 0.8, 1.0).astype(np.float32)
    seeds, counters = np.arange(S) * 7 + 3, np.arange(S) % 4
    drafts = rng.integers(0, Vb, (S, K))
    tokens, accepted = _run(logits, drafts, 0, temps, top_k, top_p, min_p, seeds, counters)
    expect = sample(jnp.asarray(logits[:, 0]), jnp.asarray(temps), jnp.asarray(top_k),
                    jnp.asarray(top_p), jnp.asarray(seeds, jnp.uint32),
                    jnp.asarray(counters, jnp.int32),
                    None if min_p is None else jnp.full(S, min_p, jnp.float32))
    np.testing.assert_array_equal(tokens[:, 0], np.asarray(expect))
    assert (tokens[:, 1:] == -1).all() and (accepted == 0).all()
    # a row's draws do not depend on its neighbours: row 5 alone draws the same
    alone = _run(logits[5:6], drafts[5:6], 2, temps[5], top_k[5], top_p[5], min_p,
                 seeds[5:6], counters[5:6])
    mixed = _run(logits, drafts, np.where(np.arange(S) == 5, 2, 0), temps, top_k, top_p,
                 min_p, seeds, counters)
    np.testing.assert_array_equal(alone[0][0], mixed[0][5])


def _target_probs(logits):
    """numpy: the normal sampler's distribution of `logits` [..., V] (temperature, top-k,
    top-p with the module's constants), written independently of sampler.py."""
    scaled = logits / TEMPERATURE
    order = np.argsort(-scaled, axis=-1, kind="stable")
    ranked = np.take_along_axis(scaled, order, axis=-1)
    ranked = np.where(np.arange(V) < TOP_K, ranked, -np.inf)
    probs = np.exp(ranked - ranked[..., :1])
    probs /= probs.sum(-1, keepdims=True)
    probs = np.where(np.cumsum(probs, -1) - probs < TOP_P, probs, 0.0)
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(probs)
    np.put_along_axis(out, order, probs, axis=-1)
    return out


def _chi_square_p_value(counts, probs):
    """Pearson's test of `counts` against `probs` (cells of expected count < 5 pooled;
    a count in a cell of probability 0 fails outright: p-value 0)."""
    counts, probs = counts.ravel(), probs.ravel()
    if counts[probs == 0].any():
        return 0.0
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    obs = np.append(counts[expected >= 5], counts[small].sum())
    exp = np.append(expected[expected >= 5], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(gammaincc((len(obs) - 1) / 2, stat / 2))


class _Model:
    """A two-token world over V tokens: the target's logits for the first token (l0) and
    for the second given the first (l1[a]), a draft (one-hot: fixed proposals; random: q0
    and q1[a], sampled here), and the target's logits at the bonus position (l2[b])."""

    def __init__(self, rng, random_draft):
        self.l0 = rng.normal(size=V) * 0.8
        self.l1 = rng.normal(size=(V, V)) * 0.8
        self.l2 = rng.normal(size=(V, V))
        self.random_draft = random_draft
        if random_draft:  # a draft unlike the target, so wrong rules show
            self.q0 = rng.dirichlet(np.ones(V))
            self.q1 = rng.dirichlet(np.ones(V), size=V)
        else:  # proposes the target's likeliest token, then a fixed successor
            self.q0 = np.eye(V)[np.argmax(self.l0)]
            self.q1 = np.eye(V)[(np.arange(V) * 3 + 1) % V]

    def draft(self, rng, q):  # q [N, V] -> one token per row
        return (q.cumsum(-1) > rng.random((len(q), 1))).argmax(-1)

    def draft_probs(self, *qs):
        return np.stack(qs, axis=1) if self.random_draft else None


def _two_tokens(model, n, seed=0):
    """The first two tokens of n generations (request seeds seed*n .. seed*n + n - 1, the
    random drafts' from `seed`): a step with two drafts; rows
    that emitted one token take their second from a step with one draft after it."""
    rng = np.random.default_rng(seed)
    q0 = np.broadcast_to(model.q0, (n, V))
    x0 = model.draft(rng, q0)
    x1 = model.draft(rng, model.q1[x0])
    logits = np.stack([np.broadcast_to(model.l0, (n, V)), model.l1[x0], model.l2[x1]], 1)
    seeds = np.arange(n) + seed * n
    tokens, accepted = _run(logits, np.stack([x0, x1], 1), 2, TEMPERATURE, TOP_K, TOP_P,
                            seeds=seeds, draft_probs=model.draft_probs(q0, model.q1[x0]))
    first = tokens[:, 0]
    y1 = model.draft(rng, model.q1[first])
    logits2 = np.stack([model.l1[first], model.l2[y1]], 1)
    again, _ = _run(logits2, y1[:, None], 1, TEMPERATURE, TOP_K, TOP_P, seeds=seeds,
                    counters=1, draft_probs=model.draft_probs(model.q1[first]))
    second = np.where(accepted >= 1, tokens[:, 1], again[:, 0])
    return first, second


def _p_values(model, n=20000):
    """Chi-square p-values of the first token and of the (first, second) pairs."""
    first, second = _two_tokens(model, n)
    p0 = _target_probs(model.l0)
    joint = p0[:, None] * _target_probs(model.l1)
    return (_chi_square_p_value(np.bincount(first, minlength=V), p0),
            _chi_square_p_value(np.bincount(first * V + second, minlength=V * V), joint))


@pytest.mark.parametrize("random_draft", [False, True], ids=["one-hot draft", "draft probs"])
def test_emitted_tokens_follow_the_target_distribution(random_draft):
    model = _Model(np.random.default_rng(3), random_draft)
    np.testing.assert_allclose(  # the reference is the sampler's distribution
        np.asarray(sampling_probs(jnp.asarray(model.l1, jnp.float32), jnp.full(V, TEMPERATURE),
                                  jnp.full(V, TOP_K), jnp.full(V, TOP_P))),
        _target_probs(model.l1), atol=1e-6)
    p_first, p_joint = _p_values(model)
    assert p_first > 1e-4 and p_joint > 1e-4, (p_first, p_joint)


def _always_accept(u, p, q):
    return jnp.ones_like(u, bool)


def _resample_from_p(p, q):
    return p


@pytest.mark.parametrize("rule", ["_acceptance", "_residual"])
@pytest.mark.parametrize("random_draft", [False, True], ids=["one-hot draft", "draft probs"])
def test_a_broken_acceptance_rule_fails_the_same_test(monkeypatch, rule, random_draft):
    broken = _always_accept if rule == "_acceptance" else _resample_from_p
    monkeypatch.setattr(rejection_sampler, rule, broken)
    p_first, p_joint = _p_values(_Model(np.random.default_rng(3), random_draft))
    assert min(p_first, p_joint) < 1e-9, (p_first, p_joint)


def test_draft_equal_to_target_is_always_accepted():
    rng = np.random.default_rng(4)
    S, K = 64, 3
    logits = rng.normal(size=(S, K + 1, V)).astype(np.float32)
    q = np.asarray(sampling_probs(jnp.asarray(logits.reshape(-1, V)), jnp.ones(S * (K + 1)),
                                  jnp.full(S * (K + 1), -1), jnp.ones(S * (K + 1))))
    q = q.reshape(S, K + 1, V)[:, :K]
    drafts = (q.cumsum(-1) > rng.random((S, K, 1))).argmax(-1)
    tokens, accepted = _run(logits, drafts, K, 1.0, draft_probs=q)
    assert (accepted == K).all()
    np.testing.assert_array_equal(tokens[:, :K], drafts)
