"""The extra step's packed penalty layout (`pack_sampling`) through `process_logits`,
against a dense numpy reference of vLLM's logits processing: random rows, penalised or
not, with or without a logit bias, output tokens with repeats, rows whose only segment
is the prompt's or the output's, a pending newest token, padding entries, and a
penalised row in the last row slot."""

import jax.numpy as jnp
import numpy as np
import pytest

from jprefix import SamplingParams
from jprefix.core.sequence import Sequence
from jprefix.worker.logits_processing import process_logits
from jprefix.worker.pack_sampling import pack_sampling
from jprefix.worker.request_rows import RequestRows

V = 48
KINDS = {  # kind -> (sampling params, number of known output tokens)
    "plain": (SamplingParams(), 4),
    "all": (SamplingParams(repetition_penalty=1.4, frequency_penalty=0.6,
                           presence_penalty=-0.3, logit_bias={1: 2.5, 40: -4.0}), 7),
    "prompt_only": (SamplingParams(repetition_penalty=0.7, presence_penalty=0.5), 0),
    "output_only": (SamplingParams(frequency_penalty=1.1, presence_penalty=0.4), 9),
    "bias_only": (SamplingParams(logit_bias={3: 1.5, 5: -2.0, 47: 7.0}, min_p=0.1), 5),
    "empty": (SamplingParams(frequency_penalty=0.8), 0),
    "logprobs": (SamplingParams(logprobs=2, repetition_penalty=1.2), 3),
}


def _reference(logits: np.ndarray, prompt: list[int], output: list[int],
               sp: SamplingParams) -> np.ndarray:
    """Bias, then repetition on (prompt | output) tokens, then frequency * count and
    presence (output tokens), dense, float64."""
    x = np.array(logits, np.float64)
    for token, bias in (sp.logit_bias or {}).items():
        x[token] += bias
    counts = np.bincount(np.asarray(output, np.int64), minlength=V)
    seen = (counts > 0) | np.isin(np.arange(V), prompt)
    r = sp.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


@pytest.mark.parametrize("num_rows,seed", [(7, 0), (12, 1)])
def test_packed_entries_process_logits_like_the_dense_reference(num_rows, seed):
    rng = np.random.default_rng(seed)
    kinds = list(rng.choice(sorted(KINDS), num_rows - 1)) + ["all"]  # (row S-1: penalised)
    kinds[:len(KINDS) - 1] = sorted(set(KINDS) - {"all"})  # every kind at least once
    rows, token_ids, token_src, want = [], [], [], []
    logits = (rng.normal(size=(num_rows, V)) * 3).astype(np.float32)
    for i, kind in enumerate(kinds):
        sp, num_out = KINDS[kind]
        seq = Sequence(f"r{i}", rng.integers(0, V, 11).tolist(), sp, seed=i)
        for t in rng.integers(0, 8, num_out).tolist():  # few distinct tokens: repeats
            seq.append_token(t)
        sample = i != 2  # (a row that does not sample: nothing processed)
        pending = i % 3 == 1  # its newest token is on the device (counted there)
        newest = int(rng.integers(0, 8)) if pending else seq.all_token_ids[-1]
        rows.append((seq, seq.num_tokens - 1, 1, sample))
        token_ids.append(newest)
        token_src.append(i if pending else -1)
        output = seq.output_token_ids + ([newest] if pending else [])
        active = sample and seq.sampling_extra
        want.append(_reference(logits[i], seq.prompt_token_ids, output,
                               sp if active else SamplingParams()))
    extra, _ = pack_sampling(rows, num_rows, np.arange(num_rows + 1, dtype=np.int32),
                             RequestRows())
    bounds, ids = extra["pen_bounds"], extra["pen_ids"]
    assert bounds.shape == (2 * num_rows + 1,) and bounds[0] == 0
    assert np.all(np.diff(bounds) >= 0) and bounds[-1] < len(ids)  # padding entries
    seq = rows[-1][0]  # the last row slot: its output segment, then its prompt's
    b = bounds[2 * num_rows - 2:]
    np.testing.assert_array_equal(ids[b[0]:b[1]], seq.output_token_ids)
    np.testing.assert_array_equal(ids[b[1]:b[2]], np.unique(seq.prompt_token_ids))
    assert len(extra["bias_ids"]) > sum(len(KINDS[k][0].logit_bias or ()) for k in kinds)
    ids[bounds[-1]:] = rng.integers(0, V, len(ids) - bounds[-1])  # padding counts nowhere
    batch = {k: jnp.asarray(v) for k, v in extra.items()}
    batch |= dict(logits_idx=jnp.arange(num_rows, dtype=jnp.int32),
                  token_src=jnp.asarray(token_src, jnp.int32))
    got = np.asarray(process_logits(jnp.asarray(logits), batch,
                                    jnp.asarray(token_ids, jnp.int32)))
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5)


def test_a_step_without_penalties_packs_only_padding():
    seq = Sequence("r", [5, 6, 7], SamplingParams(min_p=0.2), seed=0)
    seq.append_token(9)
    extra, _ = pack_sampling([(seq, 3, 1, True)], 4, np.arange(5, dtype=np.int32),
                             RequestRows())
    assert not extra["pen_bounds"].any() and len(extra["pen_ids"]) >= 1
    np.testing.assert_allclose(extra["min_p"], [0.2, 0, 0, 0])
    np.testing.assert_array_equal(extra["repetition"], 1)
    assert (extra["bias_rows"] == 4).all()  # (padding: the out-of-range row S)
