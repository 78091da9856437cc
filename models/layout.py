"""Weight layouts of `Params` and the transforms between them.

Loaders produce "stacked" params (every layer field stacked on a leading L axis).
`unstack_layers` turns them into "per_layer" (a tuple of LayerParams) or, with `fuse`,
straight into "fused"; `fuse_projections` turns "per_layer" into "fused". Each transform
sets `Params.layout`, which `models.llama.forward` reads. Tensor parallelism places
stacked params with `param_partition_specs` / `param_shardings`; fusing
concatenates per shard under tensor parallelism (`Params.shards`), since splitting a plain
concatenation [wq | wk | wv] by columns would mix heads.
`quantize_linears` turns the linear layers' weights into fp8 (`quantization="fp8"`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.fp8_linear import Fp8Weight, quantize_weight
from models.llama import LayerParams, Params, check_layout

# fused field -> the fields concatenated into it along the output axis, in order
# the fused fields and their parts, in column order (LayerParams' fused form)
FUSED_FIELDS = {"wq": ("wq", "wk", "wv"), "bq": ("bq", "bk", "bv"), "w_gate": ("w_gate", "w_up")}


def param_partition_specs(cfg: ModelConfig, axis: str = "tp", kv_split: bool = True) -> Params:
    """PartitionSpecs of stacked params for tensor parallelism over mesh axis `axis`
    (Megatron-style).

    Q/K/V and gate/up are split by output (heads / F), wo and w_down by input; norms are
    replicated; embed and lm_head are split on the hidden / vocab axis. A mixture of
    experts splits each expert's F the same way (gate/up [L, X, E, F] by F, down
    [L, X, F, E] by F) and replicates the router and the q/k norms. `kv_split` False
    (fewer kv heads than shards) replicates K/V's weights whole on every device, for
    `jprefix.worker.parallel.replicate_kv_heads` to expand.
    """
    col, row, rep = P(None, None, axis), P(None, axis, None), P()
    bias = P(None, axis) if cfg.attention_bias else None
    kv, kv_bias = (col, bias) if kv_split else (rep, None if bias is None else rep)
    mlp_col, mlp_row = (P(None, None, None, axis), P(None, None, axis, None)) if cfg.moe \
        else (col, row)
    qk = rep if cfg.qk_norm else None
    layers = LayerParams(
        attn_norm=rep, wq=col, wk=kv, wv=kv, bq=bias, bk=kv_bias, bv=kv_bias, wo=row,
        mlp_norm=rep, w_gate=mlp_col, w_up=mlp_col, w_down=mlp_row, q_norm=qk, k_norm=qk,
        router=rep if cfg.moe else None,
        **dict.fromkeys(("post_attn_norm", "post_mlp_norm"), rep if cfg.arch == "gemma3" else None))
    lm_head = None if cfg.tie_word_embeddings else P(None, axis)
    return Params(embed=P(None, axis), layers=layers, final_norm=rep, lm_head=lm_head)


def param_shardings(cfg: ModelConfig, mesh: Mesh, axis: str = "tp") -> Params:
    """`param_partition_specs` as NamedShardings on `mesh` (for device_put or out_shardings);
    K/V weights whole on each device where the mesh has more shards than kv heads."""
    specs = param_partition_specs(cfg, axis, cfg.num_kv_heads % mesh.shape[axis] == 0)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def unstack_layers(params: Params, fuse: bool = False, shards: int = 1) -> Params:
    """Stacked params -> layout "per_layer" (a tuple of LayerParams), or "fused" with `fuse`
    (see LayerParams). ValueError on any other input layout. `shards` (tensor parallelism
    over that many devices, with `fuse`): the fused columns are laid out per shard
    (`Params.shards`: block s = [wq_s | wk_s | wv_s], [w_gate_s | w_up_s]), so splitting
    them over the devices gives each its own heads' fusion.

    The split copies the layer weights once, field by field (fused fields straight from
    the stacks, so the weights never exist three times); a field sharded over a mesh
    stays sharded the same way (its spec without the layer axis), so a tensor-parallel
    model is never gathered onto one device. The stacked arrays are freed when the caller
    drops them.
    """
    check_layout(params)
    if params.layout != "stacked":
        raise ValueError(f"unstack_layers needs layout 'stacked', got {params.layout!r}")
    stacked = params.layers
    num_layers = stacked.attn_norm.shape[0]
    groups = FUSED_FIELDS if fuse else {}
    fused_away = {name for names in groups.values() for name in names[1:]}
    fields = {}
    for f in dataclasses.fields(LayerParams):
        value = getattr(stacked, f.name)
        if value is None or f.name in fused_away:
            fields[f.name] = [None] * num_layers
        elif f.name in groups:
            fields[f.name] = _split_concat([getattr(stacked, n) for n in groups[f.name]],
                                           shards)
        else:
            fields[f.name] = _split_layers(value)
    layers = tuple(LayerParams(**{k: v[i] for k, v in fields.items()})
                   for i in range(num_layers))
    return dataclasses.replace(params, layers=layers, layout="fused" if fuse else "per_layer",
                               shards=shards if fuse else 1)


def fuse_projections(params: Params) -> Params:
    """Layout "per_layer" -> "fused": Q/K/V and gate/up each concatenated into one matrix
    (see LayerParams). Idempotent ("fused" params come back as they are); ValueError on
    "stacked". The unfused arrays stay alive while the caller holds them (from stacked
    params, `unstack_layers(params, fuse=True)` skips that copy)."""
    check_layout(params)
    if params.layout == "fused":
        return params
    if params.layout != "per_layer":
        raise ValueError(f"fuse_projections needs layout 'per_layer' (unstack_layers first), "
                         f"got {params.layout!r}")
    cat = jax.jit(lambda *xs: jnp.concatenate(xs, axis=-1))
    layers = []
    for lp in params.layers:
        fused = {name: None if getattr(lp, name) is None
                 else cat(*(getattr(lp, n) for n in names)) for name, names in FUSED_FIELDS.items()}
        away = {n: None for names in FUSED_FIELDS.values() for n in names[1:]}
        layers.append(dataclasses.replace(lp, **away, **fused))
    return dataclasses.replace(params, layers=tuple(layers), layout="fused")


def _split_concat(stacks: list[jax.Array], shards: int = 1) -> list[jax.Array]:
    """Per-layer concatenations of same-depth stacks along the output axis; with `shards`,
    of each stack's s-th block of columns in turn (placed like the first stack, less its
    L axis)."""
    if shards == 1:
        split = jax.jit(lambda *xs: tuple(jnp.concatenate([x[i] for x in xs], axis=-1)
                                          for i in range(xs[0].shape[0])))
        return list(split(*stacks))

    def cat(xs, i):  # [.., N_j] each -> [.., shards, N_j / shards] joined -> [.., sum N_j]
        blocks = [x[i].reshape(*x.shape[1:-1], shards, -1) for x in xs]
        joined = jnp.concatenate(blocks, axis=-1)
        return joined.reshape(*joined.shape[:-2], -1)

    x0 = stacks[0]
    out = _unstacked_sharding(x0)
    split = jax.jit(lambda *xs: tuple(cat(xs, i) for i in range(xs[0].shape[0])),
                    out_shardings=None if out is None else (out,) * x0.shape[0])
    return list(split(*stacks))


def _unstacked_sharding(x: jax.Array) -> NamedSharding | None:
    """x's NamedSharding less its leading (layer) axis; None if x has none."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(*spec[1:]))


def _split_layers(x: jax.Array) -> list[jax.Array]:
    """The per-layer slices of a stack [L, ...], each keeping x's sharding minus the L axis."""
    out = _unstacked_sharding(x)
    split = jax.jit(lambda a: tuple(a[i] for i in range(a.shape[0])),
                    out_shardings=None if out is None else (out,) * x.shape[0])
    return list(split(x))


_LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


_MLP = ("w_gate", "w_up", "w_down")


def quantize_linears(params: Params, keep_last_mlp: bool = True) -> Params:
    """The params with the linear layers' weights fp8 `Fp8Weight`s (per output channel
    scales, `models.fp8_linear`), in any layout (fused columns quantise as their parts
    would: the scales are per column; a mixture of experts' per expert and column);
    embed, norms, biases, the router and lm_head unchanged.
    Weights already fp8 are kept. Idempotent.

    `keep_last_mlp`: the last layer's MLP (gate, up, down) stays in the model dtype. Its
    output reaches the logits through the final norm alone, so its rounding is the one
    no later layer dilutes; on SmolLM2-135M it is about half of fp8 weights' perplexity
    cost, for ~2% of a 7B model's linear weights (docs/PERF.md, "fp8"). Stacked params
    are then split per layer first (layout "per_layer"): one stack cannot mix dtypes.
    """
    if keep_last_mlp and params.layout == "stacked":
        params = unstack_layers(params)

    def quantize(lp: LayerParams, keep: tuple[str, ...] = ()) -> LayerParams:
        return dataclasses.replace(lp, **{
            name: quantize_weight(w) for name in _LINEARS
            if name not in keep and (w := getattr(lp, name)) is not None
            and not isinstance(w, Fp8Weight)})

    layers = params.layers
    if isinstance(layers, tuple):
        last = len(layers) - 1
        layers = tuple(quantize(lp, _MLP if keep_last_mlp and i == last else ())
                       for i, lp in enumerate(layers))
    else:
        layers = quantize(layers)
    return dataclasses.replace(params, layers=layers)
