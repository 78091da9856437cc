"""Per-layer weight buffers run under one `lax.scan` (the CPU's layer loop).

A scan over stacked weights slices each layer's matrices out of the stack, and XLA:CPU
materialises every such slice before its matmul library reads it: a copy of all the
weights on every step, which on a decode step (matrix-vector products, bound by memory
traffic) costs about as much as the matmuls themselves. Unrolling the layers reads each
buffer in place but compiles every layer's attention and norms L times (seconds per
step shape on the CPU).

So the step keeps one compiled layer body and per-layer buffers: `scan_params` hands
`models.llama.forward` a "stacked" Params whose matmul weights are `LayerWeight`
stand-ins (the layer index and the field's name, which the scan slices like any stacked
leaf), and `switched_linear` resolves a stand-in inside the body with `lax.switch` over
the L buffers of that field: each branch is one matmul reading its layer's own buffer,
so nothing is copied. The small per-layer arrays (norms, biases) are stacked per step.

On the CPU the buffers are fused by default (layout "fused": Q/K/V one matrix, gate/up
one): a decode step's matmuls are bound by the weights' memory traffic, XLA:CPU spreads
one dot over both cores when the second one is free, and four larger dots per layer
keep them busier than seven (docs/PERF.md, the CPU). The scan hands `forward` "stacked"
params whose `wk` is None, which it runs fused (`models.llama.is_fused`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.llama import LayerParams, LinearFn, Params

# the LayerParams fields that only ever reach a matmul (`forward`'s linear / col_linear)
MATMUL_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeight:
    """Stands for field `field` of the layer `layer` (int32 [L] before the scan slices
    it, a scalar inside the scanned body)."""

    layer: jax.Array
    field: str = dataclasses.field(metadata={"static": True})


def layer_loop(params: Params, linear: LinearFn, backend: str, mesh: Mesh | None
               ) -> tuple[Params, LinearFn]:
    """The params and linear the step hands `forward`: per-layer buffers on the XLA
    backend on one device (unfused, or fused on the CPU; `worker.params.prepare_params`
    makes them so there) as `scan_params` and `switched_linear`; anything else as it is
    (a mixture of experts too: its expert stacks reach the grouped matmul, not `linear`,
    so they run unrolled)."""
    if (_scanned(params.layout) and backend == "xla" and mesh is None
            and params.layers[0].router is None):
        return scan_params(params), switched_linear(linear, params.layers)
    return params, linear


def _scanned(layout: str) -> bool:
    """Per-layer unfused buffers (only the CPU makes them) and, on the CPU, fused ones
    (the GPU's fused buffers run unrolled: no while loop's host round trip per layer)."""
    return layout == "per_layer" or (layout == "fused" and jax.default_backend() == "cpu")


def scan_params(params: Params) -> Params:
    """`params` (layout "per_layer" or "fused", L layers) as layout "stacked": norms and
    biases stacked [L, ...], each matmul weight a `LayerWeight` over the L layers (None
    where the layers have none: the parts fused into another field)."""
    layers = params.layers
    index = jnp.arange(len(layers), dtype=jnp.int32)
    fields = {}
    for f in dataclasses.fields(LayerParams):
        values = [getattr(lp, f.name) for lp in layers]
        if f.name in MATMUL_FIELDS and values[0] is not None:
            fields[f.name] = LayerWeight(index, f.name)
        else:
            fields[f.name] = None if values[0] is None else jnp.stack(values)
    return dataclasses.replace(params, layers=LayerParams(**fields), layout="stacked")


def switched_linear(linear: LinearFn, layers: tuple[LayerParams, ...]) -> LinearFn:
    """`linear` on real weights; on a `LayerWeight`, `linear` with that layer's own
    buffer of the field, chosen by `lax.switch` (one branch per layer)."""

    def apply(x, w, act=None):
        if not isinstance(w, LayerWeight):
            return linear(x, w, act)
        branches = [_branch(linear, getattr(lp, w.field), act) for lp in layers]
        return jax.lax.switch(w.layer, branches, x)

    return apply


def _branch(linear: LinearFn, weight, act):
    return lambda x: linear(x, weight, act)
