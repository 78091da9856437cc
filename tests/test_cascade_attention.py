"""Cascade attention == plain paged attention over the full block tables == dense numpy.

Also: the kernel's `return_lse` == numpy logsumexp (causal and not, both tilings, key
splits, padding and keyless rows), and `merge_attention` == attention over the union of
the keys. Interpret mode starts outputs as NaN, so "no NaN" proves every row was written.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    GROUPS,
    INTERPRET,
    LONERS,
    TOL,
    check_output,
    dense_attention,
    make_batch,
    make_cascade_batch,
    rel_err,
)
from jaxpr_walk import equations

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
    want_o, want_lse = dense_attention(batch, SCALE, causal=causal)
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
    _, want_lse = dense_attention(batch, SCALE, causal=False, soft_cap=2.0)
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
    assert rel_err(plain, dense_attention(batch, SCALE)[0]) < TOL[jnp.float32]


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

def check_cascade(batch, cascade, *, max_q_len=1, plain_kernel=True):
    dtype = batch["q"].dtype
    truth = dense_attention(batch, SCALE)[0]
    out = cascade_attention(**cascade, scale=SCALE, max_q_len=max_q_len, interpret=INTERPRET)
    out = check_output(out, truth, batch)
    others = [cascade_attention(**cascade, scale=SCALE, use_reference=True),
              cascade_attention_reference(**cascade, scale=SCALE),
              paged_attention_reference(**batch, scale=SCALE)]
    if plain_kernel:
        others.append(paged_attention(**batch, scale=SCALE, max_q_len=max_q_len,
                                      interpret=INTERPRET))
    for got in others:
        assert rel_err(got, truth) < TOL[dtype.type]
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, others[-1], rtol=1e-4, atol=1e-5)


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
