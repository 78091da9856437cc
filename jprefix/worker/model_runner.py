"""The model runner (device side of the engine): the weights in the step's layout, the
paged KV cache, and the dispatch of packed steps (`input_batch.StepPacker`) to the jitted
`jprefix.worker.step.step` on one launch thread.
"""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jprefix.core.cascade import CascadePlan
from jprefix.worker import multihost, xla_flags
from jprefix.worker.fixed_inputs import FixedInputs
from jprefix.worker.input_batch import StepPacker
from jprefix.worker.kv_cache import auto_num_blocks, check_fp8_device, empty_kv_cache, kv_dtype
from jprefix.worker.pack import BucketConfig, bucket
from jprefix.worker.parallel import (
    REPLICATED,
    kv_sharding,
    replicate_kv_heads,
    shard_params,
    tp_config,
)
from jprefix.worker.step import BACKENDS, KVCache, default_backend, step
from jprefix.worker.structured import place_bitmask
from models.config import ModelConfig
from models.layout import fuse_projections, quantize_linears, unstack_layers


class StepHandle(NamedTuple):
    """A dispatched step: its launch (resolving to the device output), live rows, the
    device's row order (indices into the scheduled list; None when unchanged), and for an
    extra step (logits processing, logprobs) the (sequence, prompt position) of each
    prompt-logprobs entry (None: a plain step)."""

    tokens: concurrent.futures.Future
    num_rows: int
    order: list[int] | None
    prompt_positions: list[tuple[Any, int]] | None = None


def prepare_params(params: Any, cfg: ModelConfig, mesh: Mesh | None = None,
                   unroll_layers: bool | None = None, donate: bool = False,
                   quantization: str | None = None) -> Any:
    """The weights in the layout the step runs (the one place that decides it): sharded
    over `mesh` (kv heads replicated where fewer than the shards: `parallel.tp_config`,
    the config the step then runs); on GPU (or with `unroll_layers`) split into per-layer
    buffers (no per-layer weight copy in the step), with Q/K/V and gate/up fused into one
    matmul each (layout "fused"; per shard under a mesh, `Params.shards`). Idempotent.
    `donate`: the caller hands the weights over, so the input buffers the result does
    not reuse are freed at once (one copy of the weights on the device, not two, before
    the KV cache is sized). `quantization="fp8"`: the linear layers' weights quantised to
    fp8 (one device)."""
    if unroll_layers is None:  # GPU: unrolled; CPU: lax.scan compiles faster
        unroll_layers = jax.default_backend() == "gpu"
    given = params
    if mesh is not None and params.layout == "stacked":  # (per-layer ones are sharded)
        params = replicate_kv_heads(shard_params(params, cfg, mesh), cfg, mesh)
    elif mesh is not None and tp_config(cfg, mesh.size) is not cfg:
        raise ValueError(f"replicating {cfg.num_kv_heads} kv heads over {mesh.size} shards "
                         f"needs layout 'stacked' params, got {params.layout!r}")
    if unroll_layers:
        if params.layout == "stacked":
            params = unstack_layers(params, fuse=True, shards=1 if mesh is None else mesh.size)
        elif mesh is None:
            params = fuse_projections(params)
    if quantization == "fp8":
        if mesh is not None:
            raise ValueError("quantization='fp8' runs on one device (tensor_parallel_size 1)")
        check_fp8_device("quantization='fp8'")
        params = quantize_linears(params)
    elif quantization is not None:
        raise ValueError(f"quantization {quantization!r} is not one of None, fp8")
    if donate and params is not given:
        kept = {id(x) for x in jax.tree.leaves(params)}
        for x in jax.tree.leaves(given):
            if id(x) not in kept:
                x.delete()
    return params


class ModelRunner:
    """Owns the params, the KV cache, the step packer and the compiled steps."""

    def __init__(
        self,
        params: Any,
        cfg: ModelConfig,
        num_blocks: int | None,
        block_size: int,
        model_dtype: Any,
        backend: str | None = None,
        buckets: BucketConfig | None = None,
        unroll_layers: bool | None = None,
        memory_fraction: float = 0.9,
        cpu_num_blocks: int = 4096,
        mesh: Mesh | None = None,
        max_num_seqs: int = 256,
        fixed_inputs: bool | None = None,
        donate_params: bool = False,
        device: Any = None,
        multi_process: bool = False,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
    ):
        """`num_blocks` None sizes the KV cache from `memory_fraction` of the device memory
        free once the weights are placed; `mesh` (`parallel.make_mesh`) shards weights and
        cache for tensor parallelism; `donate_params`: see `prepare_params`. `fixed_inputs`
        passes each step's packed buffers in device buffers refilled in place
        (`FixedInputs`); None: where XLA records command buffers. `device` (no `mesh`):
        the one device weights, cache and steps live on (a data-parallel replica's;
        None: the default device), the weights copied there if they are elsewhere.
        `multi_process` (a run over several processes, `worker.multihost`; `mesh` spans
        all their devices): process 0 broadcasts each step's inputs to the others before
        running it (`channel`); the others run `multihost.follow(runner)`.
        `kv_cache_dtype` ("auto": `model_dtype`, else an fp8 format) picks the cache's
        format (`worker.kv_cache`); the block count from memory counts its bytes.
        `quantization`: see `prepare_params`."""
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
        if mesh is not None and device is not None:
            raise ValueError("a runner takes a mesh or a device, not both")
        placed = None if device is None else SingleDeviceSharding(device)
        if placed is not None:  # (an array there already is kept as it is, not re-put)
            moved = jax.tree.map(
                lambda x: x if x.devices() == {device} else jax.device_put(x, placed), params)
            if donate_params:  # the copies elsewhere are not needed
                kept = {id(x) for x in jax.tree.leaves(moved)}
                for x in jax.tree.leaves(params):
                    if id(x) not in kept:
                        x.delete()
            params = moved
        self.params = prepare_params(params, cfg, mesh, unroll_layers, donate_params,
                                     quantization)
        cfg = cfg if mesh is None else tp_config(cfg, mesh.size)  # the step's kv heads
        self.cfg, self.backend, self.mesh = cfg, backend, mesh
        self.block_size = block_size
        self.buckets = buckets or BucketConfig()
        self.kv_dtype = kv_dtype(kv_cache_dtype, model_dtype)
        if num_blocks is None:
            num_blocks = auto_num_blocks(cfg, block_size, self.kv_dtype, memory_fraction,
                                         cpu_num_blocks, 1 if mesh is None else mesh.size,
                                         device if mesh is None else
                                         mesh.devices.flat[0] if not multi_process else None)
            if multi_process:  # one global cache: the size every process has room for
                num_blocks = multihost.smallest(num_blocks)
        self.num_blocks = num_blocks
        self._kv_cache: KVCache = empty_kv_cache(  # created in place, sharded if tp
            cfg, num_blocks, block_size, self.kv_dtype,
            placed if mesh is None else kv_sharding(mesh))
        self.packer = StepPacker(block_size, self.buckets)
        # Steps launch in order on one worker thread: XLA's launch of a step's hundreds of
        # kernels takes milliseconds of host time, which then overlaps the engine's Python.
        self._launcher = concurrent.futures.ThreadPoolExecutor(1, "jprefix-launch")
        weakref.finalize(self, self._launcher.shutdown, wait=False)
        self._last_launch: concurrent.futures.Future | None = None
        self._failed: Exception | None = None  # a launch that raised: later ones refuse
        self.shapes_seen: set[tuple[int, ...]] = set()
        self.last_timing = (0.0, 0.0)
        # every step returns max_rows token ids: the next step may read its pending ones
        self.max_rows = bucket(max_num_seqs, self.buckets.min_seqs)
        self._last_tokens = (jnp.zeros(self.max_rows, jnp.int32) if mesh is None else  # all
                             jax.jit(lambda: jnp.zeros(self.max_rows, jnp.int32),  # devices
                                     out_shardings=NamedSharding(mesh, REPLICATED))())
        if placed is not None:
            self._last_tokens = jax.device_put(self._last_tokens, placed)
        self.channel = multihost.StepChannel(mesh) if multi_process else None
        if fixed_inputs is None:
            fixed_inputs = (jax.default_backend() == "gpu" and xla_flags.command_buffers_on()
                            and not multi_process)
        if fixed_inputs and multi_process:
            raise ValueError("fixed_inputs=True: a multi-process run passes each step's "
                             "inputs as fresh global arrays (fixed_inputs None or False)")
        self.fixed_inputs = (FixedInputs(placed if mesh is None
                                         else NamedSharding(mesh, REPLICATED))
                             if fixed_inputs else None)

    @property
    def kv_cache(self) -> KVCache:
        """The KV cache after every step dispatched so far (waits for their launches)."""
        if self._last_launch is not None:
            self._last_launch.result()
        return self._kv_cache

    def dispatch(self, scheduled: Seq, plan: CascadePlan | None = None,
                 token_masks: dict[Any, np.ndarray] | None = None) -> StepHandle:
        """Packs one step and queues its launch without waiting for either the launch or
        the device; `fetch` gets its tokens. `token_masks`: the allowed tokens (packed
        bitmask words) of the sequences whose sampling follows a grammar.

        A row whose newest token is pending reads it from the previous dispatch's
        output (the packer keeps where each sampled token sits).
        """
        t0 = time.perf_counter()
        if len(scheduled) > self.max_rows:
            raise ValueError(f"{len(scheduled)} sequences exceed the runner's {self.max_rows} rows")
        rows, (flat, layout, batch), order, kind, positions = self.packer.pack(scheduled, plan)
        greedy = not batch["temperature"].any()
        bitmask = None if not token_masks else place_bitmask(
            rows, token_masks, len(batch["logits_idx"]), next(iter(token_masks.values())).size)
        self.shapes_seen.add((len(batch["token_ids"]), *batch["block_tables"].shape,
                              kind.decode, kind.cascade, kind.num_decode > 0))

        def launch() -> jax.Array:  # on the worker thread, in dispatch order
            if self._failed is not None:  # its cache and tokens are gone: fail fast
                raise RuntimeError("an earlier engine step failed, so the KV cache and the "
                                   "pending tokens are lost: create a new engine"
                                   ) from self._failed
            try:
                step_args = (flat, layout, bitmask, kind.decode, greedy, kind.cascade,
                             kind.extra)
                if self.channel is not None:
                    self.channel.send(*step_args)
                tokens, logprobs = self.run_step(*step_args)
                # Queue the copy to the host now, so the tokens may be on the host already
                # when the engine asks (async scheduling fetches a step's tokens after
                # dispatching the next one) instead of the copy starting only then.
                for out in (tokens, *jax.tree.leaves(logprobs)):
                    out.copy_to_host_async()
            except Exception as exc:
                self._failed = exc
                if self.channel is not None:  # the processes are out of step for good
                    multihost.fatal(exc, "an engine step")
                raise
            return tokens if logprobs is None else (tokens, logprobs)

        self._last_launch = self._launcher.submit(launch)
        self.last_timing = (time.perf_counter() - t0, 0.0)
        return StepHandle(self._last_launch, len(rows), order,
                          positions if kind.extra else None)

    def run_step(self, flat: np.ndarray, layout: Any, bitmask: np.ndarray | None,
                 decode: bool, greedy: bool, cascade: bool, extra: bool
                 ) -> tuple[jax.Array, Any]:
        """Runs one packed step on the device (the launch thread's work; a follower
        process's for each of the leader's steps): returns its tokens [max_rows] and, for
        an `extra` step, its logprobs (`step`), else None."""
        if self.channel is not None:  # host arrays as global ones, the same on all
            flat = self.channel.global_array(flat)
            bitmask = None if bitmask is None else self.channel.global_array(bitmask)
        flat_in = flat if self.fixed_inputs is None else self.fixed_inputs(flat)
        tokens, self._kv_cache, *logprobs = step(
            self.params, self._kv_cache, flat_in, self._last_tokens, bitmask,
            layout=layout, cfg=self.cfg, backend=self.backend, decode=decode,
            greedy=greedy, cascade=cascade, mesh=self.mesh, extra=extra)
        self._last_tokens = tokens
        return tokens, (logprobs[0] if logprobs else None)

    def stop_followers(self) -> None:
        """(Multi-process leader) after the last step: lets the other processes' `follow`
        return (at exit; a no-op elsewhere or after a failed step)."""
        if self.channel is None or self._failed is not None:
            return
        if self._last_launch is not None:
            try:
                self._last_launch.result()
            except Exception:
                return
        self.channel.stop()

    def fetch(self, handle: StepHandle) -> np.ndarray:
        """Waits for a dispatched step; returns the sampled token of every scheduled
        sequence, in `scheduled` order (also when a cascade plan regrouped them)."""
        t0 = time.perf_counter()
        try:
            result = handle.tokens.result()
        except Exception as exc:
            if self.channel is not None:  # (a step's failure may surface only here)
                multihost.fatal(exc, "an engine step")
            raise
        host_tokens = np.asarray(result[0] if isinstance(result, tuple) else result
                                 )[: handle.num_rows]
        self.last_timing = (self.last_timing[0], time.perf_counter() - t0)
        if handle.order is None:
            return host_tokens
        unordered = np.empty_like(host_tokens)
        unordered[handle.order] = host_tokens
        return unordered

    def fetch_logprobs(self, handle: StepHandle) -> tuple[tuple, tuple] | None:
        """An extra step's logprobs on the host, None for a plain step: per scheduled row
        (in `scheduled` order) (logprob [R], rank [R], top ids [R, k], top logprobs
        [R, k]), and the same per prompt-logprobs entry (`handle.prompt_positions`)."""
        result = handle.tokens.result()
        if not isinstance(result, tuple):
            return None
        rows, prompt = jax.tree.map(np.asarray, result[1])
        rows = tuple(a[: handle.num_rows] for a in rows)
        if handle.order is not None:
            rows = tuple(_unorder(a, handle.order) for a in rows)
        return rows, tuple(a[: len(handle.prompt_positions)] for a in prompt)

    def execute(self, scheduled: Seq, plan: CascadePlan | None = None) -> np.ndarray:
        """Runs one step and waits for it (`dispatch` + `fetch`). Records (host seconds to
        pack and dispatch, seconds waiting for the device) in `last_timing`."""
        return self.fetch(self.dispatch(scheduled, plan))


def _unorder(device_rows: np.ndarray, order: list[int]) -> np.ndarray:
    """Rows in device order -> rows in scheduled order (device row i is scheduled order[i])."""
    out = np.empty_like(device_rows)
    out[order] = device_rows
    return out
