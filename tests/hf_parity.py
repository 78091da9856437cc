"""Shared scaffold for the model tests against transformers (torch float32): random
non-trivial weights saved with save_pretrained, logits and greedy tokens on both sides
(ours under `jax.default_matmul_precision("highest")`: XLA on a GPU takes TF32
otherwise), and the shared-prefix prompts and dense greedy tokens the engine tests
compare against.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jprefix import SamplingParams
from models.reference import dense_forward, dense_generate


def randomize_and_save(hf_model, directory, *, std: float, norm_mean: float = 1.0,
                       **save_kw):
    """Overwrites the torch model's weights from torch's global RNG (norm weights
    norm_mean + 0.1 N(0, 1), every other weight std N(0, 1): non-trivial, so that a
    misplaced weight shows) and saves it with save_pretrained; returns the model."""
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.copy_(norm_mean + 0.1 * torch.randn_like(p) if "norm" in name
                    else std * torch.randn_like(p))
    hf_model.save_pretrained(directory, **save_kw)
    return hf_model


def hf_logits(hf_model, ids) -> np.ndarray:
    """transformers' logits [S, T, V] of the token ids [S, T]."""
    with torch.no_grad():
        return hf_model(torch.tensor(ids)).logits.numpy()


def dense_logits(model, ids) -> np.ndarray:
    """Our dense reference's logits [S, T, V] of the token ids [S, T]."""
    with jax.default_matmul_precision("highest"):
        return np.asarray(dense_forward(model.params, model.config, jnp.asarray(ids)))


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after the prompt (no end-of-sequence token; every
    prompt token attended, token 0 included: no mask inferred from a pad id)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def dense_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Our dense reference's n greedy tokens after the prompt (no end-of-sequence)."""
    with jax.default_matmul_precision("highest"):
        return dense_generate(model.params, model.config, prompt, n, eos_token_ids=())


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def shared_prefix_prompts(seed: int, shared: int, unique: list[int]) -> list[list[int]]:
    """One random prefix of `shared` tokens, then `unique[i]` random tokens for prompt i
    (ids 3..127: a 128-token vocabulary past its special tokens)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 128, shared).tolist()
    return [prefix + rng.integers(3, 128, n).tolist() for n in unique]


def dense_tokens(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The dense reference's n greedy tokens for each prompt (default precision: what
    the engine tests compare the engine's tokens with)."""
    return [dense_generate(model.params, model.config, p, n, eos_token_ids=())
            for p in prompts]
