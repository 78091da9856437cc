"""paged_attention (Pallas, interpret mode) == paged_attention_reference == dense numpy.

Interpret mode starts every output buffer as NaN, so "no NaN anywhere" is the check that
every row was written; padding rows must be exact zeros. On a GPU backend the same tests
run the compiled Triton kernel instead.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

# (test_kernel_backend and test_mgpu_paged_prefill import make_batch and rel_err from here)
from attention_cases import (
    INTERPRET,
    MIXED,
    TOL,
    check_output,
    dense_attention,
    make_batch,
    mixed_step_seqs,
    random_ragged_seqs,
    rel_err,
)

from pallas_kernels.paged_attention import (
    mixed_paged_attention,
    paged_attention,
    paged_attention_reference,
)
from pallas_kernels.paged_attention_tiling import BlockSizes


def check_kernel(batch, *, scale=0.3, soft_cap=None, max_q_len=None, **knobs):
    ref = paged_attention_reference(**batch, scale=scale, soft_cap=soft_cap)
    out = paged_attention(**batch, scale=scale, soft_cap=soft_cap, interpret=INTERPRET,
                          max_q_len=max_q_len, block_sizes=BlockSizes(**knobs))
    check_output(out, ref, batch)


# -- reference against dense attention ------------------------------------------------

@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("seqs", [MIXED, [(1, 9), (1, 16), (1, 3)], [(20, 20)]])
def test_reference_matches_dense_attention(seqs, soft_cap):
    rng = np.random.default_rng(len(seqs) + int(soft_cap or 0))
    batch = make_batch(rng, seqs, heads=6, kv_heads=2)
    ref = paged_attention_reference(**batch, scale=0.3, soft_cap=soft_cap)
    assert rel_err(ref, dense_attention(batch, 0.3, soft_cap=soft_cap)[0]) < 1e-5


def test_reference_token_chunks_agree():
    batch = make_batch(np.random.default_rng(1), MIXED)
    whole = paged_attention_reference(**batch, scale=0.3)
    chunked = paged_attention_reference(**batch, scale=0.3, token_chunk=4)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-6)


# -- kernel against the reference ------------------------------------------------------

@pytest.mark.parametrize("max_q_len", [None, 1])
@pytest.mark.parametrize("case", [
    [(1, 37), (1, 1), (1, 8), (1, 9), (0, 0)],  # decode, one-token prompt, block edges
    [(6, 6), (1, 1), (13, 13)],  # plain prefill incl. a one-token prompt
    [(6, 30), (2, 17), (13, 14), (4, 18)],  # prefix cached: part, most, almost all
    MIXED,  # mixed decode + prefill + padding sequence + padding rows
])
def test_kernel_matches_reference_ragged_batches(case, max_q_len):
    check_kernel(make_batch(np.random.default_rng(len(case)), case), max_q_len=max_q_len,
                 block_q=16, block_kv=16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_decode", [0, 1, 4, 6])
def test_mixed_step_tilings_match_reference(num_decode, dtype):
    """A step of decodes (first) and prefill chunks: decode rows with the decode tiling,
    the rest with the prefill tiling, equals the reference on every row."""
    rng = np.random.default_rng(70 + num_decode)
    seqs = mixed_step_seqs(rng, num_decode)
    batch = make_batch(rng, seqs + [(0, 0)], heads=6, kv_heads=2, dtype=dtype)
    ref = np.asarray(paged_attention_reference(**batch, scale=0.3), np.float32)
    out = mixed_paged_attention(**batch, num_decode=jnp.int32(num_decode), scale=0.3,
                                interpret=INTERPRET)
    check_output(out, ref, batch)


def test_mixed_step_with_fewer_tokens_than_sequence_slots():
    """T < S (many padding slots): the decode part sees only the first T rows."""
    rng = np.random.default_rng(77)
    seqs = [(1, 9), (1, 20), (3, 12)] + [(0, 0)] * 9
    batch = make_batch(rng, seqs, heads=4, kv_heads=2, extra_rows=0)
    assert batch["q"].shape[0] < len(seqs)
    ref = np.asarray(paged_attention_reference(**batch, scale=0.3))
    out = np.asarray(mixed_paged_attention(**batch, num_decode=jnp.int32(2), scale=0.3,
                                           interpret=INTERPRET))
    assert rel_err(out, ref) < TOL[jnp.float32]


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_random_ragged_batches(seed):
    # Small key steps (one 8-token page) put causal and length edges at every offset.
    rng = np.random.default_rng(1000 + seed)
    check_kernel(make_batch(rng, random_ragged_seqs(rng)), block_q=16, block_kv=8)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1), (16, 2)])
def test_kernel_gqa_ratios(heads, kv_heads):
    batch = make_batch(np.random.default_rng(heads), MIXED, heads=heads, kv_heads=kv_heads)
    check_kernel(batch, block_q=32)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8), (128, 32), (64, 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_head_dims_block_sizes_dtypes(head_dim, block_size, dtype):
    rng = np.random.default_rng(head_dim + block_size)
    batch = make_batch(rng, [(3, 50), (1, 33), (9, 9)], head_dim=head_dim,
                       block_size=block_size, dtype=dtype)
    check_kernel(batch, block_q=16, block_kv=2 * block_size)


@pytest.mark.parametrize("max_q_len,kv_splits", [(1, 2), (1, 4), (None, 3)])
def test_kernel_split_key_range(max_q_len, kv_splits):
    seqs = [(1, 70), (1, 5), (0, 0), (1, 16)] if max_q_len == 1 else MIXED
    batch = make_batch(np.random.default_rng(kv_splits), seqs)
    check_kernel(batch, max_q_len=max_q_len, kv_splits=kv_splits, block_kv=8)


@pytest.mark.parametrize("max_q_len", [None, 1])
def test_kernel_prefetch_pages(max_q_len):
    batch = make_batch(np.random.default_rng(11), MIXED + [(1, 64)])
    check_kernel(batch, max_q_len=max_q_len, prefetch_pages=True, block_q=16, block_kv=16)


@pytest.mark.parametrize("knobs", [
    {"single_loop": True},
    {"evict_first": True, "prefetch_pages": False},
    {"single_loop": True, "prefetch_pages": True, "evict_first": True},
    {"mask_q": True},  # (the decode tiling's default; prefill rows too)
    {"mask_q": False},  # (the prefill tiling's default; decode rows too)
    {"mask_kv": False},  # edge steps load every key row (the default skips past kv_len)
    {"mask_kv": True, "evict_first": True},
])
@pytest.mark.parametrize("max_q_len", [None, 1])
def test_kernel_loop_and_cache_hint_variants(knobs, max_q_len):
    # Block size 8 with 2-page steps: per-key page ids cross a page inside every step.
    batch = make_batch(np.random.default_rng(12), MIXED + [(1, 64), (5, 41)], heads=6)
    check_kernel(batch, max_q_len=max_q_len, block_q=16, block_kv=16, **knobs)


@pytest.mark.parametrize("heads,kv_heads,hp,knobs", [
    (4, 4, 2, {}),  # MHA, two heads per tile
    # all heads in one tile, split key range (32-key steps: 8 heads x 64 float32 keys a
    # step ask for more shared memory than an H200 has)
    (8, 8, 8, {"kv_splits": 2, "block_kv": 32}),
    (8, 4, 2, {"soft_cap": 5.0}),  # GQA groups of 2, two groups per tile
    (12, 4, 4, {"block_kv": 16, "prefetch_pages": True}),  # group 3 padded to 4
])
def test_kernel_heads_per_tile(heads, kv_heads, hp, knobs):
    # decode tiling with several KV heads per tile; prefill rows too (one token per tile)
    seqs = [(1, 37), (1, 3), (0, 0), (4, 20), (1, 1), (1, 64)]
    batch = make_batch(np.random.default_rng(hp + heads), seqs, heads=heads,
                       kv_heads=kv_heads)
    check_kernel(batch, max_q_len=1, heads_per_tile=hp, **knobs)


def test_heads_per_tile_needs_decode_tiling_and_a_divisor():
    batch = make_batch(np.random.default_rng(0), [(1, 9)], heads=4, kv_heads=4)
    for hp, max_q_len in ((3, 1), (8, 1), (2, None)):
        with pytest.raises(ValueError, match="heads_per_tile"):
            paged_attention(**batch, scale=0.3, interpret=INTERPRET, max_q_len=max_q_len,
                            block_sizes=BlockSizes(heads_per_tile=hp))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_soft_cap(dtype):
    batch = make_batch(np.random.default_rng(7), MIXED, dtype=dtype)
    check_kernel(batch, soft_cap=2.0, block_q=16)


def test_kernel_decode_hint_is_only_a_hint():
    # max_q_len=1 with prefill rows still computes the same function.
    check_kernel(make_batch(np.random.default_rng(3), MIXED), max_q_len=1)


def test_kernel_fresh_inputs_each_call():
    orders = itertools.islice(itertools.permutations([(1, 20), (4, 11), (2, 2)]), 3)
    for seed, seqs in enumerate(orders):
        check_kernel(make_batch(np.random.default_rng(100 + seed), list(seqs)), block_q=16)


# -- validation ------------------------------------------------------------------------

BAD_INPUTS = {
    "q_rank": lambda b: {"q": b["q"][0]},
    "head_dim": lambda b: {"q": jnp.zeros((5, 4, 32), jnp.float32)},
    "heads_not_multiple": lambda b: {"q": jnp.zeros((5, 3, 64), jnp.float32)},
    "v_cache_shape": lambda b: {"v_cache": b["v_cache"][:, :1]},
    "dtype_mismatch": lambda b: {"q": b["q"].astype(jnp.bfloat16)},
    "block_tables_rank": lambda b: {"block_tables": b["block_tables"][0]},
    "kv_lens_shape": lambda b: {"kv_lens": jnp.zeros((2,), jnp.int32)},
    "cu_q_lens_dtype": lambda b: {"cu_q_lens": b["cu_q_lens"].astype(jnp.float32)},
    "layer_not_scalar": lambda b: {"layer": jnp.zeros((2,), jnp.int32)},
    "block_size_not_pow2": lambda b: {"k_cache": b["k_cache"][:, :, :, :6],
                                      "v_cache": b["v_cache"][:, :, :, :6]},
}


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference])
@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
def test_invalid_inputs_raise_value_error(fn, bad):
    batch = make_batch(np.random.default_rng(0), [(2, 5)])
    with pytest.raises(ValueError):
        fn(**{**batch, **BAD_INPUTS[bad](batch)}, scale=1.0)
