"""The model runner (device side of the engine): the weights in the step's layout, the
paged KV cache, and the dispatch of packed steps (`input_batch.StepPacker`) to the jitted
`jprefix.worker.step.step` on one launch thread."""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from collections.abc import Sequence as Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jprefix.core.cascade import CascadePlan
from jprefix.worker import multihost, xla_flags
from jprefix.worker.fixed_inputs import FixedInputs
from jprefix.worker.input_batch import StepPacker
from jprefix.worker.kv_bits import bits_dtype, bits_format, stored_values
from jprefix.worker.kv_cache import auto_num_blocks, empty_kv_cache, kv_dtype
from jprefix.worker.pack import BucketConfig, bucket
from jprefix.worker.parallel import REPLICATED, kv_sharding, tp_config
from jprefix.worker.params import prepare_params
from jprefix.worker.spec_verify import fetch_verify_logprobs
from jprefix.worker.step import BACKENDS, KVCache, compiled_steps, default_backend, step_sample
from jprefix.worker.step_handle import MasksLater, StepHandle, to_host, unorder
from jprefix.worker.structured import step_bitmask
from models.config import ModelConfig
from models.fp8_linear import FP8


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
        cpu_num_blocks: int | None = None,
        mesh: Mesh | None = None,
        max_num_seqs: int = 256,
        fixed_inputs: bool | None = None,
        donate_params: bool = False,
        device: Any = None,
        multi_process: bool = False,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        num_speculative_tokens: int = 0,
        kv_groups: Any = None,
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
        `quantization`: see `prepare_params`; `num_speculative_tokens`: a verify step's K;
        `kv_groups`: a hybrid cache's (`hybrid_kv`)."""
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
        self._step, self._step_logits = compiled_steps(any(  # (weights quantised to fp8)
            x.dtype == FP8 for x in jax.tree.leaves(self.params)))
        cfg = cfg if mesh is None else tp_config(cfg, mesh.size)  # the step's kv heads
        self.cfg, self.backend, self.mesh, self.block_size = cfg, backend, mesh, block_size
        self.buckets = buckets or BucketConfig()
        self.kv_dtype = kv_dtype(kv_cache_dtype, model_dtype)
        if num_blocks is None:
            num_blocks = auto_num_blocks(cfg, block_size, self.kv_dtype, memory_fraction,
                                         cpu_num_blocks, 1 if mesh is None else mesh.size,
                                         device if mesh is None else
                                         mesh.devices.flat[0] if not multi_process else None,
                                         kv_groups and kv_groups.page_layers)
            if multi_process:  # one global cache: the size every process has room for
                num_blocks = multihost.smallest(num_blocks)
        self.num_blocks = num_blocks
        # The cache and the pending tokens start committed to the weights' device, as
        # every step's outputs are: a jitted call keys its compile on committedness too,
        # so an uncommitted first cache would compile its step's shape twice
        home = placed
        if home is None and mesh is None:
            home = SingleDeviceSharding(next(iter(jax.tree.leaves(self.params)[0].devices())))
        self.kv_format = bits_format(self.kv_dtype, backend, mesh)  # (`worker.kv_bits`)
        self._kv_cache: KVCache = empty_kv_cache(  # created in place, sharded if tp
            cfg, num_blocks, block_size, self.kv_dtype, home if mesh is None else
            kv_sharding(mesh), stored_as=self.kv_format and bits_dtype(self.kv_dtype),
            layers=kv_groups and kv_groups.page_layers)
        self.packer = StepPacker(block_size, self.buckets, kv_groups=kv_groups,
                                 num_speculative_tokens=num_speculative_tokens)
        # Steps launch in order on one worker thread: XLA's launch of a step's hundreds of
        # kernels takes milliseconds of host time, which then overlaps the engine's Python.
        self._launcher = concurrent.futures.ThreadPoolExecutor(1, "jprefix-launch")
        weakref.finalize(self, self._launcher.shutdown, wait=False)
        self._last_launch: concurrent.futures.Future | None = None
        self._failed: Exception | None = None  # a launch that raised: later ones refuse
        self._later: MasksLater | None = None  # dispatched with masks_later, not sampled
        self.shapes_seen: set[tuple[int, ...]] = set()
        self.last_timing = (0.0, 0.0)
        # every step returns max_rows token ids: the next step may read its pending ones
        self.max_rows = bucket(max_num_seqs, self.buckets.min_seqs)
        self._last_tokens = (jnp.zeros(self.max_rows, jnp.int32) if mesh is None else  # all
                             jax.jit(lambda: jnp.zeros(self.max_rows, jnp.int32),  # devices
                                     out_shardings=NamedSharding(mesh, REPLICATED))())
        if home is not None:
            self._last_tokens = jax.device_put(self._last_tokens, home)
        self.channel = multihost.StepChannel(mesh) if multi_process else None
        if fixed_inputs is None:
            fixed_inputs = (jax.default_backend() == "gpu" and xla_flags.command_buffers_on()
                            and not multi_process)
        if fixed_inputs and multi_process:
            raise ValueError("fixed_inputs=True: a multi-process run passes each step's "
                             "inputs as fresh global arrays (fixed_inputs None or False)")
        self.fixed_inputs = FixedInputs(home if mesh is None else NamedSharding(
            mesh, REPLICATED)) if fixed_inputs else None

    @property
    def kv_cache(self) -> KVCache:
        """The KV cache after every step dispatched so far (waits for their launches), as
        stored (integer bits where `kv_format` is set)."""
        if self._last_launch is not None:
            self._last_launch.result()
        return self._kv_cache

    def kv_cache_values(self) -> KVCache:
        """`kv_cache` with K and V in their element format (for inspection)."""
        return stored_values(self.kv_cache, self.kv_format)

    def dispatch(self, scheduled: Seq, plan: CascadePlan | None = None,
                 token_masks: dict[Any, np.ndarray] | None = None,
                 masks_later: bool = False) -> StepHandle:
        """Packs one step and queues its launch without waiting for either the launch or
        the device; `fetch` gets its tokens. `token_masks`: the allowed tokens (packed
        bitmask words) of the sequences whose sampling follows a grammar.
        `masks_later` (one process only: `can_mask_later`): queues the step up to its
        logits; `sample(handle, token_masks)` queues the rest, and must come before the
        next dispatch (so the host fills the masks while the device runs the model).

        A row whose newest token is pending reads it from the previous dispatch's
        output (the packer keeps where each sampled token sits).
        """
        t0 = time.perf_counter()
        if len(scheduled) > self.max_rows:
            raise ValueError(f"{len(scheduled)} sequences exceed the runner's {self.max_rows} rows")
        if self._later is not None:
            raise RuntimeError("the step dispatched with masks_later was never sampled")
        rows, (flat, layout, batch), order, kind, positions = self.packer.pack(scheduled, plan)
        greedy = kind.greedy
        later = self._later = MasksLater(rows, len(batch["logits_idx"]), layout, greedy,
                                          kind.extra) if masks_later else None
        bitmask = step_bitmask(rows, token_masks, len(batch["logits_idx"]))
        self.shapes_seen.add((len(batch["token_ids"]), *batch["block_tables"].shape,
                              kind.decode, kind.cascade, kind.num_decode > 0))

        def launch() -> jax.Array:  # on the worker thread, in dispatch order
            try:
                if self._failed is not None:  # its cache and tokens are gone: fail fast
                    raise RuntimeError("an earlier engine step failed, so the KV cache and "
                                       "the pending tokens are lost: create a new engine"
                                       ) from self._failed
                if later is not None:
                    flat_in = flat if self.fixed_inputs is None else self.fixed_inputs(flat)
                    *logits, self._kv_cache = self._step_logits(
                        self.params, self._kv_cache, flat_in, self._last_tokens, layout=layout,
                        cfg=self.cfg, backend=self.backend, decode=kind.decode,
                        cascade=kind.cascade, mesh=self.mesh, extra=kind.extra,
                        kv_format=self.kv_format)
                    return *logits, flat_in
                step_args = (flat, layout, bitmask, kind.decode, greedy, kind.cascade,
                             kind.extra)
                if self.channel is not None:
                    self.channel.send(*step_args)
                tokens, logprobs = self.run_step(*step_args)
                return to_host(tokens, logprobs)
            except Exception as exc:
                self._failed = self._failed or exc
                if later is not None:
                    later.result.set_exception(exc)
                if self.channel is not None:  # the processes are out of step for good
                    multihost.fatal(exc, "an engine step")
                raise

        self._last_launch = self._launcher.submit(launch)
        self.last_timing = (time.perf_counter() - t0, 0.0)
        if later is not None:
            later.forward = self._last_launch
        return StepHandle(self._last_launch if later is None else later.result, len(rows),
                          order, positions if kind.extra else None, later, self.max_rows if
                          "spec_idx" in batch else None)

    def update_kv_cache(self, fn: Any) -> None:
        """Queues `fn(cache) -> cache` on the launch thread after the steps dispatched so
        far (the host tier's copies: `jprefix.worker.offload`)."""
        def launch() -> None:
            self._kv_cache = fn(self._kv_cache)
        self._last_launch = self._launcher.submit(launch)

    @property
    def can_mask_later(self) -> bool:
        """Whether `dispatch(masks_later=True)` works (one process: the other processes
        of a multi-process run follow whole steps)."""
        return self.channel is None

    def sample(self, handle: StepHandle, token_masks: dict[Any, np.ndarray] | None) -> None:
        """Queues the sampling of a step dispatched with `masks_later`, with the grammar
        masks of its structured rows (as `dispatch` takes them)."""
        later = handle.later
        if later is None or later is not self._later:
            raise RuntimeError("sample() takes the last step dispatched with masks_later")
        self._later = None
        bitmask = step_bitmask(later.rows, token_masks, later.num_rows)

        def launch() -> None:
            try:
                logits, prompt_logits, token_ids, flat_in = later.forward.result()
                out = step_sample(logits, prompt_logits, token_ids, flat_in, self._last_tokens,
                                  bitmask, layout=later.layout, greedy=later.greedy,
                                  extra=later.extra, mesh=self.mesh)
                tokens, logprobs = out if later.extra else (out, None)
                self._last_tokens = tokens
                later.result.set_result(to_host(tokens, logprobs))
            except Exception as exc:
                self._failed = self._failed or exc
                if not later.result.done():
                    later.result.set_exception(exc)
                raise

        self._last_launch = self._launcher.submit(launch)

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
        tokens, self._kv_cache, *logprobs = self._step(
            self.params, self._kv_cache, flat_in, self._last_tokens, bitmask,
            layout=layout, cfg=self.cfg, backend=self.backend, decode=decode,
            greedy=greedy, cascade=cascade, mesh=self.mesh, extra=extra,
            kv_format=self.kv_format)
        self._last_tokens = tokens if len(tokens) == self.max_rows else tokens[: self.max_rows]
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
        return host_tokens if handle.order is None else unorder(host_tokens, handle.order)

    def fetch_logprobs(self, handle: StepHandle) -> tuple[tuple, ...] | None:
        """An extra step's logprobs on the host, None for a plain step: per scheduled row
        (in `scheduled` order) (logprob [R], rank [R], top ids [R, k], top logprobs [R, k]),
        the same per prompt-logprobs entry (`handle.prompt_positions`), then a verify step's."""
        result = handle.tokens.result()
        if not isinstance(result, tuple):
            return None
        rows, prompt = jax.tree.map(np.asarray, result[1][:2])
        rows = tuple(a[: handle.num_rows] for a in rows)
        rows = rows if handle.order is None else tuple(unorder(a, handle.order) for a in rows)
        spec = () if handle.verify_rows is None else (fetch_verify_logprobs(handle),)
        return rows, tuple(a[: len(handle.prompt_positions)] for a in prompt), *spec

    def execute(self, scheduled: Seq, plan: CascadePlan | None = None) -> np.ndarray:
        """Runs one step and waits for it (`dispatch` + `fetch`). Records (host seconds to
        pack and dispatch, seconds waiting for the device) in `last_timing`."""
        return self.fetch(self.dispatch(scheduled, plan))
