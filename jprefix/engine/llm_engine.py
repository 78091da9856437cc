"""LLMEngine: schedule -> run -> postprocess, steppable from any loop or thread.

Requests are validated and tokenized when they are made (`make_sequence`: errors raise
before anything is scheduled) and queued; `step()` drains the queues into the scheduler,
so another thread or an event loop may add and abort requests between steps. With async
scheduling one step is in flight while the next is scheduled and dispatched.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

from jprefix.core.block_manager import BlockManager
from jprefix.core.cascade import CascadePlan, CascadePlanner
from jprefix.core.config import SchedulerConfig
from jprefix.core.outputs import RequestOutput
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import Scheduler, SchedulerOutput
from jprefix.core.sequence import Sequence
from jprefix.engine.args import EngineArgs, resolve_dtype
from jprefix.engine.input_processor import InputProcessor
from jprefix.engine.output_processor import OutputProcessor
from jprefix.worker import xla_flags
from jprefix.worker.model_runner import ModelRunner, StepHandle
from jprefix.worker.pack import BucketConfig
from jprefix.worker.parallel import make_mesh
from models.loader import LoadedModel, load, model_config


@dataclasses.dataclass
class _InFlight:
    out: SchedulerOutput
    handle: StepHandle
    t_start: float
    t_dispatched: float


def build_runner(model: LoadedModel | str, args: EngineArgs) -> tuple[LoadedModel, ModelRunner]:
    """The model (loaded here when given by name) and its runner: the one place the mesh
    is made. A model loaded here is handed to the runner, which replaces its weights by
    the step's layout (one copy on the device); a LoadedModel passed in is left as is and
    the runner keeps the step's layout beside it (unless it is in that layout already)."""
    xla_flags.apply()
    owned = not isinstance(model, LoadedModel)
    cfg = model_config(model, args.load_format) if owned else model.config
    mesh = make_mesh(cfg, args.tensor_parallel_size)
    if owned:
        model = load(model, resolve_dtype(args.dtype, model), args.load_format, mesh=mesh)
    runner = ModelRunner(
        model.params, cfg, args.num_kv_blocks, args.block_size, model.params.embed.dtype,
        backend=args.attention_backend, buckets=BucketConfig(min_seqs=8),
        unroll_layers=args.unroll_layers, memory_fraction=args.gpu_memory_utilization,
        cpu_num_blocks=args.cpu_num_kv_blocks, mesh=mesh, max_num_seqs=args.max_num_seqs,
        fixed_inputs=args.fixed_inputs, donate_params=owned,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
    )
    if owned:
        model = dataclasses.replace(model, params=runner.params)
    return model, runner


def fit_max_model_len(args: EngineArgs, model_max: int, num_blocks: int) -> int:
    """The context length requests are validated against: one sequence of that many
    tokens always fits in the KV cache alone (block 0 is the null block), so a request the
    engine accepts can always finish, preempting others as needed.

    An explicit `max_model_len` must fit the model and the cache (else ValueError). Without
    one: the model's length, capped to the cache when the user sized the cache
    (`num_kv_blocks`); a cache sized from memory that cannot hold the model's length is
    refused, naming what to change."""
    capacity = (num_blocks - 1) * args.block_size
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


class LLMEngine:
    """Owns the scheduler (host) and the model runner (device)."""

    def __init__(self, model: LoadedModel | str, args: EngineArgs | None = None,
                 runner: Any = None):
        """`model`: a LoadedModel or a name `models.loader.load` takes (see `build_runner`).
        `runner`: a ModelRunner-like object to use instead of building one (benchmarks of
        the host side run the engine over a stub)."""
        self.args = args or EngineArgs()
        if runner is None:
            model, runner = build_runner(model, self.args)
        self.model, self.runner = model, runner
        cfg = model.config
        self.max_model_len = fit_max_model_len(self.args, cfg.max_position_embeddings,
                                               runner.num_blocks)
        self.scheduler = self._make_scheduler(runner.num_blocks)
        self.inputs = InputProcessor(model.tokenizer, model.name, cfg.vocab_size,
                                     self.max_model_len, self.args.seed)
        self.outputs = OutputProcessor(model.tokenizer)
        self.cascade_planner = CascadePlanner(
            self.args.block_size, self.scheduler.block_manager.ref_count,
            self.args.cascade_min_group, self.args.cascade_min_blocks)
        self._pending: collections.deque = collections.deque()
        self._aborts: collections.deque = collections.deque()
        self._live: dict[str, Sequence] = {}  # requests in the scheduler, by id
        # (num_seqs, num_tokens, host_s, step_s, device_wait_s) of recent steps
        self.step_stats: collections.deque = collections.deque(maxlen=100_000)
        self._step_lock = threading.Lock()
        self._inflight: _InFlight | None = None  # dispatched, tokens not yet processed
        self._last_processed = 0.0

    def _make_scheduler(self, num_blocks: int) -> Scheduler:
        cfg = SchedulerConfig(
            max_num_seqs=self.args.max_num_seqs,
            max_num_batched_tokens=self.args.max_num_batched_tokens,
            enable_prefix_caching=self.args.enable_prefix_caching,
            enable_chunked_prefill=self.args.enable_chunked_prefill,
            policy=self.args.policy,
            eos_token_ids=frozenset(self.model.config.eos_token_ids),
            max_model_len=self.max_model_len,
        )
        blocks = BlockManager(num_blocks, self.args.block_size)
        return Scheduler(cfg, blocks, PrefixPool(blocks))

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def make_sequence(self, prompt: Any, sampling_params: SamplingParams | None = None,
                      prefix_len: int | None = None, request_id: str | None = None,
                      cache_salt: str | None = None) -> Sequence:
        """Validates one request and builds its Sequence (`InputProcessor.make_sequence`)."""
        return self.inputs.make_sequence(prompt, sampling_params, prefix_len, request_id,
                                         cache_salt)

    def add_sequence(self, seq: Sequence) -> None:
        """Queues a validated sequence; thread-safe, takes effect at the next step."""
        self._pending.append(seq)

    def add_request(self, request_id: str | None, prompt: Any, sampling_params=None,
                    prefix_len: int | None = None, cache_salt: str | None = None) -> str:
        seq = self.make_sequence(prompt, sampling_params, prefix_len, request_id, cache_salt)
        self.add_sequence(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> None:
        """Aborts a request at the next step; its blocks are released."""
        self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return (bool(self._pending) or self.scheduler.has_unfinished()
                or self._inflight is not None)

    def step(self) -> list[RequestOutput]:
        """One engine step: schedules and dispatches a step, and processes the tokens of
        the step before it (async scheduling) or of this one; returns the requests that
        finished (or were aborted, or can never fit) in what it processed."""
        with self._step_lock:
            t0 = time.perf_counter()
            finished = self._drain_queues()
            out = self.scheduler.schedule()
            finished += out.ignored
            launched = None
            if out.scheduled:
                handle = self.runner.dispatch(out.scheduled, self._cascade_plan(out))
                launched = _InFlight(out, handle, t0, time.perf_counter())
            if self.args.async_scheduling:
                done, self._inflight = self._inflight, launched
            else:
                done = launched
            if done is not None:
                finished += self._process(done)
            if (self._inflight is not None and not self._pending
                    and not self.scheduler.has_unfinished()):
                # every sequence of the step in flight has already finished (a stop seen
                # one step late): retire it now, so an idle engine holds no step
                self._process(self._inflight)
                self._inflight = None
            if not self.scheduler.running:
                self.cascade_planner.forget()  # nothing decodes: hold no finished sequence
            return self._collect(finished)

    def _cascade_plan(self, out: SchedulerOutput) -> CascadePlan | None:
        """The step's cascade grouping, when cascade attention is on (read every step)."""
        if not (self.args.enable_cascade and self.args.enable_prefix_caching):
            self.cascade_planner.forget()
            return None
        return self.cascade_planner.plan(out.scheduled)

    def _process(self, done: _InFlight) -> list[Sequence]:
        """Fetches a dispatched step's tokens and applies them; returns who finished."""
        tokens = self.runner.fetch(done.handle)
        t_fetched = time.perf_counter()
        finished = self.scheduler.update(done.out, tokens.tolist())
        finished += self.outputs.check_stop_strings(self.scheduler.finish)
        self._record(done, t_fetched)
        return finished

    def _record(self, done: _InFlight, t_fetched: float) -> None:
        """Per-step timing: host seconds (schedule, pack, dispatch, postprocess); the
        step's period, from the step before it processed (or from its own start, after
        idling) to its tokens processed; and seconds blocked on the device. With async
        scheduling a step's host work overlaps the device's work on the step before."""
        wait = self.runner.last_timing[1]
        end = time.perf_counter()
        host = (done.t_dispatched - done.t_start) + (end - t_fetched)
        period = end - max(self._last_processed, done.t_start)
        self._last_processed = end
        self.step_stats.append((len(done.out.scheduled), done.out.num_batched_tokens, host,
                                period, wait))

    def _drain_queues(self) -> list[Sequence]:
        """Moves queued requests into the scheduler; returns the sequences aborted."""
        while self._pending:
            seq = self._pending.popleft()
            self._live[seq.request_id] = seq
            self.scheduler.add(seq)
            self.outputs.add(seq)
        aborted = []
        while self._aborts:
            seq = self._live.get(self._aborts.popleft())
            if seq is not None and self.scheduler.abort(seq.request_id):
                aborted.append(seq)
        return aborted

    def _collect(self, finished: list[Sequence]) -> list[RequestOutput]:
        for seq in finished:
            self._live.pop(seq.request_id, None)
        return self.outputs.outputs(finished)
