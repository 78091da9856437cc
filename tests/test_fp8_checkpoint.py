"""fp8 checkpoints (`models.config.fp8_checkpoint`, `models.safetensors_loader`): the
compressed-tensors float-quantized format (weights per output channel or per tensor)
and the "fp8" method (per-tensor, or per-block `weight_scale_inv`) load dequantised; the
engine serves them in fp8, per-channel ones with the checkpoint's own fp8 values."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.torch
import torch
from test_loader import _save_random_hf_model

from jprefix import LLM, SamplingParams
from models.config import PRESETS, ModelConfig
from models.fp8_linear import Fp8Weight
from models.layout import quantize_linears
from models.loader import load
from models.reference import dense_generate

CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized",
           "ignore": ["lm_head"], "kv_cache_scheme": None,
           "config_groups": {"group_0": {
               "targets": ["Linear"],
               "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                           "symmetric": True, "dynamic": False},
               "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                     "symmetric": True, "dynamic": True}}}}
BLOCK = 8  # the block scales' tile, [8, 8] (DeepSeek's is [128, 128])


def _write(directory, scheme: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A random tiny-llama saved with its projections in fp8: `scheme` "channel" and
    "tensor" (compressed-tensors, `weight_scale`), "block" (the fp8 method with
    `weight_block_size`, `weight_scale_inv`). Returns {tensor name: (fp8 weight, scale)}."""
    _save_random_hf_model(PRESETS["tiny-llama"], directory)
    state = safetensors.torch.load_file(directory / "model.safetensors")
    fp8 = {}
    for name in [n for n in state if n.endswith("_proj.weight")]:
        w = state[name]
        if scheme == "channel":
            scale = w.abs().amax(1, keepdim=True) / 448
            full = scale
        elif scheme == "tensor":
            scale = (w.abs().amax() / 448).reshape(1)
            full = scale
        else:
            o, i = w.shape
            tiles = w.reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK).abs().amax((1, 3))
            scale = tiles / 448
            full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        w8 = (w / full).to(torch.float8_e4m3fn)
        state[name] = w8
        state[name + ("_scale_inv" if scheme == "block" else "_scale")] = scale.float()
        fp8[name] = (w8, scale.float())
    safetensors.torch.save_file(state, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    if scheme == "block":
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic",
                 "weight_block_size": [BLOCK, BLOCK]}
    else:
        quant = json.loads(json.dumps(CHANNEL))
        quant["config_groups"]["group_0"]["weights"]["strategy"] = scheme
    config["quantization_config"] = quant
    (directory / "config.json").write_text(json.dumps(config))
    return fp8


@pytest.mark.parametrize("scheme", ["channel", "tensor", "block"])
def test_fp8_checkpoint_loads_dequantised_and_serves_in_fp8(scheme, tmp_path):
    fp8 = _write(tmp_path, scheme)
    loaded = load(tmp_path, dtype="float32")
    cfg = loaded.config
    assert cfg.checkpoint_quantization == "fp8"
    w8, scale = fp8["model.layers.1.self_attn.k_proj.weight"]
    full = scale if scheme != "block" else \
        scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    want = (w8.float() * full).numpy().T  # [in, out]
    np.testing.assert_array_equal(np.asarray(loaded.params.layers.wk[1]), want)

    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=16,
              attention_backend="xla")
    layers = llm.engine.runner.params.layers  # (per layer, fused, on the CPU; else stacked)
    if isinstance(layers, tuple):  # K's columns of layer 1's fused [wq | wk | wv]
        hd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        wk = layers[1].wq
        assert isinstance(wk, Fp8Weight)  # served in fp8 without quantization="fp8"
        w8_1, scale_1 = wk.w8[hd : hd + kd], wk.scale[hd : hd + kd]  # (w8 [out, in])
    else:
        wk = layers.wk
        assert isinstance(wk, Fp8Weight)
        w8_1, scale_1 = wk.w8[1], wk.scale[1]
    if scheme == "channel":  # per-channel: the checkpoint's own fp8 values and scales
        np.testing.assert_array_equal(np.asarray(w8_1).astype(np.float32), w8.float().numpy())
        np.testing.assert_allclose(np.asarray(scale_1), scale[:, 0].numpy(), rtol=1e-6)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (20, 37)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    qparams = quantize_linears(loaded.params, keep_last_mlp=False)  # (all of it fp8)
    assert got == [dense_generate(qparams, cfg, p, 6, eos_token_ids=()) for p in prompts]


def test_fp8_checkpoint_with_tensor_parallelism_is_refused_before_loading(tmp_path):
    _write(tmp_path, "channel")
    with pytest.raises(ValueError, match="fp8 checkpoint runs on one device: "
                                         "tensor_parallel_size 2"):
        LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=16)


def test_fp8_checkpoint_without_its_scales_is_refused(tmp_path):
    _write(tmp_path, "channel")
    state = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del state["model.layers.0.mlp.up_proj.weight_scale"]
    safetensors.torch.save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"mlp\.up_proj\.weight is fp8 .* without its "
                                         r"model\.layers\.0\.mlp\.up_proj\.weight_scale"):
        load(tmp_path, dtype="float32")


HF = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32,
          hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
          max_position_embeddings=64)


def _group(**weights):
    quant = json.loads(json.dumps(CHANNEL))
    quant["config_groups"]["group_0"]["weights"].update(weights)
    return quant


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"quant_method": "awq"}, "quant_method='awq'"),
    (dict(CHANNEL, format="pack-quantized"), "format 'pack-quantized'"),
    (dict(CHANNEL, config_groups={}), "no config_groups"),
    (_group(type="int"), "'int' 8-bit by 'channel'"),
    (_group(num_bits=4), "'float' 4-bit"),
    (_group(strategy="group"), "by 'group'"),
])
def test_other_quantised_checkpoints_are_refused_clearly(quant, match):
    with pytest.raises(ValueError, match=match) as err:
        ModelConfig.from_hf_config(dict(HF, quantization_config=quant))
    assert "quantization='fp8'" in str(err.value)  # what to do instead


def test_fp8_configs_parse():
    assert ModelConfig.from_hf_config(HF).checkpoint_quantization is None
    for quant in (CHANNEL, {"quant_method": "fp8", "activation_scheme": "static"}):
        cfg = ModelConfig.from_hf_config(dict(HF, quantization_config=quant))
        assert cfg.checkpoint_quantization == "fp8"
