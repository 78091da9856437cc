"""The CPU's column pieces (`worker.layer_switch.split_columns`): each per-layer matmul
weight kept as `COLUMN_PIECES` column blocks gives the plain layout's tokens, the pieces
put back together are the weight bit for bit, and the compiled step really runs one dot
per piece (so that XLA:CPU's executor can hand half of them to a second core)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jprefix
import jprefix.worker.params as worker_params
from jprefix import LLM, SamplingParams
from jprefix.worker.layer_switch import (
    COLUMN_PIECES,
    MATMUL_FIELDS,
    ColumnPieces,
    piecewise,
    split_columns,
)
from models.llama import dense_linear
from scripts.memcheck import compile_step, synthetic_rows

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's layout")


@pytest.fixture(scope="module")
def tiny():
    return jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")


def _llm(tiny, monkeypatch, pieces: bool) -> LLM:
    if not pieces:  # the plain per-layer layout: every weight one buffer
        monkeypatch.setattr(worker_params, "split_columns", lambda params: params)
    llm = LLM(tiny, block_size=8, num_kv_blocks=64)
    monkeypatch.undo()
    return llm


def _num_dots(runner) -> int:
    rows = synthetic_rows([[1] * 9], [[1, 2]], [1])
    return len(re.findall(r" dot\(", compile_step(runner, rows).as_text()))


def test_pieces_give_the_plain_layouts_tokens_and_one_dot_per_piece(tiny, monkeypatch):
    prompts = [np.random.default_rng(i).integers(3, 200, 7 + 6 * i).tolist() for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain, split = _llm(tiny, monkeypatch, False), _llm(tiny, monkeypatch, True)
    lp_plain, lp_split = plain.engine.runner.params.layers[0], split.engine.runner.params.layers[0]
    assert isinstance(lp_split.wq, ColumnPieces) and not isinstance(lp_plain.wq, ColumnPieces)
    assert len(lp_split.w_down.pieces) == COLUMN_PIECES
    for llm in (plain, split):  # a batch, then one stream alone (T=2, S=1)
        llm.outs = ([o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)],
                    llm.generate(prompts[:1], sp, use_tqdm=False)[0].token_ids)
    assert split.outs == plain.outs
    # each layer's branch of each matmul runs COLUMN_PIECES dots in place of one
    num_layers = len(split.engine.runner.params.layers)
    extra = num_layers * len(MATMUL_FIELDS) * (COLUMN_PIECES - 1)
    assert _num_dots(split.engine.runner) - _num_dots(plain.engine.runner) == extra


def test_split_columns_keeps_every_weight_bit_for_bit(tiny):
    params = worker_params.prepare_params(tiny.params, tiny.config)  # (pieces: 2+ cores)
    plain = worker_params._unstack_in_host_memory(tiny.params)
    assert split_columns(plain, num_cores=1) is plain  # one core: nothing to gain
    for lp, want in zip(params.layers, plain.layers, strict=True):
        for f in MATMUL_FIELDS:
            w = getattr(lp, f)
            assert isinstance(w, ColumnPieces) and w.shape == getattr(want, f).shape
            got = np.concatenate([np.asarray(p) for p in w.pieces], axis=1)
            assert np.array_equal(got, np.asarray(getattr(want, f)))
    assert split_columns(params) is not params and \
        split_columns(params).layers[0].wq == params.layers[0].wq  # idempotent


def test_piecewise_linear_equals_the_whole_matmul():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 100)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((3, 48)).astype(np.float32))
    pieces = ColumnPieces(tuple(jnp.asarray(b) for b in np.array_split(w, COLUMN_PIECES, 1)))
    with jax.default_matmul_precision("highest"):
        got, want = piecewise(dense_linear)(x, pieces), dense_linear(x, jnp.asarray(w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert piecewise(dense_linear)(x, jnp.asarray(w)).shape == (3, 100)
    with pytest.raises(ValueError, match="silu_mul"):
        piecewise(dense_linear)(x, pieces, "silu_mul")
