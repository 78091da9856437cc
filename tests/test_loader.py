"""Loading: logits parity with transformers (safetensors dirs and the real SmolLM2 GGUF),
dummy presets on device, and clear errors for bad checkpoints."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_parity import dense_logits, hf_logits, randomize_and_save

from models.config import PRESETS, ModelConfig
from models.loader import load
from models.reference import dense_forward, dense_generate

_HF_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}


def _hf_config(cfg: ModelConfig) -> transformers.PretrainedConfig:
    """The transformers config equivalent to one of our (tiny) presets."""
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
              head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
              rope_scaling=cfg.rope_scaling_dict or None,
              max_position_embeddings=cfg.max_position_embeddings,
              tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
              eos_token_id=list(cfg.eos_token_ids))
    if cfg.arch == "mistral":
        kw["sliding_window"] = None
    if cfg.arch == "llama":
        kw["attention_bias"] = cfg.attention_bias
    return getattr(transformers, _HF_CLASSES[cfg.arch])(**kw)


def _save_random_hf_model(cfg: ModelConfig, directory, seed=0, **save_kw):
    """A transformers model with random (non-trivial) weights, saved as safetensors."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(cfg)).float().eval()
    return randomize_and_save(model, directory, std=0.15, **save_kw)


PARITY = [("tiny-llama", {}), ("tiny-llama3", {}), ("tiny-mistral", {}), ("tiny-qwen2", {}),
          ("tiny-smollm2", {}), ("tiny-llama", {"max_shard_size": "40KB"})]


@pytest.mark.parametrize("name,save_kw", PARITY, ids=[p[0] + ("-sharded" if p[1] else "")
                                                      for p in PARITY])
def test_logits_match_transformers_float32(name, save_kw, tmp_path):
    cfg = PRESETS[name]
    hf = _save_random_hf_model(cfg, tmp_path, **save_kw)
    if save_kw:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    loaded = load(tmp_path, dtype="float32")
    assert loaded.config == cfg and loaded.tokenizer is None
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    want = hf_logits(hf, ids)
    diff = float(np.abs(dense_logits(loaded, ids) - want).max())
    print(f"{name}{' sharded' if save_kw else ''}: max abs logit diff {diff:.2e} "
          f"(max |logit| {np.abs(want).max():.1f})")
    assert diff < 1e-4


def test_bfloat16_load_converts_every_tensor(tmp_path):
    _save_random_hf_model(PRESETS["tiny-qwen2"], tmp_path)
    f32 = load(tmp_path, dtype="fp32")
    bf16 = load(tmp_path, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(bf16.params)} == {jnp.dtype(jnp.bfloat16)}
    ids = jnp.arange(16)[None] % 256
    a = dense_forward(f32.params, f32.config, ids)
    b = dense_forward(bf16.params, bf16.config, ids)
    assert b.dtype == jnp.float32
    assert float(jnp.abs(a - b).max()) < 0.05 * float(jnp.abs(a).max())


def test_dummy_preset_is_created_on_device_with_preset_shapes():
    loaded = load("tiny-llama3", load_format="dummy", seed=1)
    assert loaded.tokenizer is None and loaded.config == PRESETS["tiny-llama3"]
    assert loaded.params.layers.wq.shape == (2, 64, 64)
    leaves = jax.tree.leaves(loaded.params)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.bfloat16 for x in leaves)
    logits = dense_forward(loaded.params, loaded.config, jnp.zeros((1, 4), jnp.int32))
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_dummy_weights_take_tensor_parallel_shardings_from_a_mesh():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    loaded = load("tiny-qwen2", "float32", load_format="dummy", mesh=mesh)
    wq = loaded.params.layers.wq
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")


def test_hub_id_goes_through_snapshot_download(tmp_path, monkeypatch):
    import models.loader

    _save_random_hf_model(PRESETS["tiny-mistral"], tmp_path)
    monkeypatch.setattr(models.loader, "snapshot", lambda repo_id: tmp_path)
    loaded = load("someone/tiny-mistral", "float32")
    assert loaded.name == "someone/tiny-mistral" and loaded.config == PRESETS["tiny-mistral"]


def test_unreachable_hub_raises_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="someone/not-a-model.*hub"):
        load("someone/not-a-model")


# ---- the real model: SmolLM2-135M-Instruct GGUF against transformers' own GGUF loading ----

@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf):
    # torch's CPU threads contend with XLA's on small machines, and denormal activations
    # make its kernels ~10x slower: one thread with denormals flushed (no logit changes
    # above 1e-38) keeps this test fast. Both are restored afterwards.
    threads = torch.get_num_threads()
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    ours = load(smollm2_gguf, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    yield ours, hf
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)


def _chat_ids(tokenizer, text):
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def test_smollm2_gguf_logits_match_transformers(smollm2_pair):
    ours, hf = smollm2_pair
    assert ours.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    preset = PRESETS["smollm2-135m"]
    assert ours.config == dataclasses.replace(preset, rms_norm_eps=ours.config.rms_norm_eps)
    ids = _chat_ids(ours.tokenizer, "What is the capital of France?")
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(dense_forward, static_argnums=1)(
            ours.params, ours.config, jnp.asarray([ids])))
    diff = float(np.abs(got - want).max())
    print(f"smollm2-135m GGUF: max abs logit diff {diff:.2e} (max |logit| "
          f"{np.abs(want).max():.1f}, {len(ids)} tokens)")
    assert diff < 2e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_smollm2_greedy_32_tokens_match_transformers(smollm2_pair):
    ours, hf = smollm2_pair
    ids = _chat_ids(ours.tokenizer, "Write a long story about a robot who learns to paint.")
    got = dense_generate(ours.params, ours.config, ids, 32)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                           max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    print("smollm2 greedy:", ours.tokenizer.decode(got))
    assert len(got) == 32
    assert got == want


# ---- errors name the file and the problem ----

def test_missing_path_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load(tmp_path / "nope")


def test_unknown_preset_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="llama-9000"):
        load("llama-9000", load_format="dummy")
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        load("llama-2-7b")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match=r"config\.json.*gpt2"):
        load(tmp_path)


def test_tensor_shape_disagreeing_with_config(tmp_path):
    _save_random_hf_model(PRESETS["tiny-llama"], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    match = (rf"{tmp_path}/model.safetensors: tensor model.layers.0.mlp.gate_proj.weight "
             r"\(w_gate\) has shape \(128, 64\), but the config expects \(96, 64\)")
    with pytest.raises(ValueError, match=match):
        load(tmp_path)


def test_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    _save_random_hf_model(PRESETS["tiny-llama"], tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load(tmp_path)


@pytest.mark.parametrize("keep", [4, 1000, -100])
def test_truncated_safetensors(tmp_path, keep):
    _save_random_hf_model(PRESETS["tiny-llama"], tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError, match=rf"{path}: truncated safetensors"):
        load(tmp_path)


@pytest.mark.parametrize("keep", [1000, 50_000_000])
def test_truncated_gguf(tmp_path, smollm2_gguf, keep):
    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(ValueError, match=rf"{path}: truncated"):
        load(path)


def test_gguf_directory_without_a_single_gguf(tmp_path):
    (tmp_path / "a.gguf").touch()
    (tmp_path / "b.gguf").touch()
    with pytest.raises(ValueError, match="exactly one .gguf"):
        load(tmp_path, load_format="gguf")
