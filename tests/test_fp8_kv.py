"""The fp8 KV cache (`pallas_kernels/fp8.py`): the per-row quantisation, the writes that
quantise (write_kv, rope_write_kv) and every attention op reading an fp8 cache.

Each attention op on an fp8 cache must equal (1) its own reference run on the
*dequantised* cache, within the float32/bfloat16 kernel tolerance of
test_paged_attention, and (2) the same op on the original unquantised cache within
FP8_TOL, the quantisation error: relative L2 error of the attention output with random
normal K/V, measured ~0.03 for e4m3 (3 mantissa bits: a row's elements are rounded to
within 2^-4 relative) and ~0.06 for e5m2 (2 bits); the bounds leave 2x room. In
interpret mode (CPU) the kernels run in Pallas's interpreter; on a GPU compiled.
"""

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
    make_batch,
    make_cascade_batch,
    quantize_batch,
    rel_err,
)
from test_rope_kv_write import make_inputs, written_rows

from pallas_kernels.cascade_attention import cascade_attention, cascade_attention_reference
from pallas_kernels.fp8 import FP8_DTYPES, dequantize_rows, fp8_max, quantize_rows
from pallas_kernels.kv_cache import write_kv, write_kv_reference
from pallas_kernels.paged_attention import (
    mixed_paged_attention,
    paged_attention,
    paged_attention_reference,
)
from pallas_kernels.paged_attention_tiling import BlockSizes, resolve_block_sizes
from pallas_kernels.rope_kv_write import rope_write_kv, rope_write_kv_reference

E4M3, E5M2 = FP8_DTYPES
FP8_TOL = {E4M3: 0.06, E5M2: 0.12}
# worst relative rounding error of one element, relative to its row's amax
ROW_ERR = {E4M3: 2.0**-4, E5M2: 2.0**-3}
SCALE = 0.3


def check_fp8_op(op, batch, fp8=E4M3, reference=paged_attention_reference, **kw):
    """op on the fp8 cache == reference on the dequantised cache (tight) and == op on the
    original cache (within the quantisation error); padding rows zeros, none unwritten."""
    fp8_batch, deq = quantize_batch(batch, fp8)
    out = op(**fp8_batch, scale=SCALE, **kw)
    tight = np.asarray(reference(**deq, scale=SCALE), np.float32)
    out = check_output(out, tight, batch)
    n = int(batch["cu_q_lens"][-1])
    unquantised = np.asarray(op(**batch, scale=SCALE, **kw), np.float32)
    assert rel_err(out[:n], unquantised[:n]) < FP8_TOL[fp8]


# -- quantisation round trips ---------------------------------------------------------

@pytest.mark.parametrize("fp8", FP8_DTYPES)
def test_quantize_round_trip_error_is_bounded_by_the_format(fp8):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)) * np.exp(rng.uniform(-20, 20, (64, 1)))
    x8, scale = quantize_rows(jnp.asarray(x, jnp.float32), fp8)
    assert x8.dtype == fp8 and scale.dtype == jnp.float32 and scale.shape == (64,)
    back = np.asarray(dequantize_rows(x8, scale), np.float64)
    amax = np.abs(x).max(axis=1, keepdims=True)
    assert np.all(np.abs(back - x) <= ROW_ERR[fp8] * amax * 1.0001)
    # each row's largest element lands on the format's largest value
    np.testing.assert_allclose(np.abs(np.asarray(x8, np.float32)).max(axis=1), fp8_max(fp8))


@pytest.mark.parametrize("fp8", FP8_DTYPES)
def test_scales_never_zero_or_inf_and_nothing_nan(fp8):
    big = float(np.finfo(np.float32).max)
    rows = np.array([
        np.zeros(8),  # all zeros: scale 1, zeros back
        np.full(8, 1e-44),  # subnormal float32: amax / fp8_max underflows
        [big, -big, 1, 0, 0, 0, 0, 0],  # float32's largest
        [1e-30, 0, 0, 0, 0, 0, 0, 3e-31],
        [5.0, -7.0, 1e6, 0, 0, 0, 0, 0],
    ], np.float32)
    x8, scale = quantize_rows(jnp.asarray(rows), fp8)
    scale = np.asarray(scale)
    assert np.all(np.isfinite(scale)) and np.all(scale > 0)
    assert scale[0] == 1.0
    back = np.asarray(dequantize_rows(x8, scale))
    assert not np.isnan(np.asarray(x8, np.float32)).any() and not np.isnan(back).any()
    np.testing.assert_array_equal(back[0], 0.0)
    np.testing.assert_allclose(back[2, :2], [big, -big], rtol=ROW_ERR[fp8])
    np.testing.assert_allclose(back[4, 2], 1e6, rtol=ROW_ERR[fp8])


def test_values_beyond_the_scale_saturate_instead_of_nan():
    from pallas_kernels.fp8 import quantize_with

    x = jnp.asarray([1.0, 448.0, 500.0, -1e9, 1e-12], jnp.float32)
    got = np.asarray(quantize_with(x, jnp.float32(1.0), E4M3), np.float32)
    np.testing.assert_array_equal(got[:4], [1.0, 448.0, 448.0, -448.0])
    assert got[4] == 0.0


# -- writes ------------------------------------------------------------------------------

def fp8_caches(rng, shape, fp8=E4M3):
    """Poisoned fp8 caches and scales: random rows so that an unwanted write shows."""
    k8, ks = quantize_rows(jnp.asarray(rng.standard_normal(shape), jnp.float32), fp8)
    v8, vs = quantize_rows(jnp.asarray(rng.standard_normal(shape), jnp.float32), fp8)
    return k8, v8, ks, vs


def as_bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 4: np.uint32}[x.dtype.itemsize])


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("fn", [write_kv, write_kv_reference])
def test_write_kv_quantises_each_row_and_leaves_the_others(fn, fp8):
    rng = np.random.default_rng(3)
    shape = (3, 2, 6, 4, 32)
    cache = fp8_caches(rng, shape, fp8)
    slots = np.array([5, 23, 9, 16, 0, 2], np.int32)  # two null-block (padding) slots
    k = jnp.asarray(rng.standard_normal((6, 2, 32)) * 3, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((6, 2, 32)), jnp.bfloat16)
    got = fn(*cache[:2], jnp.int32(1), k, v, jnp.asarray(slots), *cache[2:])
    assert [x.dtype for x in got] == [x.dtype for x in cache]
    written = written_rows(shape, 1, slots)
    if fn is write_kv_reference:  # (it writes the null block's padding slots too)
        written[:, :, 0] = True
    for new, old in zip(got, cache, strict=True):
        np.testing.assert_array_equal(as_bits(new)[~written], as_bits(old)[~written])
    for x, new8, news in ((k, got[0], got[2]), (v, got[1], got[3])):
        want8, wants = quantize_rows(x, fp8)
        for t, s in enumerate(slots):
            if s >= 4:
                np.testing.assert_array_equal(as_bits(new8[1, :, s // 4, s % 4]),
                                              as_bits(want8[t]))
                np.testing.assert_array_equal(news[1, :, s // 4, s % 4], wants[t])


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype,heads,kv_heads,tokens,bt", [
    (jnp.float32, 4, 4, 5, None), (jnp.bfloat16, 8, 2, 37, 16), (jnp.float32, 4, 1, 16, 8)])
def test_rope_write_kv_quantises_on_write(dtype, heads, kv_heads, tokens, bt, fp8):
    """The fused kernel's fp8 rows equal its reference's (rope, then write_kv) within one
    fp8 rounding (the rotation itself is within a rounding, test_rope_kv_write); scales
    within the same; q unchanged by the cache's format; other rows bit-unchanged."""
    rng = np.random.default_rng(tokens + heads)
    args = make_inputs(rng, heads=heads, kv_heads=kv_heads, head_dim=32, tokens=tokens,
                       padding=min(3, tokens // 2), dtype=dtype)
    shape = args["k_cache"].shape
    k8, v8, ks, vs = fp8_caches(rng, shape, fp8)
    args.update(k_cache=k8, v_cache=v8)
    kw = dict(layer=jnp.int32(1), num_heads=heads, num_kv_heads=kv_heads, k_scale=ks,
              v_scale=vs)
    got = rope_write_kv(**args, interpret=INTERPRET, block_tokens=bt, **kw)
    ref = rope_write_kv_reference(**args, **kw)
    q_plain = rope_write_kv_reference(**dict(args, k_cache=jnp.zeros(shape, dtype),
                                             v_cache=jnp.zeros(shape, dtype)),
                                      layer=1, num_heads=heads, num_kv_heads=kv_heads)[0]
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(q_plain, np.float32),
                               rtol=2**-7, atol=1e-5)
    written = written_rows(shape, 1, args["slot_mapping"])
    for new, old in zip(got[1:], (k8, v8, ks, vs), strict=True):
        np.testing.assert_array_equal(as_bits(new)[~written], as_bits(old)[~written])
    for i in (0, 1):  # k, v dequantised: within one fp8 rounding of the reference
        deq = np.asarray(dequantize_rows(got[1 + i], got[3 + i]))[written]
        want = np.asarray(dequantize_rows(ref[1 + i], ref[3 + i]))[written]
        amax = np.abs(want).max(axis=-1, keepdims=True)
        assert np.all(np.abs(deq - want) <= 2 * ROW_ERR[fp8] * amax + 1e-6)
        np.testing.assert_allclose(np.asarray(got[3 + i])[written],
                                   np.asarray(ref[3 + i])[written], rtol=2**-7)


# -- attention on an fp8 cache -------------------------------------------------------------

def _paged(max_q_len=None, **knobs):
    def op(**kw):
        return paged_attention(**kw, interpret=INTERPRET, max_q_len=max_q_len,
                               block_sizes=BlockSizes(**knobs))
    return op


@pytest.mark.parametrize("max_q_len", [None, 1])
@pytest.mark.parametrize("case", [
    [(1, 37), (1, 1), (1, 8), (1, 9), (0, 0)],  # decode, one-token prompt, block edges
    [(6, 30), (2, 17), (13, 14), (4, 18)],  # prefix cached: part, most, almost all
    MIXED,  # mixed decode + prefill + padding sequence + padding rows
])
def test_kernel_on_fp8_cache_ragged_batches(case, max_q_len):
    check_fp8_op(_paged(max_q_len, block_q=16, block_kv=16),
                 make_batch(np.random.default_rng(len(case)), case))


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_on_fp8_cache_dtypes_and_formats(dtype, fp8):
    batch = make_batch(np.random.default_rng(5), [(3, 50), (1, 33), (9, 9)], head_dim=128,
                       block_size=16, dtype=dtype)
    check_fp8_op(_paged(block_q=16, block_kv=32), batch, fp8)


@pytest.mark.parametrize("max_q_len,knobs", [
    (1, {"kv_splits": 4, "block_kv": 8}),  # split key range, one-page steps
    (None, {"kv_splits": 3, "block_kv": 8}),
    (1, {"heads_per_tile": 2}),  # several heads per tile: each key its own scale
    (None, {"mask_kv": False, "single_loop": True, "block_q": 16}),
])
def test_kernel_on_fp8_cache_knobs(max_q_len, knobs):
    seqs = [(1, 70), (1, 5), (0, 0), (1, 16)] if max_q_len == 1 else MIXED + [(1, 64)]
    batch = make_batch(np.random.default_rng(9), seqs, heads=8, kv_heads=4)
    check_fp8_op(_paged(max_q_len, **knobs), batch)


def test_decode_defaults_over_fp8_cache_and_long_tables():
    """Decoding over an fp8 cache takes one-warp programs on 32-key steps (16 for tables
    of <= 256 keys), split at least twice once the tables hold >= 1,024 keys; a 16-bit
    cache and prefill keep theirs, an ALiBi prefill takes 2 stages, and explicit knobs
    win. With the defaults the kernel equals the reference on the dequantised cache over
    a 1,100-key table."""
    q, cache = (256, 32, 128), (2, 8, 4096, 16, 128)

    def knobs(bs=None, table_keys=2048, **kw):
        r = resolve_block_sizes(bs or BlockSizes(), q, cache, jnp.bfloat16, causal=True,
                                table_keys=table_keys, **kw)
        return r.block_kv, r.num_warps, r.kv_splits, r.num_stages
    assert knobs(max_q_len=1, kv_fp8=True, table_keys=2048) == (32, 1, 2, 3)
    assert knobs(max_q_len=1, kv_fp8=True, table_keys=512) == (32, 1, 1, 3)
    assert knobs(max_q_len=1, kv_fp8=True, table_keys=256) == (16, 1, 1, 3)
    assert knobs(max_q_len=1, table_keys=2048) == (64, 4, 1, 3)
    block_kv, warps, _, _ = knobs(max_q_len=None, kv_fp8=True, table_keys=2048)
    assert block_kv == 64 and warps != 1
    assert knobs(max_q_len=None, alibi=True)[3] == 2
    assert knobs(max_q_len=None)[3] == 4
    assert knobs(BlockSizes(block_kv=64, num_warps=2, kv_splits=1), max_q_len=1,
                 kv_fp8=True, table_keys=2048)[:3] == (64, 2, 1)
    batch = make_batch(np.random.default_rng(11), [(1, 1100), (1, 40), (0, 0), (1, 1)],
                       block_size=16)
    assert batch["block_tables"].shape[1] * 16 >= 1024
    check_fp8_op(_paged(1), batch)


def test_kernel_on_fp8_cache_soft_cap_and_lse():
    batch = make_batch(np.random.default_rng(8), MIXED, heads=6, kv_heads=2)
    fp8_batch, deq = quantize_batch(batch)
    out, lse = paged_attention(**fp8_batch, scale=SCALE, soft_cap=2.0, return_lse=True,
                               interpret=INTERPRET, block_sizes=BlockSizes(block_q=16))
    ref, ref_lse = paged_attention_reference(**deq, scale=SCALE, soft_cap=2.0,
                                             return_lse=True)
    n = int(batch["cu_q_lens"][-1])
    assert rel_err(out[:n], ref[:n]) < TOL[jnp.float32]
    np.testing.assert_allclose(np.asarray(lse)[:n], np.asarray(ref_lse)[:n], rtol=1e-5)


def test_reference_on_fp8_cache_equals_reference_on_dequantised_cache():
    batch = make_batch(np.random.default_rng(4), MIXED, heads=6, kv_heads=2)
    check_fp8_op(paged_attention_reference, batch)


@pytest.mark.parametrize("num_decode", [0, 2, 6])
def test_mixed_step_on_fp8_cache(num_decode):
    rng = np.random.default_rng(70 + num_decode)
    seqs = [(1, int(k)) for k in rng.integers(1, 50, num_decode)]
    seqs += [(q, q + 7) for q in rng.integers(2, 20, 6 - num_decode)] + [(0, 0)]
    batch = make_batch(rng, seqs, heads=6, kv_heads=2)

    def op(**kw):
        return mixed_paged_attention(**kw, num_decode=jnp.int32(num_decode),
                                     interpret=INTERPRET)
    check_fp8_op(op, batch)


@pytest.mark.parametrize("dtype,q_len", [(jnp.float32, 1), (jnp.bfloat16, 1),
                                         (jnp.float32, 3)])
def test_cascade_on_fp8_cache(dtype, q_len):
    """Both parts (shared prefix, per-sequence suffix) read the fp8 cache: the kernel
    path and its XLA composition equal the dense check on the dequantised cache."""
    batch, cascade = make_cascade_batch(np.random.default_rng(q_len), GROUPS, LONERS,
                                        heads=8, kv_heads=2, q_len=q_len, dtype=dtype)
    max_q_len = 1 if q_len == 1 else None
    full = {k: batch[k] for k in ("block_tables", "kv_lens")}
    args = {k: v for k, v in cascade.items() if k not in ("q", "k_cache", "v_cache")}

    def kernel(q, k_cache, v_cache, cu_q_lens, **kw):
        return cascade_attention(q, k_cache, v_cache, **{**args, **kw},
                                 max_q_len=max_q_len, interpret=INTERPRET)

    def xla(q, k_cache, v_cache, cu_q_lens, **kw):
        return cascade_attention(q, k_cache, v_cache, **{**args, **kw}, use_reference=True)

    def reference(q, k_cache, v_cache, cu_q_lens, **kw):
        return cascade_attention_reference(q, k_cache, v_cache, **{**args, **kw})

    plain = {k: batch[k] for k in ("q", "k_cache", "v_cache", "cu_q_lens")}
    for op in (kernel, xla):
        check_fp8_op(op, dict(plain, layer=batch["layer"]), reference=reference)
    # and the cascade equals plain paged attention over the full tables, both on fp8
    fp8_batch, _ = quantize_batch(batch)
    want = paged_attention_reference(**dict(fp8_batch, **full), scale=SCALE)
    got = kernel(**{k: fp8_batch[k] for k in ("q", "k_cache", "v_cache", "cu_q_lens",
                                              "k_scale", "v_scale", "layer")}, scale=SCALE)
    n = int(batch["cu_q_lens"][-1])
    assert rel_err(got[:n], want[:n]) < TOL[jnp.dtype(dtype).type]


BAD_FP8 = [
    (lambda b: dict(b, v_scale=None), "together"),
    (lambda b: dict(b, k_scale=b["k_scale"][..., :2]), "k_scale must be float32"),
    (lambda b: dict(b, v_scale=b["v_scale"].astype(jnp.bfloat16)), "v_scale must be"),
    (lambda b: dict(b, v_cache=b["v_cache"].astype(E5M2)), "one format"),
    (lambda b: dict(b, k_scale=None, v_scale=None), "needs k_scale"),
]


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference])
@pytest.mark.parametrize("bad,match", BAD_FP8)
def test_invalid_fp8_inputs_raise_value_error(fn, bad, match):
    fp8_batch, _ = quantize_batch(make_batch(np.random.default_rng(0), [(2, 5)]))
    with pytest.raises(ValueError, match=match):
        fn(**bad(fp8_batch), scale=1.0)


def test_write_kv_rejects_scales_for_a_float_cache():
    cache = jnp.zeros((1, 1, 2, 4, 8), jnp.float32)
    s = jnp.ones((1, 1, 2, 4), jnp.float32)
    x = jnp.zeros((1, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="one format"):
        write_kv(cache, cache, jnp.int32(0), x, x, jnp.asarray([4], jnp.int32), s, s)
