"""Cascade attention == plain paged attention over the full block tables == dense numpy.

Also: the kernel's `return_lse` == numpy logsumexp (causal and not, both tilings, key
splits, padding and keyless rows), and `merge_attention` == attention over the union of
the keys. Interpret mode starts outputs as NaN, so "no NaN" proves every row was written.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_walk import equations
from test_paged_attention import INTERPRET, TOL, dense_numpy, make_batch, rel_err

from pallas_kernels.cascade_attention import (
    FP8_DECODE_SUFFIX_BLOCK_SIZES,
    SUFFIX_BLOCK_SIZES,
    cascade_attention,
    cascade_attention_reference,
    default_suffix_block_sizes,
    merge_attention,
)
from pallas_kernels.fp8 import quantize_rows
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention_tiling import BlockSizes

SCALE = 0.3


def numpy_attention_lse(batch, scale, *, causal=True, soft_cap=None):
    """Per row (float64): out [T, H, D] and lse [T, H]; rows seeing no key: 0 and -inf."""
    q = np.asarray(batch["q"], np.float64)
    kc = np.asarray(batch["k_cache"], np.float64)[int(batch["layer"])]
    vc = np.asarray(batch["v_cache"], np.float64)[int(batch["layer"])]
    cu, kv_lens = np.asarray(batch["cu_q_lens"]), np.asarray(batch["kv_lens"])
    out, lse = np.zeros_like(q), np.full(q.shape[:2], -np.inf)
    group = q.shape[1] // kc.shape[0]
    for s, kv_len in enumerate(kv_lens):
        pages = np.asarray(batch["block_tables"])[s]
        keys = np.repeat(kc[:, pages].reshape(kc.shape[0], -1, kc.shape[-1]), group, 0)
        vals = np.repeat(vc[:, pages].reshape(vc.shape[0], -1, vc.shape[-1]), group, 0)
        for i, t in enumerate(range(cu[s], cu[s + 1])):
            n = kv_len - (cu[s + 1] - cu[s]) + i + 1 if causal else kv_len
            if n <= 0:
                continue
            x = np.einsum("hd,hjd->hj", q[t], keys[:, :n]) * scale
            if soft_cap is not None:
                x = soft_cap * np.tanh(x / soft_cap)
            lse[t] = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
            out[t] = np.einsum("hj,hjd->hd", np.exp(x - lse[t][:, None]), vals[:, :n])
    return out, lse


def check_lse(got, want, dtype):
    got = np.asarray(got)
    assert got.dtype == np.float32 and not np.isnan(got).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    tol = 1e-4 if dtype == jnp.float32 else 2e-3
    np.testing.assert_allclose(got[finite], want[finite], atol=tol, rtol=tol)


# -- log-sum-exp output -----------------------------------------------------------------

DECODE = [(1, 37), (1, 0), (1, 8), (0, 0), (1, 17), (1, 1)]  # incl. a keyless row
PREFILL = [(1, 37), (3, 0), (7, 7), (0, 0), (5, 21), (2, 9)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("max_q_len,kv_splits", [(1, None), (1, 3), (None, 1), (None, 2)])
def test_kernel_lse_matches_numpy_logsumexp(max_q_len, kv_splits, causal):
    seqs = DECODE if max_q_len == 1 else PREFILL
    batch = make_batch(np.random.default_rng(kv_splits or 5), seqs, head_dim=32)
    want_o, want_lse = numpy_attention_lse(batch, SCALE, causal=causal)
    out, lse = paged_attention(**batch, scale=SCALE, causal=causal, return_lse=True,
                               max_q_len=max_q_len, interpret=INTERPRET,
                               block_sizes=BlockSizes(kv_splits=kv_splits, block_q=16,
                                                      block_kv=8))
    ref_o, ref_lse = paged_attention_reference(**batch, scale=SCALE, causal=causal,
                                               return_lse=True)
    assert lse.shape == batch["q"].shape[:2] and not np.isnan(np.asarray(out)).any()
    for o, s in ((out, lse), (ref_o, ref_lse)):
        assert rel_err(o, want_o) < TOL[jnp.float32]
        check_lse(s, want_lse, jnp.float32)
    n = int(batch["cu_q_lens"][-1])
    assert np.all(np.asarray(out)[n:] == 0.0) and np.all(np.isneginf(np.asarray(lse)[n:]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lse_soft_cap_gqa(dtype):
    batch = make_batch(np.random.default_rng(9), PREFILL, heads=8, kv_heads=2,
                       head_dim=32, dtype=dtype)
    _, want_lse = numpy_attention_lse(batch, SCALE, causal=False, soft_cap=2.0)
    _, lse = paged_attention(**batch, scale=SCALE, soft_cap=2.0, causal=False,
                             return_lse=True, block_sizes=BlockSizes(block_q=16),
                             interpret=INTERPRET)
    check_lse(lse, want_lse, dtype)


def test_default_options_unchanged():
    batch = make_batch(np.random.default_rng(2), PREFILL, head_dim=32)
    bs = BlockSizes(block_q=16)
    plain = paged_attention(**batch, scale=SCALE, block_sizes=bs, interpret=INTERPRET)
    out, _ = paged_attention(**batch, scale=SCALE, block_sizes=bs, interpret=INTERPRET,
                             return_lse=True)
    np.testing.assert_array_equal(out, plain)
    assert rel_err(plain, numpy_attention_lse(batch, SCALE)[0]) < TOL[jnp.float32]


# -- merge ------------------------------------------------------------------------------

def _softmax_attention(x, v):  # x [T, H, J] logits, v [J, D]
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return np.exp(x - lse[..., None]) @ v, lse


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_equals_attention_over_union_of_keys(dtype):
    rng = np.random.default_rng(0)
    x, v = 3 * rng.standard_normal((5, 4, 24)), rng.standard_normal((24, 16))
    split = rng.permutation(24)
    a, b = split[:7], split[7:]
    o1, l1 = _softmax_attention(x[..., a], v[a])
    o2, l2 = _softmax_attention(x[..., b], v[b])
    want, want_lse = _softmax_attention(x, v)
    o, lse = merge_attention(jnp.asarray(o1, dtype), jnp.asarray(l1, jnp.float32),
                             jnp.asarray(o2, dtype), jnp.asarray(l2, jnp.float32))
    assert o.dtype == dtype and lse.dtype == jnp.float32
    assert rel_err(o, want) < TOL[dtype]
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)


def test_merge_with_keyless_sides():
    rng = np.random.default_rng(1)
    o = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
    lse = jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)
    zeros, none = jnp.zeros_like(o), jnp.full_like(lse, -jnp.inf)
    for args in ((o, lse, zeros, none), (zeros, none, o, lse)):
        got, got_lse = merge_attention(*args)
        np.testing.assert_array_equal(got, o)
        np.testing.assert_array_equal(got_lse, lse)
    got, got_lse = merge_attention(zeros, none, zeros, none)
    assert np.all(np.asarray(got) == 0.0) and np.all(np.isneginf(np.asarray(got_lse)))


# -- cascade ----------------------------------------------------------------------------

def make_cascade_batch(rng, groups, loners, *, lead=1, q_len=1, block_size=8, heads=4,
                       kv_heads=2, dtype=jnp.float32):
    """groups: (prefix blocks, [suffix kv_len per member]); loners: kv_lens in no group.

    Rows: `lead` loners, the groups' members, the other loners, a padding sequence, 3
    padding rows. Each sequence's last min(q_len, suffix) tokens are its queries.
    Returns (full-table batch for paged_attention, cascade keyword arguments).
    """
    seqs = ([(None, kv) for kv in loners[:lead]]
            + [(g, kv) for g, (_, kvs) in enumerate(groups) for kv in kvs]
            + [(None, kv) for kv in loners[lead:]] + [(None, 0)])
    prefix_lens = [0 if g is None else groups[g][0] * block_size for g, _ in seqs]
    batch = make_batch(rng, [(min(q_len, kv), p + kv) for p, (_, kv) in
                             zip(prefix_lens, seqs, strict=True)],
                       heads=heads, kv_heads=kv_heads, head_dim=32, block_size=block_size,
                       dtype=dtype)
    tables = np.asarray(batch["block_tables"]).copy()
    prefix_tables = np.zeros((len(groups), max(p for p, _ in groups) + 1), np.int32)
    for s, (g, _) in enumerate(seqs):  # members share their group's first member's prefix
        if g is not None:
            n = groups[g][0]
            if not prefix_tables[g].any():
                prefix_tables[g, :n] = tables[s, :n]
            tables[s, :n] = prefix_tables[g, :n]
    batch["block_tables"] = jnp.asarray(tables)
    suffix = np.zeros_like(tables)
    for s, p in enumerate(prefix_lens):
        suffix[s, :tables.shape[1] - p // block_size] = tables[s, p // block_size:]
    cu = np.asarray(batch["cu_q_lens"])
    rows = [sum(min(q_len, kv) for g2, kv in seqs if g2 == g) for g in range(len(groups))]
    cascade = dict(
        q=batch["q"], k_cache=batch["k_cache"], v_cache=batch["v_cache"],
        layer=batch["layer"], prefix_block_tables=jnp.asarray(prefix_tables),
        prefix_kv_lens=jnp.asarray([p * block_size for p, _ in groups], jnp.int32),
        prefix_cu_q_lens=jnp.asarray(cu[lead] + np.cumsum([0] + rows), jnp.int32),
        suffix_block_tables=jnp.asarray(suffix),
        suffix_kv_lens=jnp.asarray([kv for _, kv in seqs], jnp.int32),
        cu_q_lens=batch["cu_q_lens"])
    return batch, cascade


def check_cascade(batch, cascade, *, max_q_len=1, plain_kernel=True):
    dtype = batch["q"].dtype
    truth = dense_numpy(batch, SCALE)
    out = cascade_attention(**cascade, scale=SCALE, max_q_len=max_q_len, interpret=INTERPRET)
    assert out.shape == batch["q"].shape and out.dtype == dtype
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any(), "some output rows were never written"
    n = int(batch["cu_q_lens"][-1])
    assert np.all(out[n:] == 0.0), "padding rows must be zeros"
    others = [cascade_attention(**cascade, scale=SCALE, use_reference=True),
              cascade_attention_reference(**cascade, scale=SCALE),
              paged_attention_reference(**batch, scale=SCALE)]
    if plain_kernel:
        others.append(paged_attention(**batch, scale=SCALE, max_q_len=max_q_len,
                                      interpret=INTERPRET))
    for got in [out] + others:
        assert rel_err(got, truth) < TOL[dtype.type]
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, others[-1], rtol=1e-4, atol=1e-5)


# Group sizes 1, 3, 8 with 1-3 prefix blocks; suffixes from 1 token to over one block
# (block size 8 here); a keyless group (prefix 0) makes a gap; loners before and after.
GROUPS = [(2, [1]), (1, [3, 8, 9]), (0, [5]), (3, [1, 2, 7, 8, 9, 16, 17, 20])]
LONERS = [12, 1, 30]


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("dtype,block_size", [(jnp.float32, 8), (jnp.bfloat16, 16)])
def test_cascade_decode_matches_plain_and_dense(heads, kv_heads, dtype, block_size):
    groups = [(p, [kv if kv == 1 else kv * block_size // 8 for kv in kvs])
              for p, kvs in GROUPS]
    batch, cascade = make_cascade_batch(np.random.default_rng(heads), groups, LONERS,
                                        block_size=block_size, heads=heads,
                                        kv_heads=kv_heads, dtype=dtype)
    check_cascade(batch, cascade)


@pytest.mark.parametrize("lead", [0, 2])
def test_cascade_groups_anywhere_in_the_rows(lead):
    batch, cascade = make_cascade_batch(np.random.default_rng(lead), [(1, [4, 9]), (2, [3])],
                                        [6, 13, 2], lead=lead)
    check_cascade(batch, cascade, plain_kernel=False)


@pytest.mark.parametrize("max_q_len", [None, 1])
def test_cascade_chunk_of_new_tokens_after_shared_prefix(max_q_len):
    # q_len up to 6: a causal chunk in the suffix, attending the whole shared prefix.
    batch, cascade = make_cascade_batch(np.random.default_rng(7), GROUPS[:2] + GROUPS[3:],
                                        LONERS, q_len=6, heads=8, kv_heads=2)
    check_cascade(batch, cascade, max_q_len=max_q_len, plain_kernel=max_q_len is None)


def test_cascade_invalid_group_arrays_raise_value_error():
    _, cascade = make_cascade_batch(np.random.default_rng(0), [(1, [2])], [3])
    bad = {"prefix_kv_lens": jnp.zeros((2,), jnp.int32),
           "prefix_cu_q_lens": jnp.zeros((2,), jnp.float32),
           "prefix_block_tables": jnp.zeros((3,), jnp.int32)}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            cascade_attention(**{**cascade, name: value}, scale=1.0)


def _kernel_warps(fn, *args) -> list[int]:
    """num_warps of every pallas_call in fn's jaxpr, in order."""
    return [eqn.params["compiler_params"].num_warps
            for eqn in equations(fn, *args, primitive="pallas_call")]


def test_fp8_decode_suffix_takes_one_warp_one_page_steps():
    """Decoding over an fp8 cache, the suffix part leaves its knobs to the decode
    tiling's fp8 defaults (one warp; one-page steps on these <= 256-key tables: short
    suffixes are latency-bound); a 16-bit cache or a prefill-tiled suffix keep
    SUFFIX_BLOCK_SIZES. The fp8 cascade still equals the reference on the same cache."""
    batch, cascade = make_cascade_batch(np.random.default_rng(7), GROUPS[:2], LONERS[:1],
                                        block_size=16, dtype=jnp.bfloat16)
    k8, ks = quantize_rows(cascade["k_cache"], jnp.float8_e4m3fn)
    v8, vs = quantize_rows(cascade["v_cache"], jnp.float8_e4m3fn)
    assert cascade["suffix_block_tables"].shape[1] * 16 <= 256
    assert default_suffix_block_sizes(k8, 1) == FP8_DECODE_SUFFIX_BLOCK_SIZES
    assert default_suffix_block_sizes(k8, None) == SUFFIX_BLOCK_SIZES
    assert default_suffix_block_sizes(cascade["k_cache"], 1) == SUFFIX_BLOCK_SIZES
    fp8 = dict(cascade, k_cache=k8, v_cache=v8)

    def run(c, max_q_len, **kw):
        return cascade_attention(**c, **kw, scale=SCALE, max_q_len=max_q_len,
                                 interpret=INTERPRET)
    scales = dict(k_scale=ks, v_scale=vs)
    # the prefix part first, then the suffix part
    assert _kernel_warps(lambda c: run(c, 1, **scales), fp8)[-1] == 1
    assert 1 not in _kernel_warps(lambda c: run(c, None, **scales), fp8)
    assert 1 not in _kernel_warps(lambda c: run(c, 1), cascade)
    got = run(fp8, 1, **scales)
    want = cascade_attention_reference(**fp8, scale=SCALE, **scales)
    assert rel_err(got, want) < TOL[jnp.bfloat16]
