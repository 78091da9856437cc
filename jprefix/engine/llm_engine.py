"""LLMEngine: schedule -> run -> postprocess, steppable from any loop or thread.

Requests are validated and tokenized when they are made (`make_request`: errors raise
before anything is scheduled) and queued (`add`); `step()` drains the queues into the scheduler,
so another thread or an event loop may add and abort requests between steps. With async
scheduling one step is in flight while the next is scheduled and dispatched; speculation
waits for a step's tokens only when they are needed (`_sync_speculation`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

from jprefix.core.cascade import CascadePlan, CascadePlanner
from jprefix.core.kv_events import KVEventSink
from jprefix.core.outputs import RequestOutput
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.scheduler import SchedulerOutput
from jprefix.core.sequence import Sequence
from jprefix.core.spec_decode import Speculator, pins_sync
from jprefix.engine import prefix_cache_file
from jprefix.engine.args import EngineArgs
from jprefix.engine.drafter import Drafter
from jprefix.engine.front import EngineFront
from jprefix.engine.input_processor import InputProcessor
from jprefix.engine.kv_events import KVEventPublisher
from jprefix.engine.kv_events import parse_config as parse_kv_events
from jprefix.engine.kv_tier import KVTier, host_summary, save_prefix_cache
from jprefix.engine.output_processor import OutputProcessor
from jprefix.engine.runner_setup import (
    build_runner,
    fit_max_model_len,
    hybrid_kv_groups,
    make_scheduler,
)
from jprefix.engine.spec_stats import apply_verified
from jprefix.engine.stats import EngineStats, engine_counters, summarize_stats
from jprefix.engine.structured_output import StructuredOutputManager
from jprefix.worker.spec_verify import fetch_verified
from jprefix.worker.step_handle import StepHandle
from models.loader import LoadedModel


@dataclasses.dataclass
class _InFlight:
    out: SchedulerOutput
    handle: StepHandle
    t_start: float
    t_dispatched: float
    verifies: bool = False  # rows with proposals: the next step waits for its tokens


class LLMEngine(EngineFront):
    """Owns the scheduler (host), the model runner (device) and the requests' output
    states; its request surface is `EngineFront`'s."""

    def __init__(self, model: LoadedModel | str, args: EngineArgs | None = None,
                 runner: Any = None, devices: list[Any] | None = None):
        """`model`, `devices`: `build_runner`'s. `runner`: a ModelRunner-like object to use
        instead of building one (benchmarks of the host side run the engine over a stub)."""
        self.args, draft = args or EngineArgs(), None
        if runner is None:
            model, runner, draft = build_runner(model, self.args, devices)
        self.model, self.runner = model, runner
        cfg = model.config
        self.kv_groups = hybrid_kv_groups(cfg, self.args)  # (a hybrid cache's; else None)
        self.max_model_len = fit_max_model_len(self.args, cfg.max_position_embeddings,
                                               runner.num_blocks,
                                               getattr(self.kv_groups, "num_groups", 1))
        self.kv_tier = self._make_kv_tier()
        self.speculator = (spec := self.args.speculative_config) and Speculator(spec)
        self._async = self.args.async_scheduling
        self._spec_hot = False  # a sequence would propose (`_sync_speculation`)
        self._pinned: set[str] = set()  # live requests that keep steps synchronous
        self.scheduler = make_scheduler(self.args, cfg, runner.num_blocks, self.max_model_len,
                                        self.kv_groups, self.kv_tier, self.speculator)
        self.drafter = draft and Drafter(draft, self.prefix_pool.trie)  # (`draft_model`)
        if self.args.prefix_cache_path is not None:
            self.kv_tier.load_file(self.args.prefix_cache_path, prefix_cache_file.identity(self))
        self.kv_events = self._make_kv_events()
        self.inputs = InputProcessor(model.tokenizer, model.name, cfg.vocab_size,
                                     self.max_model_len, self.args.seed)
        self.outputs = OutputProcessor(model.tokenizer)
        self.structured = StructuredOutputManager(model.tokenizer, cfg.vocab_size,
                                                  tuple(cfg.eos_token_ids))
        self.stats = EngineStats(spec_k=spec.num_speculative_tokens if spec else 0)
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
        self.num_requests = 0  # requests the scheduler received

    def _make_kv_tier(self) -> KVTier | None:
        """The host tier (kv_offloading_size, or the blocks of prefix_cache_path)."""
        need = 0
        if self.args.prefix_cache_path is not None:
            header, _ = prefix_cache_file.read_header(self.args.prefix_cache_path)
            need = int(header.get("num_blocks", 0)) if not self.args.kv_offloading_size else 0
        if not (self.args.kv_offloading_size or need):
            return None
        return KVTier.for_args(self.runner, self.args.kv_offloading_size, self.args.block_size,
                               need, self.args.kv_offloading_step_tokens)

    def _make_kv_events(self) -> KVEventPublisher | None:
        """KV cache events (`kv_events_config`): both tiers append to one sink."""
        cfg = parse_kv_events(self.args.kv_events_config)
        if cfg is None:
            return None
        sink = self.prefix_pool.events = KVEventSink(self.args.block_size)
        if self.kv_tier is not None:
            self.kv_tier.pool.events = sink
        return KVEventPublisher(cfg, sink)

    def save_prefix_cache(self, path: str) -> int:
        """Writes the prefix cache of both tiers to `path` (`prefix_cache_file`); returns
        the blocks written. Waits for the steps in flight."""
        if self.kv_groups is not None:
            raise ValueError("save_prefix_cache: a hybrid KV cache (a model mixing window "
                             "and full layers) is not saved; set "
                             "disable_hybrid_kv_cache_manager=True")
        with self._step_lock:
            return save_prefix_cache(self.prefix_pool, self.kv_tier, self.runner, path,
                                     prefix_cache_file.identity(self))

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def prefix_pool(self) -> PrefixPool:
        """The prefix cache's user surface (`PrefixPool`)."""
        return self.scheduler.prefix_pool

    def summary(self) -> dict[str, Any]:
        """/stats' body: `summarize_stats` of this engine as the one replica."""
        reps = [self.counters() | {"replica": 0}]
        return summarize_stats(reps, data_parallel_size=1, **host_summary(reps))

    def _queue(self, seq: Sequence, prompt: str | None = None) -> None:
        """Queues a validated sequence (of `make_request`); thread-safe, takes effect at
        the next step."""
        self._pending.append((seq, prompt))

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
            finished = self._sync_speculation()
            masks_later = self._masks_later()
            finished += self._drain_queues()
            if not masks_later:
                finished += self._sync_structured()
            out = self.scheduler.schedule()
            if self.drafter is not None:  # the draft model's proposals, into reserved slots
                self.drafter.fill(out.scheduled)
            staged = None if self.kv_tier is None else self.kv_tier.before_step(
                self.prefix_pool)
            self.stats.record_schedule(out)
            finished += out.ignored
            launched = None
            if out.scheduled:
                plan = self._cascade_plan(out)
                handle = (self.runner.dispatch(out.scheduled, plan, masks_later=True)
                          if masks_later else self.runner.dispatch(
                              out.scheduled, plan, self.structured.bitmasks(out.scheduled)))
                verifies = any(sc.seq.spec_token_ids for sc in out.scheduled) if (
                    self.speculator is not None) else False
                launched = _InFlight(out, handle, t0, time.perf_counter(), verifies)
            if self._async:
                done, self._inflight = self._inflight, launched
            else:
                done = launched
            try:
                if done is not None:
                    finished += self._process(done)
            finally:
                if masks_later and launched is not None:  # (its masks need done's tokens)
                    self.runner.sample(launched.handle, self.structured.bitmasks(out.scheduled))
                if self.kv_tier is not None:  # host-tier loads whose copies are done
                    self.kv_tier.after_step(staged, idle=launched is None)
            if (self._inflight is not None and not self._pending
                    and not self.scheduler.has_unfinished()):
                # every sequence of the step in flight has already finished (a stop seen
                # one step late): retire it now, so an idle engine holds no step
                self._process(self._inflight)
                self._inflight = None
            if not self.scheduler.running:
                self.cascade_planner.forget()  # nothing decodes: hold no finished sequence
            if self.kv_events is not None:
                self.kv_events.flush()
            return self._collect(finished)

    def _masks_later(self) -> bool:
        """Whether the next step's grammar masks wait for the step in flight (it samples
        a structured request's token, which the request's next mask needs): the runner
        then runs the next step's model while the host processes the step in flight and
        fills the masks, and samples once they are there (`ModelRunner.sample`)."""
        return (self._inflight is not None and self._async
                and getattr(self.runner, "can_mask_later", False)
                and self.structured.needs_sync())

    def _sync_speculation(self) -> list[Sequence]:
        """Processes the step in flight before the next is scheduled when it verifies
        proposals (its rows' next positions depend on how many are accepted), when a
        sequence would propose (`Speculator.probe`: one with a token in flight proposes
        nothing) and while a request `pins_sync`; other steps stay overlapped."""
        if self._inflight is None or not (self._inflight.verifies or self._spec_hot
                                          or self._pinned):
            return []
        done, self._inflight = self._inflight, None
        return self._process(done)

    def _sync_structured(self) -> list[Sequence]:
        """(A runner that cannot sample later: a multi-process run.) Processes the step in
        flight before the next is scheduled when a structured request's mask needs it."""
        if self._inflight is None or not self.structured.needs_sync():
            return []
        done, self._inflight = self._inflight, None
        return self._process(done)

    def _cascade_plan(self, out: SchedulerOutput) -> CascadePlan | None:
        """The step's cascade grouping, when cascade attention is on (read every step)."""
        # (a sequence freeing its blocks outside its window breaks the plans' shared
        # prefixes; windowed layers do not share them anyway: `cascade_attention`)
        if not (self.args.enable_cascade and self.args.enable_prefix_caching) or (
                self.scheduler.sliding_window is not None):
            self.cascade_planner.forget()
            return None
        return self.cascade_planner.plan(out.scheduled)

    def _process(self, done: _InFlight) -> list[Sequence]:
        """Fetches a dispatched step's tokens and applies them; returns who finished."""
        tokens = self.runner.fetch(done.handle)
        t_fetched = time.perf_counter()
        tokens = tokens.tolist()
        if self.speculator is not None and (verified := fetch_verified(
                done.handle, self.speculator.k)) is not None:
            tokens, extra = apply_verified(done.out.scheduled, tokens, verified, self.stats.spec)
            self.stats.generation_tokens += extra
        finished = self.scheduler.update(done.out, tokens)
        if self.speculator is not None and self._async:
            self._spec_hot = self.speculator.probe(sc.seq for sc in done.out.scheduled
                                                   if sc.sample)
        positions = getattr(done.handle, "prompt_positions", None)
        if positions is not None:  # (an extra step: logits processing or logprobs)
            self.outputs.attach_logprobs(done.out.scheduled,
                                         self.runner.fetch_logprobs(done.handle), positions)
        for seq in self.structured.accept(done.out.scheduled, tokens):  # grammar complete
            self.scheduler.finish(seq, self.structured.finish_reason(seq))
            finished.append(seq)
        finished += self.outputs.check_stop_strings(self.scheduler.finish)
        self.stats.record_tokens(done.out)
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
            seq, prompt = self._pending.popleft()
            self._live[seq.request_id] = seq
            if self.speculator is not None and pins_sync(seq):
                self._pinned.add(seq.request_id)
            self.num_requests += 1
            self.scheduler.add(seq)
            self.outputs.add(seq, prompt)
            self.structured.admit(seq)
        aborted = []
        while self._aborts:
            seq = self._live.get(self._aborts.popleft())
            if seq is not None and self.scheduler.abort(seq.request_id):
                aborted.append(seq)
        return aborted

    def counters(self) -> dict[str, Any]:
        """`stats.engine_counters`; safe to read from another thread while it steps."""
        unfinished = list(self._live.values()) + [q[0] for q in list(self._pending)]
        return engine_counters(self.num_requests, unfinished, self.scheduler, self.kv_tier)

    def _collect(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The step's outputs: streamed requests' progress, then the finished ones'."""
        for seq in finished:
            self._live.pop(seq.request_id, None)
            self._pinned.discard(seq.request_id)
        self.structured.forget(finished)
        self.stats.record_finished(finished)
        return self.outputs.deltas() + self.outputs.outputs(finished)
