"""The model runner (device side of the engine): the weights in the step's layout, the
paged KV cache, and the dispatch of packed steps (`input_batch.StepPacker`) to the jitted
`jprefix.worker.step.step` on one launch thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
import weakref
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jprefix.core.cascade import CascadePlan
from jprefix.worker import xla_flags
from jprefix.worker.input_batch import StepPacker
from jprefix.worker.kv_cache import check_fp8_device, empty_kv_cache, kv_block_bytes, kv_dtype
from jprefix.worker.pack import BucketConfig, bucket
from jprefix.worker.parallel import REPLICATED, kv_sharding, shard_params
from jprefix.worker.step import BACKENDS, KVCache, default_backend, step
from models.config import ModelConfig
from models.layout import fuse_projections, quantize_linears, unstack_layers


class StepHandle(NamedTuple):
    """A dispatched step: its launch (resolving to the device output), live rows, and
    the device's row order (indices into the scheduled list; None when unchanged)."""

    tokens: concurrent.futures.Future
    num_rows: int
    order: list[int] | None


@functools.partial(jax.jit, donate_argnums=0)
def _refill(buffer: jax.Array, values: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(buffer, values, (0,) * buffer.ndim)


class FixedInputs:
    """Device buffers that keep their address from step to step: one per shape and dtype,
    refilled in place (donated) with each step's host values.

    XLA records a step into command buffers once and afterwards updates only the
    commands whose buffers moved. A step's inputs arriving in fresh buffers every time
    would move every command that reads them; refilled buffers stay put, so a repeated
    step replays its recording. Used where command buffers are on (`xla_flags`).
    """

    def __init__(self, sharding: Any = None):
        self.sharding = sharding
        self._buffers: dict[tuple, jax.Array] = {}

    def __call__(self, values: np.ndarray) -> jax.Array:
        key = (values.shape, values.dtype.str)
        buffer = self._buffers.pop(key, None)
        if buffer is None:
            buffer = jax.device_put(np.zeros_like(values), self.sharding)
        buffer = self._buffers[key] = _refill(buffer, values)
        return buffer


def auto_num_blocks(
    cfg: ModelConfig, block_size: int, dtype: Any, memory_fraction: float, cpu_blocks: int,
    num_shards: int = 1,
) -> int:
    """KV blocks that fit in `memory_fraction` of the device memory free now (`cpu_blocks`
    where device memory cannot be measured); each of `num_shards` devices holds 1/num_shards
    of every block. `dtype` is the cache's element dtype (an fp8 one counts its scales)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:  # CPU: no device memory to size from
        return cpu_blocks
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    per_device = kv_block_bytes(cfg, block_size, dtype) // num_shards
    return max(2, int(free * memory_fraction) // per_device)


def prepare_params(params: Any, cfg: ModelConfig, mesh: Mesh | None = None,
                   unroll_layers: bool | None = None, donate: bool = False,
                   quantization: str | None = None) -> Any:
    """The weights in the layout the step runs (the one place that decides it): sharded
    over `mesh`; on GPU (or with `unroll_layers`) split into per-layer buffers (no
    per-layer weight copy in the step), with Q/K/V and gate/up fused into one matmul each
    on a single device (layout "fused"). Idempotent. `donate`: the caller hands the
    weights over, so the input buffers the result does not reuse are freed at once
    (one copy of the weights on the device, not two, before the KV cache is sized).
    `quantization="fp8"`: the linear layers' weights quantised to fp8 (one device)."""
    if unroll_layers is None:  # GPU: unrolled; CPU: lax.scan compiles faster
        unroll_layers = jax.default_backend() == "gpu"
    given = params
    if mesh is not None and params.layout == "stacked":  # (per-layer ones are sharded)
        params = shard_params(params, cfg, mesh)
    if unroll_layers:
        if params.layout == "stacked":
            params = unstack_layers(params, fuse=mesh is None)
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
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
    ):
        """`num_blocks` None sizes the KV cache from `memory_fraction` of the device memory
        free once the weights are placed; `mesh` (`parallel.make_mesh`) shards weights and
        cache for tensor parallelism; `donate_params`: see `prepare_params`. `fixed_inputs`
        passes each step's packed buffers in device buffers refilled in place
        (`FixedInputs`); None: where XLA records command buffers. `kv_cache_dtype`
        ("auto": `kv_dtype`, else an fp8 format) picks the cache's format
        (`worker.kv_cache`); the block count from memory counts its bytes.
        `quantization`: see `prepare_params`."""
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
        self.params = prepare_params(params, cfg, mesh, unroll_layers, donate_params,
                                     quantization)
        self.cfg, self.backend, self.mesh = cfg, backend, mesh
        self.block_size = block_size
        self.buckets = buckets or BucketConfig()
        self.kv_dtype = kv_dtype(kv_cache_dtype, model_dtype)
        if num_blocks is None:
            num_blocks = auto_num_blocks(cfg, block_size, self.kv_dtype, memory_fraction,
                                         cpu_num_blocks, 1 if mesh is None else mesh.size)
        self.num_blocks = num_blocks
        self._kv_cache: KVCache = empty_kv_cache(  # created in place, sharded if tp
            cfg, num_blocks, block_size, self.kv_dtype,
            None if mesh is None else kv_sharding(mesh))
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
        self._last_tokens = jnp.zeros(self.max_rows, jnp.int32)
        if fixed_inputs is None:
            fixed_inputs = jax.default_backend() == "gpu" and xla_flags.command_buffers_on()
        self.fixed_inputs = (FixedInputs(None if mesh is None else NamedSharding(mesh, REPLICATED))
                             if fixed_inputs else None)

    @property
    def kv_cache(self) -> KVCache:
        """The KV cache after every step dispatched so far (waits for their launches)."""
        if self._last_launch is not None:
            self._last_launch.result()
        return self._kv_cache

    def dispatch(self, scheduled: Seq, plan: CascadePlan | None = None) -> StepHandle:
        """Packs one step and queues its launch without waiting for either the launch or
        the device; `fetch` gets its tokens.

        A row whose newest token is pending reads it from the previous dispatch's
        output (the packer keeps where each sampled token sits).
        """
        t0 = time.perf_counter()
        if len(scheduled) > self.max_rows:
            raise ValueError(f"{len(scheduled)} sequences exceed the runner's {self.max_rows} rows")
        rows, (flat, layout, batch), order, kind = self.packer.pack(scheduled, plan)
        greedy = not batch["temperature"].any()
        self.shapes_seen.add((len(batch["token_ids"]), *batch["block_tables"].shape,
                              kind.decode, kind.cascade, kind.num_decode > 0))

        def launch() -> jax.Array:  # on the worker thread, in dispatch order
            if self._failed is not None:  # its cache and tokens are gone: fail fast
                raise RuntimeError("an earlier engine step failed, so the KV cache and the "
                                   "pending tokens are lost: create a new engine"
                                   ) from self._failed
            try:
                flat_in = flat if self.fixed_inputs is None else self.fixed_inputs(flat)
                tokens, self._kv_cache = step(
                    self.params, self._kv_cache, flat_in, self._last_tokens,
                    layout=layout, cfg=self.cfg, backend=self.backend, decode=kind.decode,
                    greedy=greedy, cascade=kind.cascade, mesh=self.mesh)
                # Queue the copy to the host now, so the tokens may be on the host already
                # when the engine asks (async scheduling fetches a step's tokens after
                # dispatching the next one) instead of the copy starting only then.
                tokens.copy_to_host_async()
            except Exception as exc:
                self._failed = exc
                raise
            self._last_tokens = tokens
            return tokens

        self._last_launch = self._launcher.submit(launch)
        self.last_timing = (time.perf_counter() - t0, 0.0)
        return StepHandle(self._last_launch, len(rows), order)

    def fetch(self, handle: StepHandle) -> np.ndarray:
        """Waits for a dispatched step; returns the sampled token of every scheduled
        sequence, in `scheduled` order (also when a cascade plan regrouped them)."""
        t0 = time.perf_counter()
        host_tokens = np.asarray(handle.tokens.result())[: handle.num_rows]
        self.last_timing = (self.last_timing[0], time.perf_counter() - t0)
        if handle.order is None:
            return host_tokens
        unordered = np.empty_like(host_tokens)
        unordered[handle.order] = host_tokens
        return unordered

    def execute(self, scheduled: Seq, plan: CascadePlan | None = None) -> np.ndarray:
        """Runs one step and waits for it (`dispatch` + `fetch`). Records (host seconds to
        pack and dispatch, seconds waiting for the device) in `last_timing`."""
        return self.fetch(self.dispatch(scheduled, plan))
