"""Gemma 3 (text): a tiny `Gemma3ForCausalLM` saved by transformers (two 16-token window
layers with the local RoPE base, one full layer with the global base and linear RoPE
scaling; q/k norms, sandwich norms with Gemma's 1 + w weights, a scaled embedding,
GeGLU, tied embeddings, query_pre_attn_scalar unlike head_dim) against transformers in
float32 for prompts longer than the window, and the engine's greedy tokens with the
prefix cache hitting a prefix longer than the window equal to the dense reference on
the XLA path and the Pallas kernels (interpret mode on CPU). Also the features refused
by name.
"""

import jax
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
    shared_prefix_prompts,
)

from jprefix import LLM
from models.config import ModelConfig
from models.loader import load

PALLAS = "pallas" if jax.default_backend() == "gpu" else "pallas-interpret"
WINDOW = 16
TYPES = ["sliding_attention", "sliding_attention", "full_attention"]
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, sliding_window=WINDOW, layer_types=TYPES,
             query_pre_attn_scalar=24, rope_scaling={"rope_type": "linear", "factor": 4.0})


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SHAPE)).float().eval()
    randomize_and_save(hf, directory, std=0.3, norm_mean=0.0)  # Gemma's norms: 1 + w
    return hf, load(directory, dtype="float32")


def test_config_reads_gemma3_fields(gemma):
    cfg = gemma[1].config
    assert cfg.layer_windows == (WINDOW, WINDOW, None)
    assert cfg.tie_word_embeddings and cfg.qk_norm
    assert cfg.attn_scale == pytest.approx(24 ** -0.5)


def test_logits_match_transformers_past_the_window(gemma):
    hf, model = gemma
    ids = np.random.default_rng(0).integers(3, 128, (2, 3 * WINDOW + 7))
    assert np.abs(dense_logits(model, ids) - hf_logits(hf, ids)).max() < 1e-4


def test_greedy_tokens_match_transformers(gemma):
    hf, model = gemma
    prompt = np.random.default_rng(1).integers(3, 128, 3 * WINDOW).tolist()
    assert dense_greedy(model, prompt, 10) == hf_greedy(hf, prompt, 10)


@pytest.mark.parametrize("backend", ["xla", PALLAS])
def test_engine_greedy_equals_dense(gemma, backend):
    _, model = gemma
    prompts = shared_prefix_prompts(2, 40, [2, 19])
    want = dense_tokens(model, prompts, 8)
    llm = LLM(model, block_size=8, num_kv_blocks=48, attention_backend=backend,
              unroll_layers=backend != "xla")
    for _ in range(2):  # the second round hits the 40-token prefix (longer than the window)
        outs = llm.generate(prompts, greedy(8), use_tqdm=False)
        assert [o.token_ids for o in outs] == want
    assert all(o.num_cached_tokens >= 40 for o in outs)


@pytest.mark.parametrize("field,value", [
    ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
    ("use_bidirectional_attention", True), ("hidden_activation", "relu")])
def test_unsupported_gemma3_features_are_refused_by_name(field, value):
    hf = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=8,
              hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
              head_dim=4, **{field: value})
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(hf)
