"""ALiBi in every attention op == a dense float64 reference with the bias
`slope_h * (k_pos - q_pos)` on causal scores.

Covers the slopes (power-of-2 and Baichuan2-13B's 40 heads), the jnp reference and
cascade's reference path, and the Pallas kernels (interpret mode on CPU: outputs start as
NaN, so "no NaN" proves every row was written) over decode, prefill, prefix-cached and
mixed batches, key splits and cascade groups.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    GROUPS,
    INTERPRET,
    LONERS,
    MIXED,
    check_output,
    dense_attention,
    make_batch,
    make_cascade_batch,
    mixed_step_seqs,
    quantize_batch,
    random_ragged_seqs,
    rel_err,
)

from models.alibi import alibi_slopes
from pallas_kernels.cascade_attention import cascade_attention, cascade_attention_reference
from pallas_kernels.fp8 import FP8_DTYPES
from pallas_kernels.paged_attention import (
    mixed_paged_attention,
    paged_attention,
    paged_attention_reference,
)
from pallas_kernels.paged_attention_tiling import BlockSizes

SCALE = 0.3
# (heads, kv_heads): Baichuan2-13B's 40 heads (MHA, and GQA groups of 5 padded to 8),
# power-of-2 head counts with GQA groups of 4 and 1
HEADS = [(40, 40), (40, 8), (8, 2), (4, 4)]
DECODE = [(1, 37), (1, 1), (1, 8), (1, 9), (0, 0)]
PREFILL = [(6, 6), (1, 1), (13, 13)]
CACHED = [(6, 30), (2, 17), (13, 14), (4, 18)]  # prefix cached: part, most, almost all


def dense_alibi(batch, slopes, **kw):
    """Independent check (float64): out [T, H, D] and lse [T, H] of attention with the
    bias slope_h * (k_pos - q_pos) (attention_cases.dense_attention)."""
    return dense_attention(batch, SCALE, slopes=slopes, **kw)


def alibi_batch(seed, seqs, heads, kv_heads, dtype=jnp.float32, **kw):
    batch = make_batch(np.random.default_rng(seed), seqs, heads=heads, kv_heads=kv_heads,
                       head_dim=32, dtype=dtype, **kw)
    return batch, jnp.asarray(alibi_slopes(heads))


# -- slopes -------------------------------------------------------------------------------

def test_power_of_2_slopes_are_the_geometric_sequence():
    np.testing.assert_array_equal(alibi_slopes(8), 0.5 ** np.arange(1, 9, dtype=np.float32))
    np.testing.assert_allclose(alibi_slopes(32), 2.0 ** (-np.arange(1, 33) / 4), rtol=1e-7)
    assert alibi_slopes(1).tolist() == [2.0 ** -8]
    assert alibi_slopes(4).dtype == np.float32


def test_40_heads_take_32_heads_slopes_then_every_other_of_64():
    slopes = alibi_slopes(40)
    assert slopes.shape == (40,) and slopes.dtype == np.float32
    np.testing.assert_array_equal(slopes[:32], alibi_slopes(32))
    np.testing.assert_array_equal(slopes[32:], alibi_slopes(64)[0:16:2])
    np.testing.assert_allclose(slopes[32:], 2.0 ** (-np.arange(1, 16, 2) / 8), rtol=1e-7)


@pytest.mark.parametrize("n", [3, 5, 6, 12, 20, 40, 52])
def test_other_head_counts_follow_the_interleave_rule(n):
    p = 1 << (n.bit_length() - 1)
    want = list(alibi_slopes(p)) + list(alibi_slopes(2 * p)[0::2][: n - p])
    np.testing.assert_array_equal(alibi_slopes(n), np.asarray(want, np.float32))


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_bad_head_count_raises_value_error(bad):
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(bad)


# -- reference paths ----------------------------------------------------------------------

@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("seqs", [MIXED, DECODE, PREFILL, CACHED])
def test_reference_matches_dense_alibi(seqs, heads, kv_heads, soft_cap):
    batch, slopes = alibi_batch(len(seqs) + heads, seqs, heads, kv_heads)
    out, lse = paged_attention_reference(**batch, scale=SCALE, soft_cap=soft_cap,
                                         alibi_slopes=slopes, return_lse=True)
    want, want_lse = dense_alibi(batch, slopes, soft_cap=soft_cap)
    assert rel_err(out, want) < 1e-5
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    # the bias matters: without it the output is far from the ALiBi truth
    assert rel_err(paged_attention_reference(**batch, scale=SCALE, soft_cap=soft_cap), want) \
        > 1e-2


def test_reference_non_causal_rows_sit_after_their_keys():
    batch, slopes = alibi_batch(5, MIXED, 8, 2)
    out, lse = paged_attention_reference(**batch, scale=SCALE, alibi_slopes=slopes,
                                         causal=False, return_lse=True)
    want, want_lse = dense_alibi(batch, slopes, causal=False)
    assert rel_err(out, want) < 1e-5
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


def test_reference_token_chunks_agree_with_alibi():
    batch, slopes = alibi_batch(1, MIXED, 40, 8)
    whole = paged_attention_reference(**batch, scale=SCALE, alibi_slopes=slopes)
    chunked = paged_attention_reference(**batch, scale=SCALE, alibi_slopes=slopes,
                                        token_chunk=4)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-6)


def cached_and_uncached(seed, kv_len, q_len, heads, kv_heads, dtype=jnp.float32):
    """One prompt of kv_len tokens prefilled whole, and its last q_len tokens prefilled
    against the cached rest (same cache, same pages). Returns (whole, cached) batches."""
    whole, slopes = alibi_batch(seed, [(kv_len, kv_len)], heads, kv_heads, dtype,
                                extra_rows=0)
    cached = dict(whole, q=whole["q"][kv_len - q_len:],
                  cu_q_lens=jnp.asarray([0, q_len], jnp.int32))
    return whole, cached, slopes


@pytest.mark.parametrize("heads,kv_heads", [(40, 40), (8, 2)])
def test_reference_cached_prefix_equals_uncached_prefill(heads, kv_heads):
    whole, cached, slopes = cached_and_uncached(9, 45, 7, heads, kv_heads)
    full = paged_attention_reference(**whole, scale=SCALE, alibi_slopes=slopes)
    part = paged_attention_reference(**cached, scale=SCALE, alibi_slopes=slopes)
    np.testing.assert_allclose(part, full[-7:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_len", [1, 6])
@pytest.mark.parametrize("heads,kv_heads", [(40, 40), (40, 8), (8, 2)])
def test_cascade_reference_paths_match_dense_alibi(heads, kv_heads, q_len):
    batch, cascade = make_cascade_batch(np.random.default_rng(heads + q_len), GROUPS, LONERS,
                                        q_len=q_len, heads=heads, kv_heads=kv_heads)
    slopes = jnp.asarray(alibi_slopes(heads))
    want = dense_alibi(batch, slopes)[0]
    composed = cascade_attention(**cascade, scale=SCALE, use_reference=True,
                                 alibi_slopes=slopes)
    dense = cascade_attention_reference(**cascade, scale=SCALE, alibi_slopes=slopes)
    plain = paged_attention_reference(**batch, scale=SCALE, alibi_slopes=slopes)
    for got in (composed, dense, plain):
        assert rel_err(got, want) < 1e-5
    np.testing.assert_allclose(composed, plain, rtol=1e-4, atol=1e-5)


# -- Pallas kernels -----------------------------------------------------------------------

def check_kernel(batch, slopes, *, soft_cap=None, max_q_len=None, **knobs):
    out = paged_attention(**batch, scale=SCALE, soft_cap=soft_cap, interpret=INTERPRET,
                          max_q_len=max_q_len, block_sizes=BlockSizes(**knobs),
                          alibi_slopes=slopes)
    check_output(out, dense_alibi(batch, slopes, soft_cap=soft_cap)[0], batch)


@pytest.mark.parametrize("max_q_len", [None, 1])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("seqs", [DECODE, PREFILL, CACHED, MIXED])
def test_kernel_matches_dense_alibi(seqs, heads, kv_heads, max_q_len):
    batch, slopes = alibi_batch(len(seqs) + heads, seqs, heads, kv_heads)
    check_kernel(batch, slopes, max_q_len=max_q_len, block_q=16, block_kv=16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("max_q_len,knobs", [  # (16-key steps: the 16-bit dot's least)
    (1, {"kv_splits": 2, "block_kv": 16}),  # decode, split key range
    (1, {"kv_splits": 4, "block_kv": 16, "single_loop": True}),
    (None, {"kv_splits": 3, "block_kv": 16}),  # prefill, split key range
    (None, {"block_q": 16, "block_kv": 16, "mask_kv": False}),
    (None, {"block_q": 32, "soft_cap": 5.0}),  # (the bias not folded into the scale)
])
def test_kernel_alibi_splits_and_variants(max_q_len, knobs, dtype):
    seqs = MIXED + [(1, 64), (5, 41)]
    batch, slopes = alibi_batch(21, seqs, 40, 8, dtype)
    check_kernel(batch, slopes, max_q_len=max_q_len, **knobs)


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_alibi_random_ragged_batches(seed):
    # One-page key steps put the causal and length edges at every offset.
    seqs = random_ragged_seqs(np.random.default_rng(2000 + seed))
    batch, slopes = alibi_batch(seed, seqs, 40, 40)
    check_kernel(batch, slopes, block_q=16, block_kv=8)


@pytest.mark.parametrize("heads,kv_heads,hp,knobs", [
    (40, 40, 8, {"kv_splits": 2, "block_kv": 32}),
    (8, 4, 2, {"soft_cap": 5.0}),
    (12, 4, 4, {"block_kv": 16}),  # group 3 padded to 4
])
def test_kernel_alibi_heads_per_tile(heads, kv_heads, hp, knobs):
    seqs = [(1, 37), (1, 3), (0, 0), (4, 20), (1, 1), (1, 64)]
    batch, slopes = alibi_batch(hp + heads, seqs, heads, kv_heads)
    check_kernel(batch, slopes, max_q_len=1, heads_per_tile=hp, **knobs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_decode", [0, 3, 6])
def test_mixed_step_alibi(num_decode, dtype):
    seqs = mixed_step_seqs(np.random.default_rng(90 + num_decode), num_decode)
    batch, slopes = alibi_batch(num_decode, seqs + [(0, 0)], 40, 8, dtype)
    out = mixed_paged_attention(**batch, num_decode=jnp.int32(num_decode), scale=SCALE,
                                interpret=INTERPRET, alibi_slopes=slopes)
    check_output(out, dense_alibi(batch, slopes)[0], batch)


@pytest.mark.parametrize("max_q_len", [None, 1])
@pytest.mark.parametrize("heads,kv_heads", [(40, 40), (8, 2)])
def test_kernel_cached_prefix_equals_uncached_prefill(heads, kv_heads, max_q_len):
    whole, cached, slopes = cached_and_uncached(4, 45, 7, heads, kv_heads)
    kw = dict(scale=SCALE, interpret=INTERPRET, alibi_slopes=slopes)
    full = paged_attention(**whole, **kw, block_sizes=BlockSizes(block_q=32))
    part = paged_attention(**cached, **kw, max_q_len=max_q_len)
    # (other tiles, other float32 rounding: as close as two kernel tilings get)
    np.testing.assert_allclose(part, full[-7:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("max_q_len,kv_splits", [(1, 3), (None, 1), (None, 2)])
def test_kernel_non_causal_lse_with_alibi(max_q_len, kv_splits):
    batch, slopes = alibi_batch(31, MIXED + [(3, 0)], 40, 8)
    out, lse = paged_attention(**batch, scale=SCALE, interpret=INTERPRET, causal=False,
                               return_lse=True, max_q_len=max_q_len, alibi_slopes=slopes,
                               block_sizes=BlockSizes(block_q=16, kv_splits=kv_splits))
    want, want_lse = dense_alibi(batch, slopes, causal=False)
    check_output(out, want, batch)
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), ~finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("lead,max_q_len,q_len", [(1, 1, 1), (0, None, 6), (2, 1, 6)])
@pytest.mark.parametrize("heads,kv_heads,dtype,block_size", [
    (40, 40, jnp.float32, 8), (40, 8, jnp.bfloat16, 16), (8, 2, jnp.float32, 8)])
def test_cascade_kernel_equals_paged_attention_over_full_tables(
        heads, kv_heads, dtype, block_size, lead, max_q_len, q_len):
    groups = [(p, [kv if kv == 1 else kv * block_size // 8 for kv in kvs])
              for p, kvs in GROUPS]
    batch, cascade = make_cascade_batch(np.random.default_rng(heads + q_len), groups, LONERS,
                                        lead=lead, q_len=q_len, block_size=block_size,
                                        heads=heads, kv_heads=kv_heads, dtype=dtype)
    slopes = jnp.asarray(alibi_slopes(heads))
    out = cascade_attention(**cascade, scale=SCALE, max_q_len=max_q_len,
                            interpret=INTERPRET, alibi_slopes=slopes)
    check_output(out, dense_alibi(batch, slopes)[0], batch)
    plain = paged_attention(**batch, scale=SCALE, interpret=INTERPRET, alibi_slopes=slopes)
    check_output(plain, dense_alibi(batch, slopes)[0], batch)
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, plain, rtol=1e-4, atol=1e-5)


# -- validation ---------------------------------------------------------------------------

BAD_SLOPES = {
    "length": jnp.ones((7,), jnp.float32),
    "rank": jnp.ones((1, 8), jnp.float32),
    "dtype": jnp.ones((8,), jnp.bfloat16),
}


@pytest.mark.parametrize("bad", sorted(BAD_SLOPES))
def test_bad_slopes_raise_value_error(bad):
    batch, _ = alibi_batch(0, [(2, 5)], 8, 2)
    for fn in (paged_attention_reference, paged_attention):
        with pytest.raises(ValueError, match="alibi_slopes"):
            fn(**batch, scale=SCALE, alibi_slopes=BAD_SLOPES[bad])
    with pytest.raises(ValueError, match="alibi_slopes"):
        mixed_paged_attention(**batch, num_decode=jnp.int32(0), scale=SCALE,
                              alibi_slopes=BAD_SLOPES[bad])
    _, cascade = make_cascade_batch(np.random.default_rng(0), [(1, [2])], [3], heads=8)
    for use_reference in (True, False):
        with pytest.raises(ValueError, match="alibi_slopes"):
            cascade_attention(**cascade, scale=SCALE, use_reference=use_reference,
                              alibi_slopes=BAD_SLOPES[bad])


@pytest.mark.parametrize("max_q_len", [None, 1])
def test_kernel_alibi_on_fp8_cache(max_q_len):
    batch, slopes = alibi_batch(77, MIXED + [(1, 64)], 40, 8, jnp.bfloat16)
    fp8_batch, deq = quantize_batch(batch, FP8_DTYPES[0])
    out = paged_attention(**fp8_batch, scale=SCALE, interpret=INTERPRET, max_q_len=max_q_len,
                          alibi_slopes=slopes,
                          block_sizes=BlockSizes(block_q=16, block_kv=16))
    check_output(out, dense_alibi(deq, slopes)[0], batch)

