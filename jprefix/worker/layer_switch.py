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

Column pieces (`split_columns`, on a CPU of two or more cores): XLA:CPU runs one dot on
one thread, and a one-row decode step is bound by the weights' memory traffic, which one
core cannot saturate. Its thunk executor runs a computation's independent operations on
a second thread only when more than eight are ready at once (`ExecuteSession`'s split
threshold) and runs a sequence of up to eight sequentially. So each matmul weight is
stored as `COLUMN_PIECES` (12) column blocks, each its own buffer, and the branch computes
one dot per block and concatenates them: the 12 dots are ready together and the executor
hands half of them to a second thread. Fewer than 10 would never reach the threshold.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from models.llama import LayerParams, LinearFn, Params

# the LayerParams fields that only ever reach a matmul (`forward`'s linear / col_linear)
MATMUL_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# dots of one matmul: more than XLA:CPU's threshold of 8 ready thunks + 1 (module docstring)
COLUMN_PIECES = 12


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ColumnPieces:
    """A matmul weight w [in, out] kept as column blocks `pieces` (w[:, a:b] each, in
    order, each its own buffer): `x @ w` is the concatenation of `x @ piece`."""

    pieces: tuple[jax.Array, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.pieces[0].shape[0], sum(p.shape[1] for p in self.pieces))

    @property
    def dtype(self):
        return self.pieces[0].dtype


def split_columns(params: Params, num_cores: int | None = None) -> Params:
    """Layout "per_layer" params with every plain matmul weight as `ColumnPieces` of
    `COLUMN_PIECES` blocks (NumPy copies in host memory: the CPU device) when the machine
    has two or more cores (`num_cores`, default `os.cpu_count()`); else, or for any other
    layout or a weight that is not a plain array (fp8), as they are. Idempotent."""
    if (num_cores or os.cpu_count() or 1) < 2 or params.layout != "per_layer":
        return params

    def split(w):
        if not isinstance(w, jax.Array) or w.ndim != 2:
            return w
        host = np.asarray(w)
        blocks = np.array_split(host, min(COLUMN_PIECES, host.shape[1]), axis=1)
        return ColumnPieces(tuple(jax.device_put(np.ascontiguousarray(b), w.sharding)
                                  for b in blocks))

    layers = tuple(dataclasses.replace(lp, **{f: split(getattr(lp, f)) for f in MATMUL_FIELDS})
                   for lp in params.layers)
    return dataclasses.replace(params, layers=layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeight:
    """Stands for field `field` of the layer `layer` (int32 [L] before the scan slices
    it, a scalar inside the scanned body)."""

    layer: jax.Array
    field: str = dataclasses.field(metadata={"static": True})


def layer_loop(params: Params, linear: LinearFn, backend: str, mesh: Mesh | None
               ) -> tuple[Params, LinearFn]:
    """The params and linear the step hands `forward`: per-layer (unfused) buffers on the
    XLA backend on one device (`worker.params.prepare_params` makes them so on the CPU)
    as `scan_params` and `switched_linear`; anything else as it is (a mixture of experts
    too: its expert stacks reach the grouped matmul, not `linear`, so they run unrolled).
    The linear of per-layer params takes `ColumnPieces` (`piecewise`)."""
    if params.layout == "per_layer":  # (`split_columns` makes pieces of this layout only)
        linear = piecewise(linear)
    if (params.layout == "per_layer" and backend == "xla" and mesh is None
            and params.layers[0].router is None):
        return scan_params(params), switched_linear(linear, params.layers)
    return params, linear


def piecewise(linear: LinearFn) -> LinearFn:
    """`linear`, and on `ColumnPieces` the concatenation of `linear` on each piece (one
    independent dot per piece: the module docstring's why)."""

    def apply(x, w, act=None):
        if not isinstance(w, ColumnPieces):
            return linear(x, w, act)
        if act is not None:  # ("silu_mul" pairs columns across a fused weight's halves)
            raise ValueError(f"column pieces take no fused activation, got act={act!r}")
        return jnp.concatenate([linear(x, p) for p in w.pieces], axis=-1)

    return apply


def scan_params(params: Params) -> Params:
    """`params` (layout "per_layer", L layers) as layout "stacked": norms and biases
    stacked [L, ...], each matmul weight a `LayerWeight` over the L layers."""
    layers = params.layers
    index = jnp.arange(len(layers), dtype=jnp.int32)
    fields = {}
    for f in dataclasses.fields(LayerParams):
        values = [getattr(lp, f.name) for lp in layers]
        if f.name in MATMUL_FIELDS:
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
