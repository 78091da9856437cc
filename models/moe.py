"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): the router, top-k, and the experts' matmuls
grouped by expert.

Shape letters as in models.llama, plus X experts, k experts per token (`top_k`), F each
expert's hidden size and A = T * k assignments (token, expert).

Routing is HF's arithmetic: router logits in the model dtype, softmax over all X in
float32, the top-k, renormalised to sum 1 when `cfg.norm_topk_prob` (Mixtral always; for
Qwen3-MoE its config says). Qwen3-MoE casts the weights back to the model dtype before
they scale the experts' outputs; Mixtral keeps them in float32.
Equal probabilities go to the lower expert index (`jax.lax.top_k`'s documented order).
HF's torch.topk leaves the order of ties unspecified, and on the CPU it does not take the
lowest index (of [1, 2, 1, 1, 0, 1, 2, 1] its top 3 are experts 1, 6, 7), so which of
several tied experts HF picks is not reproducible; the lowest index is.

The experts run grouped: the A assignments are sorted by expert (a stable sort, so
tokens keep their order within an expert), each expert's rows form one contiguous group,
and a grouped matmul multiplies each group by its own expert's weight: `experts` takes
it as `matmul` (the step injects the Pallas grouped GEMM for its Pallas backends:
jprefix.worker.step_linear `step_experts`, the one place that chooses), by default
`grouped_matmul` here, `jax.lax.ragged_dot`; nothing computes an expert for a token not
routed to it. How ragged_dot executes is the backend's: jax 0.10 on the CPU, and XLA:GPU
unless its cuDNN ragged-dot fusion is on (`--xla_gpu_experimental_use_ragged_dot_fusion`,
cuDNN >= 9.22), expand it into a masked product over every group; jax's Pallas-Triton
grouped GEMM takes it where that jax ships it
(`jax_ragged_dot_use_gpu_pallas_triton_lowering`). The outputs are unsorted by the
inverse permutation and summed over k in float32 with the routing weights.

Expert weights are `LayerParams.w_gate` / `w_up` [X, E, F] and `w_down` [X, F, E] (one
layer; stacked ones carry a leading L), or fused `w_gate` [X, E, 2F] = [gate | up] per
expert (layout "fused"). fp8 weights (`quantization="fp8"`) are `Fp8Weight`s with one
scale per expert and output channel: `grouped_matmul` converts the fp8 values to the
activations' dtype inside the grouped product (exact for e4m3) and applies the scales to
the result rows of each group (W8A16: the activations are not quantised).

Under tensor parallelism each expert's F is split over the "tp" axis: `experts` then runs
per device on its columns of gate/up and rows of down (jprefix.worker.parallel
`shard_experts`) and the per-device partial sums are added across devices by XLA.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.fp8_linear import Fp8Weight

# experts(x [T, E], weights [T, k], ids [T, k], w_gate, w_up | None, w_down) -> [T, E]
ExpertsFn = Callable[..., jax.Array]
# matmul(x [A, K] rows grouped, w [X, K, N] | Fp8Weight, group_sizes [X] int32) -> [A, N]
GroupedMatmulFn = Callable[..., jax.Array]

_GROUPED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),  # x [A, K] . w8 [X, N, K] over K
    lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """x [T, E], router [E, X] -> (weights [T, k], expert ids [T, k] int32), HF's routing
    (module docstring): weights float32 (Mixtral) or x.dtype (Qwen3-MoE)."""
    logits = x @ router  # [T, X] in the model dtype, as HF's gate Linear
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if cfg.arch == "qwen3_moe":
        weights = weights.astype(x.dtype)
    return weights, ids.astype(jnp.int32)


def grouped_matmul(x: jax.Array, w: jax.Array | Fp8Weight, group_sizes: jax.Array
                   ) -> jax.Array:
    """x [A, K] with rows grouped by expert (group g: `group_sizes[g]` consecutive rows)
    times each group's own expert weight: w [X, K, N] -> [A, N] in x.dtype. An
    `Fp8Weight` (w8 [X, N, K], scale [X, N]) is converted to x.dtype inside the product
    and its scales applied per group to the result."""
    if not isinstance(w, Fp8Weight):
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype)
    # (the product in x.dtype, as fp8_matmul's dot: a 16-bit ragged dot is what XLA:GPU's
    # cuDNN fusion takes; the float32 sum is rounded once before the scales)
    y = jax.lax.ragged_dot_general(x, w.w8.astype(x.dtype), group_sizes, _GROUPED_DIMS,
                                   preferred_element_type=x.dtype)
    row_expert = jnp.repeat(jnp.arange(group_sizes.shape[0], dtype=jnp.int32),
                            group_sizes, total_repeat_length=x.shape[0])
    return (y.astype(jnp.float32) * w.scale[row_expert]).astype(x.dtype)


def experts(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array | Fp8Weight,
            w_up: jax.Array | Fp8Weight | None, w_down: jax.Array | Fp8Weight,
            matmul: GroupedMatmulFn = grouped_matmul) -> jax.Array:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, E] in x.dtype, the experts
    run grouped by `matmul` (`grouped_matmul`'s contract; module docstring). `w_up`
    None: `w_gate` holds [gate | up] per expert. Under tensor parallelism, one device's
    part: its slices of F, a partial sum."""
    t, k = ids.shape
    num_experts = w_down.shape[0] if not isinstance(w_down, Fp8Weight) else w_down.w8.shape[0]
    flat = ids.reshape(-1)  # [A], assignment a = token a // k, its (a % k)-th expert
    order = jnp.argsort(flat, stable=True)  # assignments sorted by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[order // k]  # [A, E]
    if w_up is None:
        gate, up = jnp.split(matmul(rows, w_gate, group_sizes), 2, axis=-1)
    else:
        gate, up = (matmul(rows, w, group_sizes) for w in (w_gate, w_up))
    out = matmul(jax.nn.silu(gate) * up, w_down, group_sizes)  # [A, E] sorted
    out = out[jnp.argsort(order)].reshape(t, k, -1)  # back to assignment order
    total = jnp.einsum("tke,tk->te", out.astype(jnp.float32), weights.astype(jnp.float32))
    return total.astype(x.dtype)


def moe_mlp(h: jax.Array, router: jax.Array, w_gate: jax.Array | Fp8Weight,
            w_up: jax.Array | Fp8Weight | None, w_down: jax.Array | Fp8Weight,
            cfg: ModelConfig, experts_fn: ExpertsFn | None = None) -> jax.Array:
    """The MoE MLP of one layer on h [..., E] -> [..., E]: routing, then `experts_fn`
    (default `experts`; per device under tensor parallelism)."""
    x = h.reshape(-1, h.shape[-1])
    weights, ids = route(x, router, cfg)
    out = (experts_fn or experts)(x, weights, ids, w_gate, w_up, w_down)
    return out.reshape(h.shape)

