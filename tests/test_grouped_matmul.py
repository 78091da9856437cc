"""pallas_kernels.grouped_matmul (interpret mode on CPU) == its ragged_dot reference and
float64 numpy, over group layouts (empty groups, one group holding every row, sizes not
multiples of the row tile, rows past sum(group_sizes), 1 row, a few hundred rows),
float32 / bfloat16 and fp8 weights; its tile map and tiling choice; and the engine's
greedy tokens on tiny Mixtral / Qwen3-MoE equal with the kernel ("pallas-interpret") and
with ragged_dot ("xla").

Interpret mode starts every output buffer as NaN, so "no NaN anywhere" checks that every
output row was written (the zero rows past the groups included).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_checks import device_env
from test_qwen3 import greedy

import jprefix
from jprefix import LLM
from jprefix.worker import step_linear
from models.fp8_linear import dequantize_weight, quantize_weight
from pallas_kernels.grouped_matmul import (
    GmmTiling,
    check_inputs,
    gmm_tiling,
    grouped_matmul,
    grouped_matmul_reference,
    num_tiles,
    tile_metadata,
)

INTERPRET = jax.default_backend() == "cpu"
ROOT = Path(__file__).resolve().parents[1]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}  # relative L2 error vs float64


def numpy_grouped(x, w, sizes, rows):
    """float64 loop: group g's rows times w[g]; rows past the groups 0."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, start = np.zeros((rows, w.shape[2])), 0
    for g, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size] @ w[g]
        start += size
    return out


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "an output element was never written"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


T16 = GmmTiling(block_m=16, block_n=16, block_k=16)
T32 = GmmTiling(block_m=32, block_n=32, block_k=32)
# (group sizes, extra rows past them, K, N, tiling)
CASES = [
    ([3, 0, 20, 7], 2, 32, 48, T16),  # an empty group, ragged sizes, a zero tail
    ([0, 0, 37, 0], 0, 64, 32, T32),  # one group holds every row
    ([0, 1, 0], 0, 32, 64, T16),  # one row (a decode step, top-1)
    ([40, 0, 77, 3, 0, 100, 60, 20], 0, 64, 64, T32),  # 300 rows, 8 groups
    ([0, 0], 5, 16, 16, T16),  # no row in any group: all zeros
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes,extra,k,n,tiling", CASES)
def test_kernel_equals_reference(sizes, extra, k, n, tiling, dtype):
    rng = np.random.default_rng(len(sizes) + k)
    rows = sum(sizes) + extra
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    out = grouped_matmul(x, w, gs, tiling=tiling, interpret=INTERPRET)
    assert out.shape == (rows, n) and out.dtype == dtype
    want = numpy_grouped(x, w, sizes, rows)
    assert rel_err(out, want) < TOL[dtype]
    assert rel_err(grouped_matmul_reference(x, w, gs), want) < TOL[dtype]
    assert not np.asarray(out[sum(sizes):]).any()  # the rows past the groups: exactly 0


@pytest.mark.parametrize("sizes,extra,k,n,tiling", [CASES[0], CASES[3]])
def test_fp8_weights_scale_each_groups_columns(sizes, extra, k, n, tiling):
    """W8A16: fp8 [G, N, K] weights with per-(group, column) scales, bf16 activations."""
    rng = np.random.default_rng(7)
    rows = sum(sizes) + extra
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    scales = np.exp(rng.uniform(-2, 2, (len(sizes), 1, n)))  # columns of different sizes
    q = quantize_weight(jnp.asarray(rng.standard_normal((len(sizes), k, n)) * scales,
                                    jnp.float32))
    gs = jnp.asarray(sizes, jnp.int32)
    out = grouped_matmul(x, q.w8, gs, scale=q.scale, tiling=tiling, interpret=INTERPRET)
    want = numpy_grouped(x, dequantize_weight(q), sizes, rows)
    assert out.dtype == jnp.bfloat16 and rel_err(out, want) < TOL[jnp.bfloat16]
    ref = grouped_matmul_reference(x, q.w8, gs, scale=q.scale)
    assert rel_err(ref, want) < TOL[jnp.bfloat16]


def test_tiles_cover_each_row_once_within_one_group():
    rng = np.random.default_rng(3)
    metadata = jax.jit(tile_metadata, static_argnums=(1, 2))
    for _ in range(12):
        g, bm = int(rng.integers(1, 9)), int(rng.choice([16, 32, 64]))
        sizes = rng.integers(0, 90, g) * (rng.uniform(size=g) < 0.7)
        rows = int(sizes.sum() + rng.integers(1, 20))
        meta = np.asarray(metadata(jnp.asarray(sizes, jnp.int32), rows, bm))
        assert meta.shape == (num_tiles(rows, g, bm), 3)
        ends = np.concatenate([np.cumsum(sizes), [rows]])
        starts = np.concatenate([[0], ends[:-1]])
        covered = np.zeros(rows, int)
        for group, first, end in meta[meta[:, 0] >= 0]:
            assert (first - starts[group]) % bm == 0  # tiles start at the group's start
            assert starts[group] <= first < end == ends[group]
            covered[first:min(first + bm, end)] += 1
        assert (covered == 1).all()


def test_tiling_per_regime():
    decode = gmm_tiling(8, 2048, 1536, 128)  # one token, top-8 of 128 experts
    prefill = gmm_tiling(65536, 2048, 1536, 128)  # 8,192 tokens
    assert decode.block_m == 16 and prefill.block_m == 128
    assert gmm_tiling(64, 2048, 96, 8).block_n == 32  # N / tp: 96 columns
    assert gmm_tiling(64, 2048, 24, 8) is None  # no power-of-2 column tile >= 16


def test_bad_inputs_are_named():
    x, w = jnp.zeros((8, 32)), jnp.zeros((2, 32, 16))
    gs = jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="disagree on K"):
        check_inputs(x, jnp.zeros((2, 16, 16)), gs, T16)
    with pytest.raises(ValueError, match="group_sizes"):
        check_inputs(x, w, gs.astype(jnp.int16), T16)
    with pytest.raises(ValueError, match="block_n"):
        check_inputs(x, w, gs, GmmTiling(16, 32, 16))
    with pytest.raises(ValueError, match="scale"):
        check_inputs(x, jnp.zeros((2, 16, 32)), gs, T16, scale=jnp.ones((2, 16)))  # not fp8


@pytest.mark.parametrize("name,quantization", [("tiny-mixtral", None),
                                               ("tiny-qwen3-moe", "fp8")])
def test_engine_tokens_equal_with_the_kernel_and_ragged_dot(name, quantization, monkeypatch):
    """Greedy tokens of a prefill and decode steps: "pallas-interpret" (the kernel for
    every expert matmul, counted) == "xla" (ragged_dot). The dummy expert weights are
    scaled x8: at their std of 0.02 the experts barely move the tokens (a kernel reading
    the wrong expert gave the same tokens on tiny-qwen3-moe), at x8 that bug changes
    every sequence's. With fp8 the first layer's experts run the kernel's fp8 variant (the
    last layer's MLP stays in the model dtype)."""
    model = jprefix.load(name, dtype="float32", load_format="dummy")
    lp = model.params.layers
    lp = dataclasses.replace(lp, w_gate=lp.w_gate * 8, w_up=lp.w_up * 8, w_down=lp.w_down * 8)
    model = dataclasses.replace(model, params=dataclasses.replace(model.params, layers=lp))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (5, 19)]
    calls = []
    kernel = step_linear.gmm.grouped_matmul
    monkeypatch.setattr(step_linear.gmm, "grouped_matmul",
                        lambda *a, **kw: calls.append(kw["scale"] is not None) or kernel(*a, **kw))
    outs = {}
    for backend in ("xla", "pallas-interpret"):
        llm = LLM(model, block_size=8, num_kv_blocks=32, attention_backend=backend,
                  quantization=quantization)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, greedy(4), use_tqdm=False)]
    assert calls, "the engine never ran the grouped matmul kernel"
    assert any(calls) == (quantization == "fp8") and not all(calls)
    assert outs["pallas-interpret"] == outs["xla"]


TP_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from jprefix.worker import step_linear
from models.moe import experts

calls = []
kernel = step_linear.gmm.grouped_matmul
step_linear.gmm.grouped_matmul = lambda x, *a, **kw: calls.append(x.shape) or kernel(x, *a, **kw)
rng = np.random.default_rng(0)
t, k, g, e, f = 13, 3, 6, 48, 64
x = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
ids = jnp.asarray(np.stack([rng.choice(g, k, replace=False) for _ in range(t)]), jnp.int32)
weights = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
gate, up = (jnp.asarray(rng.standard_normal((g, e, f)) / 6, jnp.float32) for _ in range(2))
down = jnp.asarray(rng.standard_normal((g, f, e)) / 8, jnp.float32)
mesh = Mesh(jax.devices()[:2], ("tp",))
with jax.default_matmul_precision("highest"):
    want = np.asarray(experts(x, weights, ids, gate, up, down))
    got = step_linear.step_experts("pallas-interpret", mesh)(x, weights, ids, gate, up, down)
    fused = jnp.concatenate([gate[..., :32], up[..., :32], gate[..., 32:], up[..., 32:]], -1)
    got_fused = step_linear.step_experts("pallas-interpret", mesh)(x, weights, ids, fused,
                                                                    None, down)
assert calls and {s[1] for s in calls} == {e, f // 2}, calls  # down per shard: K = F / 2
for out in (got, got_fused):
    err = np.abs(np.asarray(out) - want).max()
    assert err < 1e-4 * np.abs(want).max(), err
print("ok")
"""


def test_kernel_runs_per_shard_under_tensor_parallelism():
    """2 virtual devices, each expert's F split: the kernel's partial sums (separate and
    per-shard fused [gate_s | up_s] weights) == one device's ragged_dot experts."""
    env = device_env(2)
    run = subprocess.run([sys.executable, "-c", TP_SCRIPT], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]


def test_bench_moe_smoke(tmp_path):
    """scripts/bench_moe.py --tiny: every variant runs, equals ragged_dot, and lands in
    the JSON with its bound."""
    from scripts import bench_moe

    out = tmp_path / "moe.json"
    result = bench_moe.main(["--tiny", "--models", "tiny-mixtral", "--tokens", "8",
                             "--reps", "3", "--budget-s", "0.05", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row == result["rows"][0] and not row["errors"]
    assert {"ragged_dot", "kernel"} <= set(row["ms"]) and row["bound_ms"] > 0
    assert max(row["rel_err"].values()) < 1e-5
