"""The model runner (device side of the engine): the weights, the paged KV cache, and
the dispatch of packed steps to the jitted `jprefix.worker.step.step` on one launch thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import time
import weakref
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jprefix.core.cascade import CascadePlan, pack_cascade
from jprefix.worker.pack import (
    BucketConfig,
    PackCache,
    PackedStep,
    bucket,
    pack_flat,
    pack_step,
)
from jprefix.worker.parallel import REPLICATED, kv_sharding, shard_params
from jprefix.worker.repack import remember_decode, repack_decode
from jprefix.worker.step import BACKENDS, KVCache, default_backend, step
from models.config import ModelConfig
from models.llama import fuse_projections, unstack_layers


class StepHandle(NamedTuple):
    """A dispatched step: its launch (resolving to the device output), live rows, and
    the device's row order (`pack_rows`)."""

    tokens: concurrent.futures.Future
    num_rows: int
    order: list[int] | None


def xla_command_buffers_on() -> bool:
    """Whether XLA:GPU records jitted steps into command buffers (CUDA graphs): the last
    `--xla_gpu_enable_command_buffer=` in XLA_FLAGS, XLA's default (on) when absent.
    `import jprefix` turns them off unless JPREFIX_XLA_COMMAND_BUFFERS=1."""
    value = None
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_gpu_enable_command_buffer="):
            value = flag.split("=", 1)[1]
    return value != ""


@functools.partial(jax.jit, donate_argnums=0)
def _refill(buffer: jax.Array, values: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(buffer, values, (0,) * buffer.ndim)


class FixedInputs:
    """Device buffers that keep their address from step to step: one per shape and dtype,
    refilled in place (donated) with each step's host values.

    XLA records a step into command buffers once and afterwards updates only the
    commands whose buffers moved. A step's inputs arriving in fresh buffers every time
    would move every command that reads them; refilled buffers stay put, so a repeated
    step replays its recording. (On the H200 a replayed step still ran slower than a
    plain launch, so jprefix keeps command buffers off by default: docs/PERF.md.)
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


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: Any) -> int:
    """Bytes of one physical block across all layers, K and V."""
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * itemsize


def auto_num_blocks(
    cfg: ModelConfig, block_size: int, dtype: Any, memory_fraction: float, cpu_blocks: int,
    num_shards: int = 1,
) -> int:
    """KV blocks that fit in `memory_fraction` of the device memory free now (`cpu_blocks`
    where device memory cannot be measured); each of `num_shards` devices holds 1/num_shards
    of every block."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:  # CPU: no device memory to size from
        return cpu_blocks
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    per_device = kv_block_bytes(cfg, block_size, dtype) // num_shards
    return max(2, int(free * memory_fraction) // per_device)


def pack_rows(scheduled: Seq, plan: CascadePlan | None, block_size: int,
              buckets: BucketConfig, cache: PackCache | None = None
              ) -> tuple[list, PackedStep, list[int] | None]:
    """A step's rows in device order, their packed buffers, and that order (indices into
    `scheduled`; None when unchanged). A cascade plan puts its groups first; a step that
    mixes one-token rows with longer ones puts the one-token rows first and records
    their count (`num_decode`), so attention runs them with the decode tiling
    (`mixed_paged_attention`). `cache` carries what the next step may reuse
    (`jprefix.worker.pack.PackCache`), including a steady decode batch's last buffers
    (`jprefix.worker.repack.repack_decode`)."""
    order = plan.order if plan is not None else None
    if order is not None:
        scheduled = list(map(scheduled.__getitem__, order))
    if cache is not None:
        packed = repack_decode(scheduled, plan, block_size, buckets.min_blocks, cache)
        if packed is not None:
            return list(scheduled), packed, order
        cache.decode = None  # (kept again below if this step decodes; not if packing fails)
    num_decode = 0
    if plan is None:
        ones = [i for i, sc in enumerate(scheduled) if sc.num_new_tokens == 1]
        if ones and len(ones) < len(scheduled):
            num_decode = len(ones)
            taken = set(ones)
            order = ones + [i for i in range(len(scheduled)) if i not in taken]
            scheduled = [scheduled[i] for i in order]
    batch = pack_step(scheduled, block_size, buckets, cache)
    if plan is not None:
        batch |= pack_cascade(scheduled, plan, block_size, len(batch["kv_lens"]),
                              buckets.min_blocks, None if cache is None else cache.suffix_tables)
    if num_decode:
        batch["num_decode"] = np.array([num_decode], np.int32)
    packed = pack_flat(batch)
    if cache is not None:
        remember_decode(cache, scheduled, plan, packed)
    return list(scheduled), packed, order


def record_pending_rows(rows: Seq) -> None:
    """Each sampling row's index in the step's output: where the next step, dispatched
    before this one's tokens reach the host, reads the pending token."""
    for row, (seq, _, _, sampled) in enumerate(rows):
        if sampled:
            seq.pending_row = row


def prepare_params(params: Any, cfg: ModelConfig, mesh: Mesh | None = None,
                   unroll_layers: bool | None = None) -> Any:
    """The weights as the step runs them: sharded over `mesh`; on GPU (or with
    `unroll_layers`) split into per-layer buffers (no per-layer weight copy in the step)
    with Q/K/V and gate/up fused into one matmul each on a single device. Idempotent."""
    if unroll_layers is None:  # GPU: unrolled; CPU: lax.scan compiles faster
        unroll_layers = jax.default_backend() == "gpu"
    if mesh is not None and not isinstance(params.layers, tuple):  # per-layer: sharded
        params = shard_params(params, cfg, mesh)
    if unroll_layers:
        if not isinstance(params.layers, tuple):
            params = unstack_layers(params, fuse=mesh is None)
        elif mesh is None:
            params = fuse_projections(params)
    return params


class ModelRunner:
    """Owns the params, the KV cache and the compiled steps."""

    def __init__(
        self,
        params: Any,
        cfg: ModelConfig,
        num_blocks: int | None,
        block_size: int,
        kv_dtype: Any,
        backend: str | None = None,
        buckets: BucketConfig | None = None,
        unroll_layers: bool | None = None,
        memory_fraction: float = 0.9,
        cpu_num_blocks: int = 4096,
        mesh: Mesh | None = None,
        max_num_seqs: int = 256,
        fixed_inputs: bool | None = None,
    ):
        """`num_blocks` None sizes the KV cache from `memory_fraction` of the device memory
        free once the weights are placed; `mesh` (jprefix.worker.parallel) shards weights and
        cache for tensor parallelism. `fixed_inputs` passes each step's packed buffers in
        device buffers refilled in place (`FixedInputs`); None: where XLA records command
        buffers (on GPU, with JPREFIX_XLA_COMMAND_BUFFERS=1)."""
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
        self.params = prepare_params(params, cfg, mesh, unroll_layers)
        self.cfg, self.backend, self.mesh = cfg, backend, mesh
        self.block_size = block_size
        self.buckets = buckets or BucketConfig()
        if num_blocks is None:
            num_blocks = auto_num_blocks(cfg, block_size, kv_dtype, memory_fraction,
                                         cpu_num_blocks, 1 if mesh is None else mesh.size)
        self.num_blocks = num_blocks
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, kv_dtype),
                        out_shardings=None if mesh is None else kv_sharding(mesh))
        self._kv_cache: KVCache = (zeros(), zeros())  # created in place, sharded if tp
        # Steps launch in order on one worker thread: XLA's launch of a step's ~500-800
        # kernels takes milliseconds of host time, which then overlaps the engine's Python.
        self._pack_cache = PackCache()  # what the next step's packing may reuse
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
            fixed_inputs = jax.default_backend() == "gpu" and xla_command_buffers_on()
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
        output. Records each sampling row's output row in `seq.pending_row`.
        """
        t0 = time.perf_counter()
        scheduled, (flat, layout, batch), order = pack_rows(
            scheduled, plan, self.block_size, self.buckets, self._pack_cache)
        decode = int(batch["cu_q_lens"][len(scheduled)]) == len(scheduled)  # 1 token each
        greedy = not batch["temperature"].any()
        self.shapes_seen.add((len(batch["token_ids"]), *batch["block_tables"].shape, decode,
                              plan is not None, "num_decode" in batch))
        if len(batch["kv_lens"]) > self.max_rows:
            raise ValueError(f"{len(scheduled)} sequences exceed the runner's {self.max_rows} rows")

        def launch() -> jax.Array:  # on the worker thread, in dispatch order
            if self._failed is not None:  # its cache and tokens are gone: fail fast
                raise RuntimeError("an earlier engine step failed, so the KV cache and the "
                                   "pending tokens are lost: create a new engine"
                                   ) from self._failed
            try:
                flat_in = flat if self.fixed_inputs is None else self.fixed_inputs(flat)
                tokens, self._kv_cache = step(
                    self.params, self._kv_cache, flat_in, self._last_tokens,
                    layout=layout, cfg=self.cfg, backend=self.backend, decode=decode,
                    greedy=greedy, cascade=plan is not None, mesh=self.mesh)
                # Queue the copy to the host now, so the tokens may be on the host already
                # when the engine asks (async scheduling fetches a step's tokens after
                # dispatching the next one) instead of the copy starting only then. (In the
                # TTFT runs, which fetch at once, it made no measurable difference.)
                tokens.copy_to_host_async()
            except Exception as exc:
                self._failed = exc
                raise
            self._last_tokens = tokens
            return tokens

        self._last_launch = self._launcher.submit(launch)
        record_pending_rows(scheduled)
        self.last_timing = (time.perf_counter() - t0, 0.0)
        return StepHandle(self._last_launch, len(scheduled), order)

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
