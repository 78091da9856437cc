"""write_kv == write_kv_reference == a numpy loop; only the addressed slots change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_cache import write_kv, write_kv_reference


def make_inputs(rng, *, layers=3, kv_heads=2, num_blocks=7, block_size=4, head_dim=8,
                tokens=9, padding=2, dtype=jnp.float32):
    """Real tokens get distinct slots outside block 0; padding tokens cycle its slots."""
    shape = (layers, kv_heads, num_blocks, block_size, head_dim)
    real = rng.choice(np.arange(block_size, num_blocks * block_size), tokens,
                      replace=False)
    slots = np.concatenate([real, np.arange(padding) % block_size]).astype(np.int32)
    slots = rng.permutation(slots)  # padding need not come last
    kv = (tokens + padding, kv_heads, head_dim)
    return (jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.int32(rng.integers(layers)),
            jnp.asarray(rng.standard_normal(kv), dtype),
            jnp.asarray(rng.standard_normal(kv), dtype),
            jnp.asarray(slots))


def numpy_write(cache, layer, x, slots):
    cache = np.array(cache)
    b = cache.shape[3]
    for t, slot in enumerate(np.asarray(slots)):
        cache[int(layer), :, slot // b, slot % b] = np.asarray(x[t])
    return cache


def without_null_block(cache):
    return np.asarray(cache)[:, :, 1:]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_write_kv_matches_numpy_and_reference(seed, dtype):
    k_cache, v_cache, layer, k, v, slots = make_inputs(np.random.default_rng(seed),
                                                       dtype=dtype)
    expect_k = numpy_write(k_cache, layer, k, slots)
    expect_v = numpy_write(v_cache, layer, v, slots)
    got_k, got_v = write_kv(k_cache, v_cache, layer, k, v, slots)
    ref_k, ref_v = write_kv_reference(k_cache, v_cache, layer, k, v, slots)
    # Padding tokens all land in null block 0, whose content is unspecified.
    for got in (got_k, ref_k):
        np.testing.assert_array_equal(without_null_block(got), without_null_block(expect_k))
    for got in (got_v, ref_v):
        np.testing.assert_array_equal(without_null_block(got), without_null_block(expect_v))


def test_write_kv_never_writes_the_null_block():
    k_cache, v_cache, layer, k, v, slots = make_inputs(np.random.default_rng(4), padding=9)
    got_k, got_v = write_kv(k_cache, v_cache, layer, k, v, slots)
    np.testing.assert_array_equal(np.asarray(got_k)[:, :, 0], np.asarray(k_cache)[:, :, 0])
    np.testing.assert_array_equal(np.asarray(got_v)[:, :, 0], np.asarray(v_cache)[:, :, 0])


def test_write_kv_leaves_other_layers_and_slots_untouched():
    k_cache, v_cache, layer, k, v, slots = make_inputs(np.random.default_rng(5))
    got_k, _ = write_kv(k_cache, v_cache, layer, k, v, slots)
    changed = np.asarray(got_k != k_cache).any(axis=-1)  # [L, K, N, B]
    written = np.zeros_like(changed)
    b = k_cache.shape[3]
    for slot in np.asarray(slots):
        written[int(layer), :, slot // b, slot % b] = True
    assert not (changed & ~written).any()


def test_write_kv_donated_aliases_the_cache():
    args = make_inputs(np.random.default_rng(3))
    compiled = jax.jit(write_kv, donate_argnums=(0, 1)).lower(*args).compile()
    stats = compiled.memory_analysis()
    cache_bytes = 2 * args[0].size * args[0].dtype.itemsize
    if stats is not None:  # both caches alias their outputs: nothing cache-sized is new
        assert stats.alias_size_in_bytes == cache_bytes
        assert stats.temp_size_in_bytes < args[0].size * args[0].dtype.itemsize


@pytest.mark.parametrize("bad", ["k_shape", "v_dtype", "slots_shape", "layer", "cache"])
def test_write_kv_invalid_inputs_raise_value_error(bad):
    k_cache, v_cache, layer, k, v, slots = make_inputs(np.random.default_rng(0))
    args = dict(k_cache=k_cache, v_cache=v_cache, layer=layer, k=k, v=v, slot_mapping=slots)
    args.update({
        "k_shape": {"k": k[:, :1]},
        "v_dtype": {"v": v.astype(jnp.bfloat16)},
        "slots_shape": {"slot_mapping": slots[:3]},
        "layer": {"layer": jnp.zeros((2,), jnp.int32)},
        "cache": {"v_cache": v_cache[0]},
    }[bad])
    with pytest.raises(ValueError):
        write_kv(**args)
