"""Model invariants on tiny random configs: the attention seam, the dense references, presets."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import PRESETS, ModelConfig, from_hf_config
from models.layout import fuse_projections, param_partition_specs, unstack_layers
from models.llama import LAYOUTS, compute_logits, forward, rope_inv_freq
from models.reference import (
    causal_attention,
    dense_cache_attn,
    dense_forward,
    dense_generate,
    init_dense_cache,
)
from models.weights import init_params

TINY = ["tiny-llama", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-smollm2"]


def _random_params(cfg: ModelConfig, seed: int = 0):
    """init_params with weights scaled up so logits are far from uniform."""
    params = init_params(cfg, jax.random.key(seed), jnp.float32)
    return jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)


def _chunked_forward(params, cfg, tokens, chunks):
    """Run forward chunk by chunk through a contiguous cache; logits of every position."""
    cache = init_dense_cache(cfg, tokens.shape[0], 64, jnp.float32)
    outs, start = [], 0
    for size in chunks:
        ids = tokens[:, start:start + size]
        pos = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), ids.shape)
        hidden, cache = forward(params, cfg, ids, pos, cache, dense_cache_attn)
        cache = type(cache)(cache.k, cache.v, cache.length + size)
        outs.append(compute_logits(params, cfg, hidden))
        start += size
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen2", "tiny-smollm2"])
def test_forward_through_cache_seam_equals_dense_forward(name):
    cfg = PRESETS[name]
    params = _random_params(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 21), 0, cfg.vocab_size)
    want = dense_forward(params, cfg, tokens)
    got = jax.jit(_chunked_forward, static_argnums=(1, 3))(params, cfg, tokens, (13, 1, 7))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_forward_accepts_flat_tokens_like_the_engine():
    cfg = PRESETS["tiny-llama"]
    params = _random_params(cfg)
    tokens = jax.random.randint(jax.random.key(2), (1, 9), 0, cfg.vocab_size)
    pos = jnp.arange(9, dtype=jnp.int32)
    layers_seen = []

    def attn(q, k, v, cache, layer):
        layers_seen.append(layer.dtype)
        out = causal_attention(q[None], k[None], v[None], pos, pos)[0]
        return out, cache

    hidden, cache = forward(params, cfg, tokens[0], pos, None, attn)
    assert hidden.shape == (9, cfg.hidden_size) and cache is None
    assert layers_seen == [jnp.int32]  # traced once under scan
    np.testing.assert_allclose(compute_logits(params, cfg, hidden),
                               dense_forward(params, cfg, tokens)[0], atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_dense_generate_is_argmax_of_dense_forward(name):
    cfg = PRESETS[name]
    params = _random_params(cfg, seed=3)
    prompt = [5, 17, 99, 3, 42]
    out = dense_generate(params, cfg, prompt, 12, eos_token_ids=())
    assert len(out) == 12
    logits = dense_forward(params, cfg, jnp.asarray([prompt + out]))
    want = np.asarray(jnp.argmax(logits[0, len(prompt) - 1:-1], axis=-1)).tolist()
    assert out == want


def test_dense_generate_stops_at_eos():
    cfg = PRESETS["tiny-llama"]
    params = _random_params(cfg, seed=3)
    full = dense_generate(params, cfg, [5, 17, 99], 8, eos_token_ids=())
    stopped = dense_generate(params, cfg, [5, 17, 99], 8, eos_token_ids=(full[2],))
    assert stopped == full[:full.index(full[2]) + 1]


def test_llama3_rope_scaling_keeps_high_and_scales_low_frequencies():
    cfg = PRESETS["tiny-llama3"]
    plain = rope_inv_freq(ModelConfig(**{**cfg.__dict__, "rope_scaling": None}))
    scaled = rope_inv_freq(cfg)
    factor = cfg.rope_scaling_dict["factor"]
    assert scaled[0] == plain[0]  # wavelength 2*pi < high-frequency cutoff
    np.testing.assert_allclose(scaled[-1], plain[-1] / factor, rtol=1e-6)
    assert bool(jnp.all(scaled <= plain)) and bool(jnp.all(scaled >= plain / factor))


@pytest.mark.parametrize("name,billions", [
    ("llama-2-7b", 6.74), ("llama-2-13b", 13.02), ("llama-2-70b", 68.98),
    ("llama-3-8b", 8.03), ("mistral-7b", 7.24), ("qwen2-7b", 7.62), ("smollm2-135m", 0.1345),
])
def test_preset_parameter_counts_match_published_sizes(name, billions):
    shapes = jax.eval_shape(lambda k: init_params(PRESETS[name], k), jax.random.key(0))
    count = sum(x.size for x in jax.tree.leaves(shapes))
    assert abs(count / 1e9 - billions) / billions < 0.01


def test_partition_specs_cover_every_param_with_matching_rank():
    cfg = PRESETS["tiny-qwen2"]
    shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    specs = param_partition_specs(cfg)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(shapes)
    for spec, x in zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(shapes),
                       strict=True):
        assert len(spec) in (0, x.ndim)


def test_from_hf_config_reads_v4_and_v5_rope_layouts():
    base = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                eos_token_id=[2, 3])
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    v4 = from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": rope})
    v5 = from_hf_config({**base, "rope_parameters": {**rope, "rope_theta": 5e5}})
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.eos_token_ids == (2, 3)
    assert v4.rope_scaling == PRESETS["tiny-llama3"].rope_scaling
    assert hash(v4) == hash(v5)


@pytest.mark.parametrize("bad,match", [
    ({"model_type": "gpt2"}, "gpt2"),
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
])
def test_from_hf_config_rejects_unsupported(bad, match):
    base = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ValueError, match=match):
        from_hf_config({**base, **bad})


def test_tiny_presets_exist_for_every_arch():
    assert {PRESETS[n].arch for n in TINY} == {"llama", "mistral", "qwen2"}
    assert PRESETS["tiny-smollm2"].tie_word_embeddings and PRESETS["tiny-qwen2"].attention_bias


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen2"])  # GQA; qkv bias
def test_per_layer_and_fused_projection_layouts_equal_the_stacked_model(name):
    cfg = PRESETS[name]
    params = _random_params(cfg)
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size)
    want = dense_forward(params, cfg, tokens)
    per_layer = unstack_layers(params)
    fused = fuse_projections(per_layer)
    lp = fused.layers[0]
    assert lp.wk is None and lp.w_up is None and (lp.bq is None) == (not cfg.attention_bias)
    assert lp.wq.shape[-1] == (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    assert fuse_projections(fused).layers[0].wq is lp.wq  # idempotent
    direct = unstack_layers(params, fuse=True)  # fused straight from the stacks
    assert jax.tree.structure(direct) == jax.tree.structure(fused)
    for p in (per_layer, fused, direct):
        np.testing.assert_allclose(dense_forward(p, cfg, tokens), want, atol=2e-4, rtol=1e-4)


def test_every_layout_gives_the_dense_reference_logits_and_bad_layouts_raise():
    cfg = PRESETS["tiny-qwen2"]  # GQA and qkv bias
    params = _random_params(cfg)
    tokens = jax.random.randint(jax.random.key(4), (2, 11), 0, cfg.vocab_size)
    want = dense_forward(params, cfg, tokens)
    laid = {"stacked": params, "per_layer": unstack_layers(params),
            "fused": unstack_layers(params, fuse=True)}
    run = jax.jit(_chunked_forward, static_argnums=(1, 3))  # the layout is static metadata
    for layout in LAYOUTS:
        assert laid[layout].layout == layout
        got = run(laid[layout], cfg, tokens, (7, 4))
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4, err_msg=layout)
    with pytest.raises(ValueError, match="'unrolled'"):
        dataclasses.replace(params, layout="unrolled")
    for params_of, layout in (("stacked", "per_layer"), ("per_layer", "stacked"),
                              ("per_layer", "fused"), ("fused", "per_layer")):
        wrong = dataclasses.replace(laid[params_of], layout=layout)
        with pytest.raises(ValueError, match=f"layout '{layout}'"):
            forward(wrong, cfg, tokens, tokens, None, lambda q, k, v, c, i: (q, c))
