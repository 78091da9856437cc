"""Sliding-window attention in every attention op == a dense float64 reference in which a
row at q_pos sees the keys k with q_pos - window < k <= q_pos (transformers' convention).

Covers the jnp reference, the Pallas kernel (interpret mode on CPU: outputs start as NaN,
so "no NaN" proves every row was written) over decode, prefill, prefix-cached and mixed
batches with windows that cut through a block and through a cached prefix, key splits,
the one-loop variant, multi-page steps, ALiBi, an fp8 cache, a traced window, cascade
attention; and that pages wholly older than every row's window are never read (their
values are NaN, or the block table points them at the null block).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    GROUPS,
    INTERPRET,
    LONERS,
    MIXED,
    TOL,
    check_output,
    dense_attention,
    make_batch,
    make_cascade_batch,
    quantize_batch,
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
FP8 = FP8_DTYPES[0]  # e4m3
DECODE = [(1, 37), (1, 1), (1, 8), (1, 9), (1, 24), (0, 0)]
PREFILL = [(6, 6), (1, 1), (13, 13), (20, 20)]
CACHED = [(6, 30), (2, 17), (13, 14), (4, 18)]  # prefix cached: part, most, almost all
WINDOWS = [1, 5, 8, 13]  # one key; through a block (B = 8); one block; across blocks


def dense_window(batch, window, *, slopes=None):
    """Independent check (float64): per sequence and row, attention over the keys in
    (q_pos - window, q_pos]; with `slopes` the ALiBi bias (attention_cases.dense_attention)."""
    return dense_attention(batch, SCALE, window=window, slopes=slopes)[0]


def poison_old_pages(batch, window, *, null=False):
    """The batch with every page wholly older than its sequence's first query row's
    window made NaN (or, with `null`, pointed at the null block 0, itself NaN): a kernel
    that reads any of them returns NaN."""
    tables = np.asarray(batch["block_tables"]).copy()
    k, v = np.asarray(batch["k_cache"]).copy(), np.asarray(batch["v_cache"]).copy()
    b = k.shape[3]
    cu, kv_lens = np.asarray(batch["cu_q_lens"]), np.asarray(batch["kv_lens"])
    k[:, :, 0], v[:, :, 0] = np.nan, np.nan  # nothing may read the null block
    for s, kv_len in enumerate(kv_lens):
        first_pos = kv_len - (cu[s + 1] - cu[s])
        for j in range(max(0, first_pos - window + 1) // b):  # pages of keys < window's
            if null:
                tables[s, j] = 0
            else:
                k[:, :, tables[s, j]], v[:, :, tables[s, j]] = np.nan, np.nan
    return dict(batch, block_tables=jnp.asarray(tables), k_cache=jnp.asarray(k),
                v_cache=jnp.asarray(v))


def check_window_kernel(batch, window, *, max_q_len=None, slopes=None, poison=True, **knobs):
    dtype = batch["q"].dtype
    truth = dense_window(batch, window, slopes=slopes)
    kw = dict(scale=SCALE, sliding_window=window, alibi_slopes=slopes)
    ref = paged_attention_reference(**batch, **kw)
    n = int(batch["cu_q_lens"][-1])
    assert rel_err(ref[:n], truth[:n]) < (1e-5 if dtype == jnp.float32 else TOL[dtype.type])
    run = poison_old_pages(batch, window, null=window % 2 == 0) if poison else batch
    out = paged_attention(**run, **kw, interpret=INTERPRET, max_q_len=max_q_len,
                          block_sizes=BlockSizes(**knobs))
    check_output(out, truth, batch, unwritten="a row was never written, or an old page was read")


def test_window_larger_than_every_sequence_is_plain_causal_attention():
    batch = make_batch(np.random.default_rng(0), MIXED)
    np.testing.assert_allclose(paged_attention_reference(**batch, scale=SCALE, sliding_window=64),
                               paged_attention_reference(**batch, scale=SCALE), rtol=1e-6)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("max_q_len", [None, 1])
@pytest.mark.parametrize("case", [DECODE, PREFILL, CACHED, MIXED])
def test_kernel_matches_dense_window(case, max_q_len, window):
    batch = make_batch(np.random.default_rng(len(case) + window), case)
    check_window_kernel(batch, window, max_q_len=max_q_len, block_q=16, block_kv=8)


@pytest.mark.parametrize("knobs", [
    dict(block_kv=16),  # two pages per step: the window's first step is partly old
    dict(block_kv=8, kv_splits=3),  # the window's steps split over programs
    dict(block_kv=8, single_loop=True),
    dict(block_kv=32, kv_splits=2, prefetch_pages=True),
])
@pytest.mark.parametrize("max_q_len", [None, 1])
def test_kernel_window_knobs(knobs, max_q_len):
    case = DECODE if max_q_len == 1 else MIXED
    for window in (5, 13):
        batch = make_batch(np.random.default_rng(window), case)
        check_window_kernel(batch, window, max_q_len=max_q_len, block_q=16, **knobs)


def test_kernel_window_decode_with_two_heads_per_tile():
    batch = make_batch(np.random.default_rng(9), DECODE, heads=8, kv_heads=4)
    check_window_kernel(batch, 11, max_q_len=1, block_kv=8, heads_per_tile=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_window_gqa_and_dtypes(dtype):
    batch = make_batch(np.random.default_rng(3), CACHED, heads=8, kv_heads=2, dtype=dtype,
                       block_size=16, head_dim=32)
    check_window_kernel(batch, 21, block_q=32)


@pytest.mark.parametrize("max_q_len", [None, 1])
def test_kernel_window_with_alibi(max_q_len):
    case = DECODE if max_q_len == 1 else CACHED
    batch = make_batch(np.random.default_rng(4), case, heads=8, kv_heads=8)
    check_window_kernel(batch, 11, max_q_len=max_q_len, slopes=alibi_slopes(8),
                        block_q=16, block_kv=8)


@pytest.mark.parametrize("max_q_len", [None, 1])
def test_kernel_window_over_an_fp8_cache(max_q_len):
    case = DECODE if max_q_len == 1 else MIXED
    batch = make_batch(np.random.default_rng(5), case)
    fp8_batch, deq = quantize_batch(batch, FP8)
    out = paged_attention(**fp8_batch, scale=SCALE, sliding_window=9, interpret=INTERPRET,
                          max_q_len=max_q_len)
    n = int(batch["cu_q_lens"][-1])
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_err(out[:n], dense_window(deq, 9)[:n]) < TOL[jnp.float32]


def test_traced_window_is_one_program_for_every_window():
    """A window traced per layer (a model mixing window and full layers under lax.scan)
    computes what the same window given as a constant does."""
    batch = make_batch(np.random.default_rng(6), MIXED)
    windows = jnp.asarray([5, 1 << 30], jnp.int32)  # a window layer, a full one

    @jax.jit
    def both(batch):
        return jax.lax.map(lambda w: paged_attention(**batch, scale=SCALE, sliding_window=w,
                                                     interpret=INTERPRET, block_sizes=BlockSizes(
                                                         block_q=16, block_kv=8)), windows)

    out = np.asarray(both(batch))
    n = int(batch["cu_q_lens"][-1])
    assert rel_err(out[0, :n], dense_window(batch, 5)[:n]) < TOL[jnp.float32]
    assert rel_err(out[1, :n], dense_window(batch, 1 << 20)[:n]) < TOL[jnp.float32]


@pytest.mark.parametrize("num_decode", [0, 2, 4])
def test_mixed_step_with_window(num_decode):
    seqs = [(1, 29), (1, 12), (1, 3), (1, 17)][:num_decode] + [(9, 30), (5, 5), (0, 0)]
    batch = make_batch(np.random.default_rng(num_decode), seqs)
    out = mixed_paged_attention(**poison_old_pages(batch, 7), num_decode=jnp.int32(num_decode),
                                scale=SCALE, sliding_window=7, interpret=INTERPRET)
    n = int(batch["cu_q_lens"][-1])
    assert not np.isnan(np.asarray(out)).any()
    assert rel_err(out[:n], dense_window(batch, 7)[:n]) < TOL[jnp.float32]


@pytest.mark.parametrize("max_q_len,q_len", [(1, 1), (None, 6)])
def test_cascade_with_window_cutting_through_the_shared_prefix(max_q_len, q_len):
    batch, cascade = make_cascade_batch(np.random.default_rng(8), GROUPS, LONERS, q_len=q_len)
    truth = dense_window(batch, 12)
    n = int(batch["cu_q_lens"][-1])
    for out in (cascade_attention(**cascade, scale=SCALE, sliding_window=12,
                                  max_q_len=max_q_len, interpret=INTERPRET),
                cascade_attention(**cascade, scale=SCALE, sliding_window=12,
                                  use_reference=True),
                cascade_attention_reference(**cascade, scale=SCALE, sliding_window=12)):
        assert not np.isnan(np.asarray(out)).any()
        assert rel_err(out[:n], truth[:n]) < TOL[jnp.float32]
    # a window past every key of the tables (a mixed model's full layer): the shared pass
    full = cascade_attention(**cascade, scale=SCALE, sliding_window=1 << 30,
                             interpret=INTERPRET, max_q_len=max_q_len)
    assert rel_err(full[:n], dense_window(batch, 1 << 20)[:n]) < TOL[jnp.float32]


def test_window_needs_causal_attention():
    batch = make_batch(np.random.default_rng(0), DECODE)
    with pytest.raises(ValueError, match="causal"):
        paged_attention(**batch, scale=SCALE, sliding_window=4, causal=False)
