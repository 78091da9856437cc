"""Mixture of experts (Mixtral, Qwen3-MoE) on the CPU: tiny random transformers models
saved with save_pretrained load with logits and greedy tokens equal to transformers'; the
routing equals a numpy reference, ties included (lowest expert index first); the grouped
experts equal a per-token loop over the chosen experts (separate, fused and fp8
weights); the engine's greedy tokens equal the dense reference with the prefix cache on,
off and automatic, with fp8 experts, and over 2 virtual devices (tensor parallelism
splitting each expert's F) equal one device's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_checks import device_env
from test_qwen3 import (
    BS,
    check_engine_modes,
    check_gguf_round_trip,
    check_parity,
    greedy,
    save_random_hf_model,
)

from jprefix import LLM
from jprefix.worker.parallel import check_tp_size
from models.config import PRESETS, from_hf_config
from models.fp8_linear import Fp8Weight, dequantize_weight, quantize_weight
from models.layout import quantize_linears
from models.loader import load
from models.moe import experts, route
from models.reference import dense_generate

ROOT = Path(__file__).resolve().parents[1]
TINY = {"mixtral": "tiny-mixtral", "qwen3_moe": "tiny-qwen3-moe"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{arch: (transformers model, loaded model)}"""
    out = {}
    for seed, (arch, name) in enumerate(TINY.items()):
        directory = tmp_path_factory.mktemp(arch)
        hf = save_random_hf_model(PRESETS[name], directory, seed)
        out[arch] = hf, load(directory, dtype="float32")
    return out


@pytest.mark.parametrize("arch", list(TINY))
def test_logits_and_greedy_tokens_match_transformers(models, arch):
    hf, loaded = models[arch]
    cfg = loaded.config
    assert cfg == PRESETS[TINY[arch]] and cfg.moe
    x = cfg.num_experts
    assert loaded.params.layers.w_gate.shape == (2, x, 64, cfg.intermediate_size)
    assert loaded.params.layers.router.shape == (2, 64, x)
    check_parity(hf, loaded)


def test_qwen3_moe_without_normalised_top_k_matches_transformers(tmp_path):
    """norm_topk_prob false (transformers' default): the top-k softmax weights as they are."""
    import dataclasses

    cfg = dataclasses.replace(PRESETS["tiny-qwen3-moe"], norm_topk_prob=False)
    hf = save_random_hf_model(cfg, tmp_path, seed=3)
    loaded = load(tmp_path, dtype="float32")
    assert loaded.config == cfg
    check_parity(hf, loaded, new_tokens=4)


def _numpy_route(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """softmax in float64, experts by descending probability, equal ones by ascending
    index (a stable sort), the first k; renormalised if `norm`."""
    z = np.exp(logits - logits.max(-1, keepdims=True))
    probs = z / z.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, -1)
    return (weights / weights.sum(-1, keepdims=True) if norm else weights), ids


@pytest.mark.parametrize("arch,norm", [("mixtral", True), ("qwen3_moe", False),
                                       ("qwen3_moe", True)])
def test_routing_equals_numpy_reference_with_ties(arch, norm):
    """Logits from {0, 1, 2} (many ties, at the top-k boundary too) and continuous ones;
    the router is the identity, so x is the logits."""
    import dataclasses

    cfg = dataclasses.replace(PRESETS[TINY[arch]], num_experts=16, num_experts_per_tok=4,
                              norm_topk_prob=norm)
    rng = np.random.default_rng(0)
    for logits in (rng.integers(0, 3, (64, 16)).astype(np.float32),
                   rng.normal(size=(64, 16)).astype(np.float32)):
        weights, ids = route(jnp.asarray(logits), jnp.eye(16), cfg)
        want_w, want_ids = _numpy_route(logits.astype(np.float64), 4, norm)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-6)
    assert weights.dtype == jnp.float32  # (model dtype float32 here for both families)


def _loop_experts(x, weights, ids, gate, up, down):
    """Per token, per chosen expert, in numpy float64: sum_j w_j * down(silu(g) * u)."""
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t], strict=True):
            g, u = x[t] @ gate[e], x[t] @ up[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("form", ["separate", "fused", "fp8"])
def test_grouped_experts_equal_a_per_token_loop(form):
    """13 tokens, top-3 of 6 experts (one expert chosen by no token: an empty group)."""
    rng = np.random.default_rng(5)
    t, k, x_, e, f = 13, 3, 6, 32, 24
    x = rng.normal(size=(t, e)).astype(np.float32)
    gate, up = (0.3 * rng.normal(size=(x_, e, f)).astype(np.float32) for _ in range(2))
    down = 0.3 * rng.normal(size=(x_, f, e)).astype(np.float32)
    ids = np.stack([rng.choice(5, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.uniform(size=(t, k)).astype(np.float32)
    args = [jnp.asarray(w) for w in (gate, up, down)]
    if form == "fused":
        args = [jnp.concatenate(args[:2], axis=-1), None, args[2]]
    if form == "fp8":
        args = [quantize_weight(w) for w in args]
        assert args[0].scale.shape == (x_, f)  # per expert, per output channel
        gate, up, down = (np.asarray(dequantize_weight(w)) for w in args)
    with jax.default_matmul_precision("highest"):
        got = experts(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(ids), *args)
    want = _loop_experts(x.astype(np.float64), weights, ids, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", list(TINY))
def test_engine_matches_dense_with_cache_on_auto_and_off(models, arch):
    check_engine_modes(models[arch][1], attention_backend="xla")


def test_fused_experts_with_pallas_kernels_match_dense(models):
    """unroll_layers (GPU's layout): each expert's [gate | up] fused, q/k norms before the
    fused RoPE + KV-write kernel, interpreted Pallas attention."""
    model = models["qwen3_moe"][1]
    prompt = np.random.default_rng(2).integers(3, 256, 19).tolist()
    want = dense_generate(model.params, model.config, prompt, 4, eos_token_ids=())
    llm = LLM(model, block_size=BS, num_kv_blocks=32, unroll_layers=True,
              attention_backend="pallas-interpret")
    layers = llm.engine.runner.params.layers
    assert layers[0].w_up is None and layers[0].w_gate.shape == (8, 64, 64)
    assert llm.generate([prompt], greedy(4), use_tqdm=False)[0].token_ids == want


def test_fp8_experts_equal_dense_on_the_quantised_weights(models):
    model = models["mixtral"][1]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, n).tolist() for n in (9, 17)]
    qparams = quantize_linears(model.params)
    want = [dense_generate(qparams, model.config, p, 4, eos_token_ids=()) for p in prompts]
    llm = LLM(model, block_size=BS, num_kv_blocks=32, attention_backend="xla",
              quantization="fp8")
    layers = llm.engine.runner.params.layers
    assert isinstance(layers[0].w_gate, Fp8Weight) and layers[0].w_gate.scale.shape == (4, 48)
    assert not isinstance(layers[0].router, Fp8Weight)
    assert [o.token_ids for o in llm.generate(prompts, greedy(4), use_tqdm=False)] == want


MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1's config.json
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 32000}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_published_configs_give_the_presets_and_unsupported_features_are_refused():
    import dataclasses

    assert from_hf_config(MIXTRAL_8X7B) == PRESETS["mixtral-8x7b"]
    assert from_hf_config(QWEN3_30B_A3B) == PRESETS["qwen3-30b-a3b"]
    for bad, name in (({"decoder_sparse_step": 2}, "decoder_sparse_step"),
                      ({"mlp_only_layers": [0, 5]}, "mlp_only_layers"),
                      ({"use_sliding_window": True}, "use_sliding_window")):
        with pytest.raises(ValueError, match=name):
            from_hf_config({**QWEN3_30B_A3B, **bad})
    with pytest.raises(ValueError, match="sliding_window"):
        from_hf_config({**MIXTRAL_8X7B, "sliding_window": 4096})
    # (some Mixtral configs set the window to the whole context: no window)
    assert from_hf_config({**MIXTRAL_8X7B, "sliding_window": 32768}) == PRESETS["mixtral-8x7b"]
    odd = dataclasses.replace(PRESETS["tiny-mixtral"], intermediate_size=50)
    with pytest.raises(ValueError, match="intermediate_size 50"):
        check_tp_size(odd, 4)


# Tensor parallelism on 2 virtual CPU devices: each expert's F split in halves; stacked
# layers (lax.scan) and the fused per-shard layout ([gate_s | up_s] per expert); greedy
# tokens with the prefix cache equal one device's and the dense reference's
TP_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    import jprefix
    from jprefix import LLM, SamplingParams
    from models.reference import dense_generate
    assert len(jax.devices()) == 2, jax.devices()
    import dataclasses
    model = jprefix.load(sys.argv[1], dtype="float32", load_format="dummy", seed=3)
    lp = model.params.layers  # experts and router x8: the tokens depend on the experts

    def with_layers(**kw):
        return dataclasses.replace(model.params, layers=dataclasses.replace(lp, **kw))

    model = dataclasses.replace(model, params=with_layers(
        w_gate=8 * lp.w_gate, w_up=8 * lp.w_up, w_down=8 * lp.w_down, router=8 * lp.router))
    lp = model.params.layers
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 256, 24).tolist()
    prompts = [shared + rng.integers(3, 256, n).tolist() for n in (3, 7, 12)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [dense_generate(model.params, model.config, p, 5, eos_token_ids=())
            for p in prompts]
    no_experts = with_layers(w_down=0 * lp.w_down)
    assert want != [dense_generate(no_experts, model.config, p, 5, eos_token_ids=())
                    for p in prompts]
    for tp, unroll in ((1, False), (2, False), (2, True)):
        llm = LLM(model, tensor_parallel_size=tp, block_size=8, num_kv_blocks=64,
                  attention_backend="xla", unroll_layers=unroll)
        got = [o.token_ids for o in llm.generate(prompts, sp, prefix_pos=24, use_tqdm=False)]
        assert got == want, (tp, unroll, got, want)
        layers = llm.engine.runner.params.layers
        w = layers[0].w_gate if unroll else layers.w_gate
        if tp == 2:  # each device holds half of every expert's F
            assert w.addressable_shards[0].data.shape[-1] == w.shape[-1] // 2, w.sharding
    by_name = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", load_format="dummy",
                  block_size=8, num_kv_blocks=64, attention_backend="xla")
    w = by_name.engine.model.params.layers.w_down  # [L, X, F, E], loaded split by F
    assert w.addressable_shards[0].data.shape[2] == w.shape[2] // 2, w.sharding
    assert len(by_name.generate(prompts, sp, use_tqdm=False)[0].token_ids) == 5
""")


def test_two_device_tensor_parallel_matches_one_device_and_dense():
    """Qwen3-MoE (Mixtral's experts run the same code)."""
    env = device_env(2)
    run = subprocess.run([sys.executable, "-c", TP_SCRIPT, "tiny-qwen3-moe"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]


@pytest.mark.parametrize("arch", list(TINY))
def test_gguf_loads_the_same_weights(models, arch, tmp_path):
    """qwen3moe, and Mixtral as llama.cpp files it (`llama` with an expert count)."""
    check_gguf_round_trip(models[arch][1], tmp_path / f"{arch}.gguf")
