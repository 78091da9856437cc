"""LLMEngine: schedule -> run -> postprocess, steppable from any loop or thread.

Requests are validated and tokenized in `add_request` (errors raise before anything is
scheduled) and queued; `step()` drains the queue into the scheduler, so another thread or
an event loop may add and abort requests between steps.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any

import numpy as np

from jprefix.core.block_manager import BlockManager
from jprefix.core.cascade import CascadePlan, plan_cascade
from jprefix.core.config import SchedulerConfig
from jprefix.core.outputs import RequestOutput
from jprefix.core.prefix_cache import PrefixPool
from jprefix.core.sampling_params import SamplingParams
from jprefix.core.scheduler import Scheduler
from jprefix.core.sequence import Sequence
from jprefix.engine.args import EngineArgs
from jprefix.engine.detokenizer import IncrementalDetokenizer
from jprefix.engine.input_processor import (
    check_context,
    check_prefix_len,
    check_token_ids,
    is_token_list,
)
from jprefix.worker.model_runner import ModelRunner
from jprefix.worker.pack import BucketConfig
from jprefix.worker.parallel import make_mesh


@dataclasses.dataclass
class _InFlight:
    out: Any  # SchedulerOutput
    handle: Any  # runner.StepHandle
    t_start: float
    t_dispatched: float


class LLMEngine:
    """Owns the scheduler (host) and the model runner (device)."""

    def __init__(self, model: Any, args: EngineArgs | None = None, runner: Any = None):
        """`model.params` in any layout `prepare_params` takes; the runner
        keeps the step's layout (per-layer, fused on one device) beside them unless they
        are in it already (`LLM` prepares the weights it loads itself, so there is one
        copy). `runner`: a ModelRunner-like object to use instead of building one
        (benchmarks of the host side run the engine over a stub)."""
        self.model, self.args = model, args or EngineArgs()
        cfg = model.config
        self.max_model_len = min(self.args.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        if runner is None:
            mesh = make_mesh(cfg, self.args.tensor_parallel_size)
            runner = ModelRunner(
                model.params, cfg, self.args.num_kv_blocks, self.args.block_size,
                model.params.embed.dtype, backend=self.args.attention_backend,
                buckets=BucketConfig(min_seqs=8), unroll_layers=self.args.unroll_layers,
                memory_fraction=self.args.gpu_memory_utilization,
                cpu_num_blocks=self.args.cpu_num_kv_blocks, mesh=mesh,
                max_num_seqs=self.args.max_num_seqs, fixed_inputs=self.args.fixed_inputs,
            )
        self.runner = runner
        self.scheduler = self._make_scheduler(self.runner.num_blocks)
        self._pending: collections.deque = collections.deque()
        self._aborts: collections.deque = collections.deque()
        self._live: dict[str, Sequence] = {}  # requests in the scheduler, by id
        # those of them with stop strings, in arrival order (a dict used as a set)
        self._stop_watched: dict[Sequence, None] = {}
        # (num_seqs, num_tokens, host_s, step_s, device_wait_s) of recent steps
        self.step_stats: collections.deque = collections.deque(maxlen=100_000)
        self._step_lock = threading.Lock()
        self._inflight: _InFlight | None = None  # dispatched, tokens not yet processed
        self._last_processed = 0.0
        self._last_plan: tuple[tuple[Sequence, ...], CascadePlan] | None = None  # _cascade_plan
        self._rng = np.random.default_rng(self.args.seed)
        self._ids = itertools.count()

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

    def tokenize(self, prompt: Any) -> list[int]:
        if is_token_list(prompt):
            return check_token_ids(prompt, self.model.config.vocab_size)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {prompt!r} must be a string or a list of token ids")
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if self.tokenizer is None:
            raise ValueError(f"model {self.model.name!r} has no tokenizer: pass token ids")
        return self.tokenizer(prompt, add_special_tokens=True).input_ids

    def make_sequence(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        prefix_len: int | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Validates one request and builds its Sequence (nothing is scheduled yet). The
        sequence keeps its own copy of the sampling parameters: changing the caller's
        object afterwards does not reach a request already made."""
        # (replace re-runs __post_init__: copies the stop lists and validates)
        sp = dataclasses.replace(sampling_params) if sampling_params else SamplingParams()
        ids = self.tokenize(prompt)
        check_context(len(ids), sp.max_tokens, self.max_model_len)
        prefix_len = check_prefix_len(prefix_len, len(ids))
        if request_id is None:
            request_id = f"jprefix-{next(self._ids)}"  # itertools.count: thread-safe
        # the device's sampling stream takes a 32-bit seed: larger seeds are folded
        seed = sp.seed % 2**32 if sp.seed is not None else int(self._rng.integers(2**31))
        return Sequence(request_id, ids, sp, prefix_len=prefix_len, cache_salt=cache_salt,
                        seed=seed, prompt=prompt if isinstance(prompt, str) else None)

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
                handle = self.runner.dispatch(out.scheduled, self._cascade_plan(out.scheduled))
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
                self._last_plan = None  # nothing decodes: hold no finished sequence
            return self._collect(finished)

    def _process(self, done: _InFlight) -> list[Sequence]:
        """Fetches a dispatched step's tokens and applies them; returns who finished."""
        tokens = self.runner.fetch(done.handle)
        t_fetched = time.perf_counter()
        finished = self.scheduler.update(done.out, tokens.tolist())
        finished += self._check_stop_strings()
        self._record(done, t_fetched)
        return finished

    def _cascade_plan(self, scheduled) -> CascadePlan | None:
        """The step's cascade grouping. A decode step of the same sequences, in the same
        order, as the last planned one reuses its plan. A sequence's table is replaced
        only when it is preempted (or finishes), which takes it out of the running list;
        otherwise it only grows, so each member still holds its group's prefix blocks.
        Sharing changes only when sequences join or leave, which changes the list, so a
        reused plan is also as good as a new one."""
        if not (self.args.enable_cascade and self.args.enable_prefix_caching):
            self._last_plan = None  # (holds no finished sequences; settings re-read)
            return None
        seqs, _, num_new, _ = zip(*scheduled, strict=True)  # (C-level columns)
        last = self._last_plan
        if (last is not None and last[0] == seqs  # (Sequence has identity equality)
                and num_new.count(1) == len(num_new)):
            return last[1]
        plan = plan_cascade(scheduled, self.args.block_size,
                            self.scheduler.block_manager.ref_count,
                            self.args.cascade_min_group, self.args.cascade_min_blocks)
        self._last_plan = None if plan is None else (seqs, plan)
        return plan

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
            if seq.sampling_params.stop:
                self._stop_watched[seq] = None
        aborted = []
        while self._aborts:
            seq = self._live.get(self._aborts.popleft())
            if seq is not None and self.scheduler.abort(seq.request_id):
                aborted.append(seq)
        return aborted

    def _check_stop_strings(self) -> list[Sequence]:
        """Finishes the sequences with stop strings whose output grew (they sampled this
        step) and whose text now contains one; the text grows incrementally (each token
        decoded once, in a short window). Visits only the requests that have stop
        strings, not every row of the step."""
        finished = []
        for seq in self._stop_watched:
            stops = seq.sampling_params.stop
            det = seq.detokenizer
            seen = seq.num_prompt_tokens + (0 if det is None else len(det.ids))
            if len(seq.all_token_ids) == seen or seq.is_finished():
                continue  # (no new token)
            if det is None:
                det = seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
            delta = det.push(seq.all_token_ids[seen:])  # the tokens it has not seen
            if not delta:
                continue
            since = max(0, len(det.text) - len(delta) - max(map(len, stops)) + 1)
            hits = [i for i in (det.text.find(s, since) for s in stops) if i >= 0]
            if hits:
                seq.stop_text = det.text[: min(hits)]
                self.scheduler.finish(seq, "stop")
                finished.append(seq)
        return finished

    def _detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _collect(self, finished: list[Sequence]) -> list[RequestOutput]:
        now = time.monotonic()
        for seq in finished:
            self._live.pop(seq.request_id, None)
            self._stop_watched.pop(seq, None)
        return [self._output(seq, now) for seq in finished]

    def _output(self, seq: Sequence, now: float) -> RequestOutput:
        text = seq.stop_text
        if text is None:
            text = self._detokenize(seq.output_token_ids)
        metrics = {"arrival_time": seq.arrival_time, "finished_time": now}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=metrics,
        )
