"""pallas_kernels.mgpu_paged_prefill (Mosaic GPU prefill attention).

CPU: the input refusals by name; the row tiles (`row_tiles`); Mosaic
GPU's lowering of the kernel for CUDA (run in Python on the CPU: shapes, TMA slices,
barriers, wgmma operands, layouts) over the configs, options and both lowering
semantics; a numpy model of the kernel's schedule (64-row warpgroup blocks from multiples of 8, key
steps of block_kv, unmasked steps then the causal edge, the ALiBi fold, the ragged
store) against `paged_attention_reference`. GPU (a Hopper GPU and jax >= 0.11.2, as
test_mgpu_fp8_matmul): the kernel against the reference over a prefill grid, the output
poisoned through the allocator first (a NaN array of the output's size is freed just
before each call, so an element the kernel never wrote most likely reads NaN)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import make_batch, rel_err

from pallas_kernels.backend import mosaic_available
from pallas_kernels.paged_attention import paged_attention_reference

absl = pytest.importorskip("absl", reason="Mosaic GPU's Python package imports absl")
mgpu = pytest.importorskip("pallas_kernels.mgpu_paged_prefill")

ON_HOPPER = mosaic_available()
C = mgpu.MgpuPrefillConfig
BF16 = jnp.bfloat16
CONFIGS = {"wg2": C(), "wg1": C(compute_wgs=1), "pingpong": C(pingpong=True),
           "kv64s3": C(block_kv=64, max_stages=3),
           "wg1kv64s4": C(compute_wgs=1, block_kv=64, max_stages=4)}
CASES = [
    [(6, 6), (1, 1), (13, 13)],  # plain prefill incl. a one-token prompt
    [(6, 30), (2, 17), (13, 14), (4, 18)],  # prefix cached, cutting through blocks
    [(1, 37), (7, 7), (0, 0), (12, 30), (1, 1), (5, 40)],  # + a padding sequence
    [(200, 200), (130, 723), (64, 64), (129, 1000)],  # several tiles, long prefixes
]


def batch(seqs, heads=4, kv_heads=2, block_size=16, seed=0):
    return make_batch(np.random.default_rng(seed), seqs, heads=heads, kv_heads=kv_heads,
                      head_dim=128, block_size=block_size, dtype=BF16)


def slopes_for(h):
    return jnp.asarray(2.0 ** -np.arange(1, h + 1), jnp.float32) * 0.5


# -- CPU: refusals, lowering, the schedule's model ---------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(k_scale=1), "fp8 KV cache"),
    (dict(sliding_window=8), "sliding_window"),
    (dict(soft_cap=30.0), "soft_cap 30.0"),
    (dict(causal=False), "causal=False"),
    (dict(return_lse=True), "return_lse"),
    (dict(scale=-1.0), "scale -1.0"),
    (dict(q=jnp.zeros((4, 2, 128), jnp.float32)), "float32"),
    (dict(q=jnp.zeros((4, 2, 64), BF16), k=jnp.zeros((1, 2, 4, 16, 64), BF16)), "head_dim"),
    (dict(k=jnp.zeros((1, 2, 4, 12, 128), BF16)), "block_size 12"),
    (dict(config=C(block_kv=32)), "block_kv must be 64 or 128"),
    (dict(config=C(compute_wgs=1, pingpong=True)), "pingpong needs compute_wgs 2"),
    (dict(config=C(max_stages=4)), "bytes of shared memory"),
])
def test_refused_by_name(kw, match):
    q = kw.pop("q", jnp.zeros((4, 2, 128), BF16))
    k = kw.pop("k", jnp.zeros((1, 2, 4, 16, 128), BF16))
    assert not mgpu.takes(q, k, **kw)
    with pytest.raises(ValueError, match=match):
        mgpu.check_inputs(q, k, **kw)
    assert mgpu.takes(jnp.zeros((4, 2, 128), BF16), jnp.zeros((1, 2, 4, 16, 128), BF16))


@pytest.mark.parametrize("change,kw,match", [
    (dict(q=lambda b: b["q"].astype(jnp.float32)), {}, "float32"),
    (dict(v_cache=lambda b: b["v_cache"][:, :, :-1]), {}, "v_cache"),
    (dict(q=lambda b: jnp.concatenate([b["q"], b["q"][:, :1]], 1)), {},
     r"query heads \(5\) must be a multiple of kv heads \(2\)"),
    ({}, dict(alibi_slopes=jnp.ones(3, jnp.float32)), r"alibi_slopes must be \[H\] = \[4\]"),
])
def test_call_refuses_what_it_cannot_take(change, kw, match):
    b = batch(CASES[0], block_size=8)
    b.update({k: f(b) for k, f in change.items()})
    with pytest.raises(ValueError, match=match):
        mgpu.mgpu_paged_prefill(**b, scale=0.1, **kw)


@pytest.mark.parametrize("config,alibi,heads", [
    pytest.param(CONFIGS[name], a, hh, id=f"{name}-alibi{int(a)}")
    for name, (a, hh) in itertools.product(CONFIGS, [(False, (4, 2)), (True, (8, 1))])])
@pytest.mark.parametrize("semantics", ["Warpgroup", "Lane"])
def test_lowers_for_cuda(config, alibi, heads, semantics, monkeypatch):
    """Mosaic GPU's lowering (Python, on the CPU) accepts the kernel under either
    lowering semantics: every TMA slice, barrier, wgmma operand and register layout
    type-checks for CUDA (with Warpgroup semantics, layout inference solves)."""
    monkeypatch.setattr(mgpu, "LOWERING", getattr(mgpu.plgpu.LoweringSemantics, semantics))
    sd = jax.ShapeDtypeStruct
    t, h, cache = 300, heads[0], (2, heads[1], 64, 16, 128)
    args = (sd((t, h, 128), BF16), sd(cache, BF16), sd(cache, BF16), sd((), jnp.int32),
            sd((3, 12), jnp.int32), sd((3,), jnp.int32), sd((4,), jnp.int32))
    kw = dict(alibi_slopes=sd((h,), jnp.float32)) if alibi else {}
    traced = mgpu.mgpu_paged_prefill.trace(*args, scale=0.1, config=config, **kw)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def tiled_model(b, scale, config, slopes=None):
    """The kernel's schedule in numpy (float32, P rounded to bf16 as the kernel feeds
    it to wgmma): per tile x head x warpgroup, the aligned query rows, key steps, masks
    and store of `mgpu_paged_prefill_kernel`. Rows no tile stores stay NaN."""
    q = np.asarray(b["q"], np.float32)
    layer = int(b["layer"])
    kc, vc = (np.asarray(b[n], np.float32)[layer] for n in ("k_cache", "v_cache"))
    t, h, d = q.shape
    kh, bs, bkv = kc.shape[0], kc.shape[2], config.block_kv
    pages = bkv // bs
    tables = np.asarray(b["block_tables"])
    tables = np.pad(tables, ((0, 0), (0, -tables.shape[1] % pages)))
    meta = np.asarray(mgpu.row_tiles(b["cu_q_lens"], b["kv_lens"], t, config.block_q))
    out = np.full((t, h, d), np.nan, np.float32)
    unit = scale * np.log2(np.e)
    for seq, row8, lo, n, pos0, kv_len in meta:
        kv_hi = max(min(pos0 + lo + n, kv_len), 0)
        n_steps = min(-(-kv_hi // bkv), tables.shape[1] // pages)
        n_full = min(max(pos0 + lo + 1, 0) // bkv, n_steps)
        for head, w in itertools.product(range(h) if n else [], range(config.compute_wgs)):
            rows = row8 * 8 + w * 64 + np.arange(64)
            qt = np.where((rows < t)[:, None], q[np.minimum(rows, t - 1), head], 0.0)
            acc, m, l_sum = np.zeros((64, d)), np.full(64, -1e30), np.zeros(64)
            q_pos = pos0 + w * 64 + np.arange(64)
            for j in range(n_steps):
                ids = tables[seq, j * pages:(j + 1) * pages]
                keys, vals = (c[head // (h // kh), ids].reshape(bkv, d) for c in (kc, vc))
                s = qt @ keys.T
                k_pos = j * bkv + np.arange(bkv)
                if slopes is not None:
                    s = s + (k_pos[None] - q_pos[0]) * (float(slopes[head]) / scale)
                if j >= n_full:
                    s = np.where(q_pos[:, None] >= k_pos[None], s, -np.inf)
                m_new = np.maximum(m, s.max(1) * unit)
                p = np.exp2(s * unit - m_new[:, None])
                alpha = np.exp2(m - m_new)
                l_sum = l_sum * alpha + p.sum(1)
                p16 = np.asarray(jnp.asarray(p, BF16), np.float32)
                acc, m = acc * alpha[:, None] + p16 @ vals, m_new
            first = max(lo - w * 64, 0)
            stored = slice(first, max(min(lo + n - w * 64, 64), first))
            assert np.isnan(out[rows[stored], head]).all(), "a row stored twice"
            out[rows[stored], head] = (acc / np.maximum(l_sum, 1e-30)[:, None])[stored]
    return out


@pytest.mark.parametrize("seqs,t,block_q", [
    ([5, 0, 70, 1, 64, 200], 350, 128), ([5, 0, 70, 1, 64, 200], 340, 64),
    ([128, 128], 256, 128), ([3], 3, 64), ([0, 0], 9, 128), ([7] * 9, 70, 64)])
def test_row_tiles(seqs, t, block_q):
    """Every row is one tile's, at its sequence's position; tiles start at multiples of
    8 at most 7 rows before their sequence; tiles past the last are empty."""
    cu = np.concatenate([[0], np.cumsum(seqs)]).astype(np.int32)
    kv = np.asarray(seqs, np.int32) + 7
    meta = np.asarray(mgpu.row_tiles(jnp.asarray(cu), jnp.asarray(kv), t, block_q))
    assert meta.shape == (mgpu.max_tiles(t, len(seqs), block_q), 6)
    owner = np.full(t, -1)
    for seq, row8, lo, n, pos0, kv_len in meta:
        rows = row8 * 8 + np.arange(lo, lo + n)
        assert (owner[rows] == -1).all() and 0 <= lo and lo + n <= block_q
        owner[rows] = seq if kv_len else len(seqs)
        if kv_len:  # row i of the tile at position pos0 + i: the last q_len of kv_len
            assert (cu[seq] <= rows).all() and (rows < cu[seq + 1]).all()
            assert row8 * 8 + 8 > cu[seq]
            np.testing.assert_array_equal(pos0 + rows - row8 * 8,
                                          kv[seq] - seqs[seq] + rows - cu[seq])
    want = np.searchsorted(cu[1:], np.arange(t), side="right")
    np.testing.assert_array_equal(owner, want)
    ends = [*cu[1:], t]
    tiles = [-(-(e - s0 + s0 % 8) // block_q) for s0, e in zip(cu, ends, strict=True) if e > s0]
    assert (meta[:, 3] > 0).sum() == sum(tiles)  # (no tile without a stored row)


@pytest.mark.parametrize("case,config,alibi", [
    (CASES[1], C(), False), (CASES[2], C(compute_wgs=1, block_kv=64), True),
    (CASES[3][:2], C(block_kv=64), False), (CASES[3][2:], C(), True)])
def test_tiled_model_matches_reference(case, config, alibi):
    """The schedule (tile metadata, step counts, unmasked steps, the causal edge, the
    ALiBi bias over the scale, l = 0 rows) computes `paged_attention`'s function."""
    b = batch(case, heads=4, kv_heads=2, seed=len(case))
    slopes = slopes_for(4) if alibi else None
    ref = np.asarray(paged_attention_reference(**b, scale=0.09, alibi_slopes=slopes),
                     np.float32)
    out = tiled_model(b, 0.09, config, slopes)
    assert not np.isnan(out).any(), "a row no tile stores"
    n = int(b["cu_q_lens"][-1])
    assert np.all(out[n:] == 0.0)
    assert rel_err(out[:n], ref[:n]) < 1e-2


# -- GPU: the kernel ---------------------------------------------------------------------

def check_kernel(b, config, slopes=None, scale=0.09):
    ref = paged_attention_reference(**b, scale=scale, alibi_slopes=slopes)
    poison = jnp.full(b["q"].shape, jnp.nan, BF16).block_until_ready()
    del poison
    out = mgpu.mgpu_paged_prefill(**b, scale=scale, alibi_slopes=slopes, config=config)
    assert out.shape == b["q"].shape and out.dtype == BF16
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any(), "some output rows were never written"
    n = int(b["cu_q_lens"][-1])
    assert np.all(out[n:] == 0.0), "padding rows must be zeros"
    assert rel_err(out[:n], ref[:n]) < 2e-2


needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="Mosaic GPU kernels need a Hopper GPU")


@needs_hopper
@pytest.mark.parametrize("case,heads,config", [
    pytest.param(c, hh, CONFIGS[name], id=f"case{c}-h{hh[0]}k{hh[1]}-{name}")
    for c, hh, name in itertools.product(range(len(CASES)), [(4, 4), (8, 2), (8, 1)],
                                         CONFIGS)])
def test_kernel_matches_reference(case, heads, config):
    check_kernel(batch(CASES[case], heads=heads[0], kv_heads=heads[1], seed=case), config)


@needs_hopper
@pytest.mark.parametrize("config", [C(), C(pingpong=True), C(compute_wgs=1, block_kv=64)],
                         ids=["wg2", "pingpong", "wg1kv64"])
@pytest.mark.parametrize("case", [1, 3])
def test_kernel_alibi(case, config):
    check_kernel(batch(CASES[case], heads=8, kv_heads=8, seed=case), config, slopes_for(8))


@needs_hopper
@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_kernel_block_sizes(block_size):
    check_kernel(batch(CASES[3], heads=4, kv_heads=2, block_size=block_size, seed=3), C())


@needs_hopper
def test_kernel_few_tokens():
    """Fewer tokens than one tile (the Q rows padded to 64) and T not a multiple of 8."""
    b = batch([(3, 3), (2, 20)], heads=4, kv_heads=2)
    assert b["q"].shape[0] == 8  # 5 rows + 3 padding rows
    b["q"] = b["q"][:7]
    check_kernel(b, C())


@needs_hopper
@pytest.mark.parametrize("num_decode", [None, 0, 2])
def test_backend_routes_to_the_kernel_when_forced(monkeypatch, num_decode):
    """`backend.prefill_attention_mosaic` under the override: the jitted program holds
    the Mosaic GPU kernel, and with a mixed step's decode rows (the Triton decode
    tiling) the whole batch equals the reference."""
    from pallas_kernels import backend

    monkeypatch.setenv(backend.ENV_VAR, "prefill_attention=mosaic")
    b = batch([(1, 37), (1, 5), (12, 30), (7, 7), (130, 300)], heads=8, kv_heads=2, seed=4)
    nd = None if num_decode is None else jnp.int32(num_decode)
    fn = jax.jit(lambda x: backend.prefill_attention_mosaic(**x, scale=0.09, num_decode=nd))
    assert "mosaic_gpu" in fn.lower(b).as_text()
    out = np.asarray(fn(b), np.float32)
    ref = paged_attention_reference(**b, scale=0.09)
    n = int(b["cu_q_lens"][-1])
    assert not np.isnan(out[:n]).any()
    assert rel_err(out[:n], ref[:n]) < 2e-2


@needs_hopper
def test_engine_greedy_outputs_with_the_mosaic_kernel(monkeypatch):
    """The engine with prefill attention forced onto Mosaic GPU against Triton forced:
    40 prompts over 4 shared prefixes in a pool small enough to evict and preempt, a
    model of head_dim 128 in bf16 with attention weights x8 (so tokens depend on what
    each row attends). Greedy tokens equal, except after a near tie in Triton's run (top
    two logprobs within 0.05: bf16 rounding may order them either way); at most 2."""
    import dataclasses

    from jprefix import LLM, SamplingParams, load
    from models.config import ModelConfig
    from pallas_kernels import backend

    cfg = ModelConfig("llama", 512, 512, 1024, 2, 4, 2, 128, max_position_embeddings=1024)
    model = load(cfg, dtype="bfloat16", load_format="dummy")
    lp = model.params.layers
    sharp = dataclasses.replace(lp, wq=lp.wq * 8, wk=lp.wk * 8, wv=lp.wv * 8, wo=lp.wo * 8)
    model = dataclasses.replace(model, params=dataclasses.replace(model.params, layers=sharp))
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(3, 512, int(n)).tolist() for n in (64, 200, 37, 300)]
    prompts = [prefixes[i % 4] + rng.integers(3, 512, int(rng.integers(1, 90))).tolist()
               for i in range(40)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for name in ("triton", "mosaic"):
        monkeypatch.setenv(backend.ENV_VAR, f"prefill_attention={name}")
        llm = LLM(model, block_size=16, num_kv_blocks=96, max_num_seqs=16,
                  max_num_batched_tokens=1024)
        runs[name] = llm.generate(prompts, sp, use_tqdm=False)
        assert llm.engine.stats.num_preemptions > 0 or name == "triton"
        del llm
    differ = 0
    for t, m in zip(runs["triton"], runs["mosaic"], strict=True):
        if t.token_ids == m.token_ids:
            continue
        i = next(j for j, (a, b) in enumerate(zip(t.token_ids, m.token_ids, strict=True)) if a != b)
        top = sorted((lp.logprob for lp in t.logprobs[i].values()), reverse=True)
        assert top[0] - top[1] < 0.05, (i, top)
        differ += 1
    assert differ <= 2
