"""Sliding-window models end to end: a tiny Mistral with a 24-token window (saved by
transformers) against transformers in float32 (logits and greedy tokens) for prompts
longer than the window, and the engine's greedy tokens with the prefix cache off,
explicit and automatic (a cached prefix longer than the window is hit) equal to the
dense reference, on the XLA path and the Pallas kernels (interpret mode on CPU), while
sequences free the blocks that leave their window. Also a model mixing window and full
layers (Qwen2's `use_sliding_window`) with cascade decoding, and the config's refusals.
"""

import dataclasses
import textwrap

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
    shared_prefix_prompts,
)
from subprocess_checks import assert_check, check_names
from test_tensor_parallel import PRELUDE, two_device_run

from jprefix import LLM
from models.config import ModelConfig
from models.loader import load
from models.reference import dense_forward

WINDOW, BS = 24, 8
PALLAS = "pallas" if jax.default_backend() == "gpu" else "pallas-interpret"
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False)


def _save(hf_config, directory, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="eager").float().eval()
    return randomize_and_save(model, directory, std=0.3)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral_window")
    hf = _save(transformers.MistralConfig(sliding_window=WINDOW, rope_theta=10000.0, **SHAPE),
               directory)
    return hf, load(directory, dtype="float32")


@pytest.fixture(scope="module")
def qwen2_mixed(tmp_path_factory):
    """Layer 0 full attention, layers 1-2 a 16-token window (max_window_layers=1)."""
    directory = tmp_path_factory.mktemp("qwen2_window")
    cfg = transformers.Qwen2Config(use_sliding_window=True, sliding_window=16,
                                   max_window_layers=1, **{**SHAPE, "num_hidden_layers": 3})
    return _save(cfg, directory, seed=1), load(directory, dtype="float32")


@pytest.mark.parametrize("which", ["mistral", "qwen2_mixed"])
def test_logits_match_transformers_past_the_window(which, request):
    hf, model = request.getfixturevalue(which)
    windows = model.config.layer_windows
    assert windows == ((WINDOW, WINDOW) if which == "mistral" else (None, 16, 16))
    ids = np.random.default_rng(0).integers(3, 128, (2, 3 * WINDOW + 5))
    want = hf_logits(hf, ids)
    assert np.abs(dense_logits(model, ids) - want).max() < 1e-4
    # the window matters: without it the late positions' logits differ
    no_window = dataclasses.replace(model.config, sliding_window=None, layer_types=None)
    with jax.default_matmul_precision("highest"):
        full = np.asarray(dense_forward(model.params, no_window, jnp.asarray(ids)))
    assert np.abs(full[:, -1] - want[:, -1]).max() > 1e-2


def test_greedy_tokens_match_transformers(mistral):
    hf, model = mistral
    prompt = np.random.default_rng(1).integers(3, 128, 2 * WINDOW).tolist()
    assert dense_greedy(model, prompt, 12) == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize("backend,mode", [  # (interpret mode is slow: Pallas once)
    ("xla", "off"), ("xla", "explicit"), ("xla", "auto"), (PALLAS, "auto")])
def test_engine_greedy_equals_dense_with_cache_modes(mistral, mode, backend):
    _, model = mistral
    prompts = shared_prefix_prompts(2, 2 * WINDOW, [3, 17, 30])  # 51-78 tokens, windows 24
    want = dense_tokens(model, prompts, 16)
    llm = LLM(model, block_size=BS, num_kv_blocks=96, enable_prefix_caching=mode != "off",
              attention_backend=backend, enable_cascade=True, cascade_min_group=2,
              cascade_min_blocks=1, unroll_layers=backend != "xla")  # (Pallas: fused Q/K/V)
    prefix = 2 * WINDOW if mode == "explicit" else None
    for _ in range(2):  # the second round hits the 48-token prefix: longer than the window
        outs = llm.generate(prompts, greedy(16), prefix_pos=prefix, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
    if mode != "off":
        assert all(o.num_cached_tokens >= 2 * WINDOW for o in outs)
    # (no cascade for a model whose every layer has a window: its sequences free blocks)
    assert not any(shape[4] for shape in llm.engine.runner.shapes_seen)
    bm = llm.engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks - 1


def test_freed_window_blocks_let_long_sequences_run_without_preemption(mistral):
    """Three sequences of 67-94 tokens need 32 blocks of 8 if every block is kept (3-4
    preemptions with these 19); 19 fit them all at once when each holds only its
    window's blocks and its chunk's."""
    _, model = mistral
    prompts = shared_prefix_prompts(5, 2 * WINDOW, [3, 17, 30])
    llm = LLM(model, block_size=BS, num_kv_blocks=20, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert [o.token_ids for o in outs] == dense_tokens(model, prompts, 16)
    assert llm.engine.stats.num_preemptions == 0


@pytest.mark.parametrize("backend,unroll", [("xla", False), (PALLAS, False), (PALLAS, True)])
def test_engine_mixed_window_and_full_layers_equal_dense(qwen2_mixed, backend, unroll):
    """Stacked layers read each layer's window at the traced layer (cascade under
    lax.cond); unrolled ones get it static. (One block table for every layer: the
    hybrid cache, which plans no cascade, is tests/test_hybrid_engine.py's.)"""
    _, model = qwen2_mixed
    prompts = shared_prefix_prompts(3, 40, [2, 21])
    llm = LLM(model, block_size=BS, num_kv_blocks=64, enable_cascade=True,
              cascade_min_group=2, cascade_min_blocks=1, attention_backend=backend,
              unroll_layers=unroll, disable_hybrid_kv_cache_manager=True)
    want = dense_tokens(model, prompts, 10)
    for _ in range(2):
        outs = llm.generate(prompts, greedy(10), use_tqdm=False)
        assert [o.token_ids for o in outs] == want
    assert any(shape[4] for shape in llm.engine.runner.shapes_seen)  # cascade steps


def test_mistral_configs_window_as_transformers_reads_them():
    hf = dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=8,
              hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2)
    assert ModelConfig.from_hf_config(hf).sliding_window == 4096  # no key: its default
    assert ModelConfig.from_hf_config({**hf, "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_hf_config({**hf, "sliding_window": 64}).layer_windows == (64, 64)


@pytest.mark.parametrize("kw,match", [
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=8, layer_types=("sliding_attention",)), "layer_types"),
    (dict(sliding_window=8, layer_types=("chunked_attention",) * 2), "chunked_attention"),
])
def test_bad_window_config_raises_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig("mistral", 8, 8, 8, 2, 2, 2, 4, **kw)


# Tensor parallelism: each device attends its heads with the layer's window; greedy
# tokens on 2 (virtual CPU) devices equal one device's and the dense reference's, for a
# model mixing full and window layers (cascade steps on its full layers) and a Gemma 3
# (GeGLU per shard, its norms whole)
TP_SCRIPT = PRELUDE + textwrap.dedent("""
    from models.reference import dense_generate
    for name in ("tiny-mixed-window", "tiny-gemma3"):
        model = jprefix.load(name, dtype="float32", load_format="dummy")
        rng = np.random.default_rng(0)
        prompts = [p + rng.integers(3, 200, 30).tolist() for p in shared_prompts(0)]
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        out = {}
        for tp in (1, 2):
            llm = LLM(model, tensor_parallel_size=tp, block_size=8, num_kv_blocks=64,
                      attention_backend=backend, cascade_min_group=2, cascade_min_blocks=1,
                      unroll_layers=backend == "xla")
            llm.generate(prompts[:1], sp, use_tqdm=False)
            out[tp] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        want = [dense_generate(model.params, model.config, p, 6, eos_token_ids=())
                for p in prompts]
        assert out[1] == out[2] == want, (name, out, want)
""")


@pytest.mark.parametrize("check", check_names(TP_SCRIPT))
def test_two_device_tensor_parallel_window_models_match_one_device(check):
    # (one subprocess on 2 devices, XLA; each assertion in it is a test here, by name)
    assert_check(two_device_run(TP_SCRIPT, "xla"), check)
