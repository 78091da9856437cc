"""The engine's parts set up: the model loaded and placed, its runner built (the one place
the mesh is made), the context length the KV cache can serve, and the scheduler over that
cache (one block table, or a table per layer group)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jprefix.core.block_manager import BlockManager
from jprefix.core.config import SchedulerConfig
from jprefix.core.hybrid_cache import HybridPrefixPool
from jprefix.core.hybrid_scheduler import HybridScheduler
from jprefix.core.kv_groups import KVCacheGroups, kv_cache_groups
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.scheduler import Scheduler
from jprefix.core.spec_decode import Speculator
from jprefix.engine.args import EngineArgs, resolve_dtype
from jprefix.engine.drafter import load_draft
from jprefix.worker import multihost, xla_flags
from jprefix.worker.draft_runner import DraftRunner, target_memory_fraction
from jprefix.worker.kv_cache import kv_block_bytes, kv_dtype
from jprefix.worker.model_runner import ModelRunner
from jprefix.worker.pack import BucketConfig
from jprefix.worker.parallel import make_mesh, placed_on
from models.config import ModelConfig
from models.loader import LoadedModel, load, model_config


def build_runner(model: LoadedModel | str, args: EngineArgs, devices: list[Any] | None = None
                 ) -> tuple[LoadedModel, ModelRunner, DraftRunner | None]:
    """The model (loaded here when given by name), its runner, and for a "draft_model"
    speculative config the draft's runner (its cache of as many blocks as the target's,
    the memory shared: `draft_runner.target_memory_fraction`): the one place the mesh
    is made. A model loaded here is handed to the runner, which replaces its weights by
    the step's layout (one copy on the device); a LoadedModel passed in is left as is and
    the runner keeps the step's layout beside it (unless it is in that layout already).
    `devices`: the device group of a data-parallel replica (`tensor_parallel_size` of
    them; its weights, cache and steps stay on them); None: the first devices, placed as
    jax places by default.

    A multi-process run (`args.coordinator_address` / `num_processes` / `process_id`, or
    JAX's environment: `jprefix.worker.multihost`) joins the processes first; on a
    process other than 0 this serves process 0's steps until it stops, then exits the
    process (SystemExit(0)): the same program runs on every host."""
    xla_flags.apply()
    multi = multihost.initialize(args.coordinator_address, args.num_processes,
                                 args.process_id, args.distributed_timeout_s)
    owned = not isinstance(model, LoadedModel)
    if not owned and args.tokenizer is not None:
        raise ValueError(f"tokenizer {args.tokenizer!r} applies to a model the engine "
                         "loads by name; load this one with jprefix.load(..., tokenizer=)")
    cfg = model_config(model, args.load_format) if owned else model.config
    if cfg.checkpoint_quantization and args.tensor_parallel_size > 1:  # (before loading)
        raise ValueError(f"an {cfg.checkpoint_quantization} checkpoint runs on one device: "
                         f"tensor_parallel_size {args.tensor_parallel_size} needs its float "
                         "checkpoint")
    mesh = make_mesh(cfg, args.tensor_parallel_size, devices)
    if multi:
        if args.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 with several processes is not "
                             "supported: run one multi-host engine (tensor parallel) or "
                             "replicas within one process")
        multihost.check_mesh(mesh)
    device = devices[0] if devices is not None and mesh is None else None
    if owned:
        with placed_on(device):
            model = load(model, resolve_dtype(args.dtype, model), args.load_format, mesh=mesh,
                         tokenizer=args.tokenizer)
    buckets = BucketConfig(min_seqs=8, single_stream=jax.default_backend() == "cpu")
    draft = load_draft(args, model, buckets, device)  # (None unless a draft model speculates)
    fraction = args.gpu_memory_utilization if draft is None else target_memory_fraction(
        args.gpu_memory_utilization, kv_block_bytes(cfg, args.block_size, kv_dtype(
            args.kv_cache_dtype, model.params.embed.dtype)), draft.block_bytes)
    runner = ModelRunner(
        model.params, cfg, args.num_kv_blocks, args.block_size, model.params.embed.dtype,
        backend=args.attention_backend,
        buckets=buckets, unroll_layers=args.unroll_layers, memory_fraction=fraction,
        cpu_num_blocks=args.cpu_num_kv_blocks, mesh=mesh, max_num_seqs=args.max_num_seqs,
        fixed_inputs=args.fixed_inputs, donate_params=owned, device=device,
        multi_process=multi,
        kv_cache_dtype=args.kv_cache_dtype,
        # an fp8 checkpoint, loaded dequantised, is served in fp8 (models.config)
        quantization=args.quantization or cfg.checkpoint_quantization,
        num_speculative_tokens=(0 if args.speculative_config is None
                                else args.speculative_config.num_speculative_tokens),
        kv_groups=hybrid_kv_groups(cfg, args),
    )
    if draft is not None:
        draft.allocate_cache(runner.num_blocks)
    if multi:  # processes other than 0 follow process 0's steps here, then exit
        multihost.start(runner)
    if owned:
        model = dataclasses.replace(model, params=runner.params)
    return model, runner, draft


def hybrid_kv_groups(cfg: ModelConfig, args: EngineArgs) -> KVCacheGroups | None:
    """The KV cache groups of a model mixing window and full layers (`core.kv_groups`),
    unless `disable_hybrid_kv_cache_manager`; None: one block table for every layer.
    The host tier and saved prefix caches store one block per trie node, every layer in
    it: with a page per group they would need a node's pages of all groups moved as one,
    which is not built, so they are refused for a hybrid cache."""
    groups = None if args.disable_hybrid_kv_cache_manager else kv_cache_groups(
        cfg.layer_windows)
    if groups is not None and args.speculative_config is not None:
        raise ValueError("speculative_config: speculative decoding does not run on a hybrid KV "
                         "cache (a model mixing window and full layers); set "
                         "disable_hybrid_kv_cache_manager=True")
    if groups is not None and (args.kv_offloading_size or args.prefix_cache_path):
        raise ValueError(
            f"kv_offloading_size={args.kv_offloading_size} / prefix_cache_path="
            f"{args.prefix_cache_path!r}: the host tier does not hold a hybrid KV cache (a "
            "model mixing window and full layers); set disable_hybrid_kv_cache_manager=True")
    return groups


def make_scheduler(args: EngineArgs, cfg: ModelConfig, num_blocks: int, max_model_len: int,
                   kv_groups: KVCacheGroups | None, kv_tier: Any,
                   speculator: Speculator | None) -> Scheduler:
    """The scheduler over a cache of `num_blocks`: a `HybridScheduler` for `kv_groups`
    (pages of a table per layer group, `core.kv_groups`), else one block table per
    sequence, the host tier's pool (`kv_tier`, None: no tier) under its prefix cache."""
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, policy=args.policy,
        eos_token_ids=frozenset(cfg.eos_token_ids), max_model_len=max_model_len)
    blocks = BlockManager(num_blocks, args.block_size)
    if kv_groups is not None:
        return HybridScheduler(sched, blocks, HybridPrefixPool(blocks, kv_groups))
    return Scheduler(sched, blocks, PrefixPool(blocks, None if kv_tier is None else kv_tier.pool),
                     sliding_window=cfg.uniform_sliding_window, speculator=speculator)


def fit_max_model_len(args: EngineArgs, model_max: int, num_blocks: int,
                      num_groups: int = 1) -> int:
    """The context length requests are validated against: one sequence of that many
    tokens always fits in the KV cache alone (block 0 is the null block), so a request the
    engine accepts can always finish, preempting others as needed.

    An explicit `max_model_len` must fit the model and the cache (else ValueError). Without
    one: the model's length, capped to the cache when the user sized the cache
    (`num_kv_blocks`); a cache sized from memory that cannot hold the model's length is
    refused, naming what to change. A hybrid cache (`num_groups` > 1) holds a block of
    tokens in one page per group."""
    capacity = (num_blocks - 1) // num_groups * args.block_size
    cache = (f"the KV cache ({num_blocks - 1} blocks of {args.block_size} tokens = "
             f"{capacity} tokens)")
    if args.max_model_len is not None:
        if not 1 <= args.max_model_len <= model_max:
            raise ValueError(f"max_model_len {args.max_model_len} is outside [1, {model_max}], "
                             "the model's context length")
        if args.max_model_len > capacity:
            raise ValueError(f"max_model_len {args.max_model_len} does not fit in {cache}: "
                             "lower max_model_len or raise num_kv_blocks / gpu_memory_utilization")
        return args.max_model_len
    if capacity >= model_max:
        return model_max
    if args.num_kv_blocks is not None:
        return capacity
    raise ValueError(f"the model's context of {model_max} tokens does not fit in {cache}: set "
                     f"max_model_len <= {capacity}, or raise gpu_memory_utilization "
                     "(or num_kv_blocks)")


def load_model(model: str, dtype: str = "auto", load_format: str = "auto",
               **kwargs: Any) -> LoadedModel:
    """`models.loader.load` after setting the XLA flags the engine runs with
    (`jprefix.worker.xla_flags`: they must be set before jax initialises its backend,
    which loading does); `dtype="auto"` resolved as the engine resolves it."""
    xla_flags.apply()
    return load(model, resolve_dtype(dtype, model), load_format, **kwargs)
