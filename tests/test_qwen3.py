"""Qwen3 (dense) on the CPU: a tiny random transformers Qwen3 saved with save_pretrained
loads, its logits and greedy tokens equal transformers' (float32), and the engine's greedy
tokens equal the dense reference with the prefix cache on, off and automatic, through the
XLA path and the fused layout whose q/k norms precede the fused RoPE + KV-write kernel.
The helpers here (`hf_config`, `save_random_hf_model`) also serve tests/test_moe.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_parity import (
    dense_greedy,
    dense_logits,
    dense_tokens,
    greedy,
    hf_greedy,
    hf_logits,
    randomize_and_save,
)

from jprefix import LLM
from models.config import PRESETS, ModelConfig, from_hf_config
from models.loader import load

BS = 8


def hf_config(cfg: ModelConfig, **extra) -> transformers.PretrainedConfig:
    """The transformers config of one of our tiny Qwen3 / Mixtral / Qwen3-MoE presets."""
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
              max_position_embeddings=cfg.max_position_embeddings,
              tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
              eos_token_id=list(cfg.eos_token_ids))
    if cfg.arch == "qwen3":
        return transformers.Qwen3Config(intermediate_size=cfg.intermediate_size, **kw, **extra)
    moe = dict(num_experts_per_tok=cfg.num_experts_per_tok)
    if cfg.arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=cfg.intermediate_size,
                                          num_local_experts=cfg.num_experts, **moe, **kw,
                                          **extra)
    return transformers.Qwen3MoeConfig(  # (its dense intermediate_size is unused)
        intermediate_size=4 * cfg.hidden_size, moe_intermediate_size=cfg.intermediate_size,
        num_experts=cfg.num_experts, norm_topk_prob=cfg.norm_topk_prob, **moe, **kw, **extra)


def save_random_hf_model(cfg: ModelConfig, directory, seed: int = 0, **extra):
    """A transformers model of `cfg` with random non-trivial weights (norms around 1),
    saved with save_pretrained; returns the torch model (float32, eval)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg, **extra))
    return randomize_and_save(model.float().eval(), directory, std=0.15)


def check_parity(hf_model, loaded, length: int = 24, new_tokens: int = 8) -> None:
    """Logits of two random sequences within 1e-4 of transformers', and transformers'
    greedy generation equal to the dense reference's."""
    cfg = loaded.config
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, length))
    want = hf_logits(hf_model, ids)
    diff = float(np.abs(dense_logits(loaded, ids) - want).max())
    print(f"{cfg.arch}: max abs logit diff {diff:.2e} (max |logit| {np.abs(want).max():.1f})")
    assert diff < 1e-4
    prompt = ids[0].tolist()
    assert dense_greedy(loaded, prompt, new_tokens) == hf_greedy(hf_model, prompt, new_tokens)


def check_engine_modes(model, **llm_kw) -> None:
    """The engine's greedy tokens equal the dense reference's with the prefix cache on
    (explicit prefix), automatic and off, over two rounds (the second starts from the
    cached prefix)."""
    rng = np.random.default_rng(1)
    shared = rng.integers(3, model.config.vocab_size, 21).tolist()
    prompts = [shared + rng.integers(3, model.config.vocab_size, n).tolist()
               for n in (1, 6, 13)]
    want = dense_tokens(model, prompts, 5)
    for mode in ("explicit", "auto", "off"):
        llm = LLM(model, block_size=BS, enable_prefix_caching=mode != "off",
                  num_kv_blocks=48, **llm_kw)
        for _ in range(2):
            outs = llm.generate(prompts, greedy(5), use_tqdm=False,
                                prefix_pos=16 if mode == "explicit" else None)
            assert [o.token_ids for o in outs] == want, mode
        assert all(o.num_cached_tokens >= (0 if mode == "off" else 16) for o in outs)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    hf = save_random_hf_model(PRESETS["tiny-qwen3"], directory)
    return hf, load(directory, dtype="float32")


def test_qwen3_logits_and_greedy_tokens_match_transformers(qwen3):
    hf, loaded = qwen3
    assert loaded.config == PRESETS["tiny-qwen3"] and loaded.config.qk_norm
    assert loaded.params.layers.q_norm.shape == (2, 16)  # [L, D]: one weight per layer
    check_parity(hf, loaded)


def test_qwen3_engine_matches_dense_with_cache_on_auto_and_off(qwen3):
    check_engine_modes(qwen3[1], attention_backend="xla")


def test_qwen3_fused_layout_normalises_before_the_fused_rope_kernel(qwen3):
    """unroll_layers: fused Q/K/V, whose q and k heads are normalised in place before
    rope_write_kv rotates them (interpreted Pallas kernels)."""
    model = qwen3[1]
    prompt = np.random.default_rng(2).integers(3, 256, 19).tolist()
    (want,) = dense_tokens(model, [prompt], 4)
    llm = LLM(model, block_size=BS, num_kv_blocks=32, unroll_layers=True,
              attention_backend="pallas-interpret")
    assert llm.engine.runner.params.layout == "fused"
    assert llm.generate([prompt], greedy(4), use_tqdm=False)[0].token_ids == want


QWEN3_8B = {  # Qwen/Qwen3-8B's config.json
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_published_config_gives_the_preset_and_unsupported_features_are_refused():
    assert from_hf_config(QWEN3_8B) == PRESETS["qwen3-8b"]
    with pytest.raises(ValueError, match="use_sliding_window"):
        from_hf_config({**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096})
    with pytest.raises(ValueError, match="sliding_attention"):
        from_hf_config({**QWEN3_8B, "layer_types": ["sliding_attention"] * 36})


_GGUF_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


def write_gguf(loaded, path) -> None:
    """The loaded model's weights as llama.cpp files them (float32, HF orientation, its
    tensor names and metadata; Q/K rows permuted for the `llama` architecture)."""
    import gguf

    from models.gguf_loader import gguf_tensor_name

    cfg, params = loaded.config, loaded.params
    arch = _GGUF_ARCH[cfg.arch]
    w = gguf.GGUFWriter(path, arch)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if cfg.moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    for field in ("embed", "final_norm", "lm_head"):
        w.add_tensor(gguf_tensor_name(field, None), _hf(field, getattr(params, field)))
    for f in dataclasses.fields(params.layers):
        stack = getattr(params.layers, f.name)
        for i in range(0 if stack is None else cfg.num_layers):
            arr = _hf(f.name, stack[i])
            if arch == "llama" and f.name in ("wq", "wk"):  # llama.cpp's permutation
                heads = cfg.num_heads if f.name == "wq" else cfg.num_kv_heads
                arr = arr.reshape(heads, 2, -1, arr.shape[-1]).swapaxes(1, 2).reshape(arr.shape)
            w.add_tensor(gguf_tensor_name(f.name, i, cfg.moe), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf(field: str, x) -> np.ndarray:
    """A Params array in HF orientation ([out, in], experts [X, out, in])."""
    from models.weights import _TRANSPOSED

    arr = np.asarray(x, np.float32)
    return np.swapaxes(arr, -1, -2) if field in _TRANSPOSED else arr


def check_gguf_round_trip(loaded, path) -> None:
    """A GGUF of the model loads back to the same config and weights."""
    from models.gguf_loader import load_gguf

    write_gguf(loaded, path)
    params, cfg = load_gguf(path, jnp.float32)
    assert cfg.rms_norm_eps == pytest.approx(loaded.config.rms_norm_eps)  # (float32 there)
    assert cfg == dataclasses.replace(loaded.config, bos_token_id=None, eos_token_ids=(),
                                      rms_norm_eps=cfg.rms_norm_eps)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(loaded.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_qwen3_gguf_loads_the_same_weights(qwen3, tmp_path):
    check_gguf_round_trip(qwen3[1], tmp_path / "qwen3.gguf")
