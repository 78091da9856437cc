"""rope_write_kv (Pallas, interpret mode on CPU) == rope_write_kv_reference (apply_rope +
write_kv), and no cache row but the written ones changes.

Interpret mode starts the q output as NaN, so "no NaN in q" checks that every q element
was written. The rotation is within a rounding of the reference, not bit-equal: XLA
contracts x1*cos - x2*sin into FMAs in some fusions and not in others (on XLA:CPU as on
a GPU), so float32 compares within a few ulps and bfloat16 within one bf16 step. On a
GPU backend the same tests run the compiled Triton kernel.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rope_kv_write import rope_write_kv, rope_write_kv_reference

INTERPRET = jax.default_backend() == "cpu"
TOL = {jnp.float32: dict(rtol=1e-6, atol=1e-6), jnp.bfloat16: dict(rtol=2**-7, atol=1e-5)}


def inv_freq(d, theta=10000.0, factor=1.0):
    return jnp.asarray(1.0 / (theta ** (np.arange(0, d, 2) / d)) / factor, jnp.float32)


def make_inputs(rng, *, heads, kv_heads, head_dim, tokens, padding, layers=3,
                num_blocks=16, block_size=4, dtype=jnp.float32):
    """Random qkv, positions and poisoned caches; real tokens get distinct slots outside
    block 0 (the cache's last slot among them), padding tokens null-block slots."""
    real = rng.choice(np.arange(block_size, num_blocks * block_size - 1), tokens - padding - 1,
                      replace=False)
    slots = np.concatenate([real, [num_blocks * block_size - 1],
                            rng.integers(0, block_size, padding)])
    cache = (layers, kv_heads, num_blocks, block_size, head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    return dict(
        qkv=jnp.asarray(rng.standard_normal((tokens, width)), dtype),
        positions=jnp.asarray(rng.integers(0, 8192, tokens), jnp.int32),
        slot_mapping=jnp.asarray(rng.permutation(slots), jnp.int32),  # padding anywhere
        k_cache=jnp.asarray(rng.standard_normal(cache), dtype),
        v_cache=jnp.asarray(rng.standard_normal(cache), dtype),
        inv_freq=inv_freq(head_dim, factor=rng.choice([1.0, 8.0])),
    )


def written_rows(cache_shape, layer, slots):
    """[L, K, N, B] bool: the rows the call must write (null-block slots excluded)."""
    _, _, _, b, _ = cache_shape
    out = np.zeros(cache_shape[:-1], bool)
    for s in np.asarray(slots):
        if s >= b:
            out[layer, :, s // b, s % b] = True
    return out


def bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def check(got, ref, args, layer, num_heads, num_kv_heads, dtype):
    """got == ref (q and the written rows, within TOL; v rows exactly) and every row not
    written is bit-unchanged from the input caches."""
    q, k_cache, v_cache = got
    assert not np.isnan(np.asarray(q, np.float32)).any(), "a q element was never written"
    np.testing.assert_allclose(np.asarray(q, np.float32), np.asarray(ref[0], np.float32),
                               **TOL[dtype])
    written = written_rows(args["k_cache"].shape, layer, args["slot_mapping"])
    for new, old, expect in ((k_cache, args["k_cache"], ref[1]),
                             (v_cache, args["v_cache"], ref[2])):
        np.testing.assert_array_equal(bits(new)[~written], bits(old)[~written])
        np.testing.assert_allclose(np.asarray(new, np.float32)[written],
                                   np.asarray(expect, np.float32)[written], **TOL[dtype])
    # v is copied, not computed: bit-equal to the token's v columns
    d = args["k_cache"].shape[-1]
    v_cols = np.asarray(args["qkv"])[:, (num_heads + num_kv_heads) * d:]
    b = args["k_cache"].shape[3]
    for t, s in enumerate(np.asarray(args["slot_mapping"])):
        if s >= b:
            np.testing.assert_array_equal(
                bits(v_cache[layer, :, s // b, s % b]),
                bits(v_cols[t].reshape(num_kv_heads, d)))


@pytest.mark.parametrize("dtype,heads,head_dim,tokens_tile", [
    pytest.param(dt, hk, d, tb, id=f"{jnp.dtype(dt).name}-H{hk[0]}K{hk[1]}-D{d}-T{tb[0]}bt{tb[1]}")
    for dt, hk, d, tb in itertools.product([jnp.float32, jnp.bfloat16],
                                           [(4, 4), (8, 2), (4, 1)], [32, 64],
                                           [(5, None), (16, 8), (37, 16)])])
def test_matches_reference(dtype, heads, head_dim, tokens_tile):
    (h, k), (t, bt) = heads, tokens_tile
    rng = np.random.default_rng(t * 1000 + h * 100 + k * 10 + head_dim)
    args = make_inputs(rng, heads=h, kv_heads=k, head_dim=head_dim, tokens=t,
                       padding=min(3, t // 2), dtype=dtype)
    layer = 1 + t % 2  # layers 1 and 2 of 3
    got = rope_write_kv(**args, layer=jnp.int32(layer), num_heads=h, num_kv_heads=k,
                        interpret=INTERPRET, block_tokens=bt)
    ref = rope_write_kv_reference(**args, layer=layer, num_heads=h, num_kv_heads=k)
    check(got, ref, args, layer, h, k, dtype)


def test_donated_jit_matches_and_aliases():
    h, k = 8, 2
    args = make_inputs(np.random.default_rng(7), heads=h, kv_heads=k, head_dim=32,
                       tokens=21, padding=4, num_blocks=1024)  # 3 MB per cache
    order = ("qkv", "positions", "slot_mapping", "k_cache", "v_cache", "layer", "inv_freq")
    call = [args[n] if n != "layer" else jnp.int32(2) for n in order]
    ref = rope_write_kv_reference(*call, num_heads=h, num_kv_heads=k)
    k_old, v_old = np.asarray(args["k_cache"]), np.asarray(args["v_cache"])
    fn = jax.jit(functools.partial(rope_write_kv, num_heads=h, num_kv_heads=k,
                                   interpret=INTERPRET, block_tokens=8),
                 donate_argnums=(3, 4))
    stats = fn.lower(*call).compile().memory_analysis()
    cache_bytes = args["k_cache"].size * args["k_cache"].dtype.itemsize
    if stats is not None:  # both caches alias their outputs: nothing cache-sized is new
        assert stats.alias_size_in_bytes == 2 * cache_bytes
        assert stats.temp_size_in_bytes < cache_bytes // 10
    got = fn(*call)
    check(got, ref, dict(args, k_cache=k_old, v_cache=v_old), 2, h, k, jnp.float32)


def _bad(args, **changes):
    return dict(args, **changes)


BAD = [
    (lambda a: _bad(a, qkv=a["qkv"][:, :-32]), "qkv must be"),
    (lambda a: _bad(a, qkv=a["qkv"][None]), "qkv must be"),
    (lambda a: _bad(a, qkv=a["qkv"].astype(jnp.bfloat16)), "must share"),
    (lambda a: _bad(a, k_cache=a["k_cache"].astype(jnp.int32),
                    v_cache=a["v_cache"].astype(jnp.int32),
                    qkv=a["qkv"].astype(jnp.int32)), "must share"),
    (lambda a: _bad(a, v_cache=a["v_cache"][:2]), "k_cache and v_cache"),
    (lambda a: _bad(a, k_cache=a["k_cache"][0], v_cache=a["v_cache"][0]),
     "k_cache and v_cache"),
    (lambda a: _bad(a, positions=a["positions"][:-1]), "positions must be"),
    (lambda a: _bad(a, positions=a["positions"].astype(jnp.float32)), "positions must be"),
    (lambda a: _bad(a, slot_mapping=a["slot_mapping"][:, None]), "slot_mapping must be"),
    (lambda a: _bad(a, layer=jnp.zeros(1, jnp.int32)), "layer must be"),
    (lambda a: _bad(a, layer=1.0), "layer must be"),
    (lambda a: _bad(a, inv_freq=a["inv_freq"][:-1]), "inv_freq must be"),
    (lambda a: _bad(a, inv_freq=a["inv_freq"].astype(jnp.bfloat16)), "inv_freq must be"),
    (lambda a: _bad(a, block_tokens=12), "block_tokens"),
    (lambda a: _bad(a, num_kv_heads=4), "num_kv_heads is 4"),
    (lambda a: _bad(a, num_heads=5), r"num_heads \(5\)"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_rejects_bad_inputs(case):
    mutate, match = BAD[case]
    args = make_inputs(np.random.default_rng(0), heads=8, kv_heads=2, head_dim=32,
                       tokens=9, padding=2)
    kw = mutate(dict(args, layer=1, num_heads=8, num_kv_heads=2, interpret=INTERPRET))
    with pytest.raises(ValueError, match=match):
        rope_write_kv(**kw)


def test_rejects_head_dim_not_a_power_of_2():
    args = make_inputs(np.random.default_rng(0), heads=4, kv_heads=2, head_dim=48,
                       tokens=9, padding=2)
    with pytest.raises(ValueError, match=r"head_dim \(48\)"):
        rope_write_kv(**args, layer=0, num_heads=4, num_kv_heads=2, interpret=INTERPRET)


def _device_bytes() -> int:
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)


@pytest.mark.skipif(jax.default_backend() != "gpu" or _device_bytes() < 40 * 2**30,
                    reason="needs a GPU with >= 40 GiB (two 4.5 GB caches, their copies)")
def test_llama2_7b_shapes_past_4gib():
    """H = K = 32, D = 128, T = 128, bf16, caches of 4.5 GB each (64-bit offsets), rows
    written near the end of the cache; and no cache-sized copy when donated."""
    h = k = 32
    t, d, layers, n, b = 128, 128, 2, 17000, 16
    rng = np.random.default_rng(0)
    shape = (layers, k, n, b, d)
    cache_bytes = np.prod(shape) * 2
    assert cache_bytes > 2**32
    slots = np.concatenate([  # the cache's last slot, the last blocks, spread ones, padding
        [n * b - 1], rng.choice(np.arange((n - 64) * b, n * b - 1), 63, replace=False),
        rng.choice(np.arange(b, (n - 64) * b), 56, replace=False),
        rng.integers(0, b, 8)])
    args = dict(
        qkv=jnp.asarray(rng.standard_normal((t, (h + 2 * k) * d)), jnp.bfloat16),
        positions=jnp.asarray(rng.integers(0, 4096, t), jnp.int32),
        slot_mapping=jnp.asarray(rng.permutation(slots), jnp.int32),
        k_cache=jax.random.normal(jax.random.key(1), shape, jnp.bfloat16),
        v_cache=jax.random.normal(jax.random.key(2), shape, jnp.bfloat16),
        inv_freq=inv_freq(d),
    )
    layer = layers - 1
    kw = dict(num_heads=h, num_kv_heads=k)
    ref = jax.jit(functools.partial(rope_write_kv_reference, **kw))(**args, layer=layer)
    got = rope_write_kv(**args, layer=jnp.int32(layer), **kw)
    np.testing.assert_allclose(np.asarray(got[0], np.float32),
                               np.asarray(ref[0], np.float32), **TOL[jnp.bfloat16])
    written = written_rows(shape, layer, args["slot_mapping"]).reshape(-1)
    for new, old, expect in ((got[1], args["k_cache"], ref[1]),
                             (got[2], args["v_cache"], ref[2])):
        # rows that differ from the input (computed on the device: 2e8 rows)
        changed = np.asarray(jnp.any(new.reshape(-1, d) != old.reshape(-1, d), axis=1))
        assert not (changed & ~written).any(), "a row not written changed"
        idx = jnp.asarray(np.flatnonzero(written))
        np.testing.assert_allclose(np.asarray(new.reshape(-1, d)[idx], np.float32),
                                   np.asarray(expect.reshape(-1, d)[idx], np.float32),
                                   **TOL[jnp.bfloat16])
    del ref, got

    specs = [jax.ShapeDtypeStruct(args[name].shape, args[name].dtype) for name in
             ("qkv", "positions", "slot_mapping", "k_cache", "v_cache")]
    compiled = jax.jit(functools.partial(rope_write_kv, **kw), donate_argnums=(3, 4)).lower(
        *specs, jnp.int32(layer), args["inv_freq"]).compile()
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < cache_bytes // 100, stats
    assert stats.alias_size_in_bytes == 2 * cache_bytes, stats
