"""Data parallelism: N engine replicas on disjoint device groups behind one front.

`DataParallelEngine` has the surface `LLM` and the async driver use of an `LLMEngine`
(`EngineFront`'s `make_request`, `add`, `abort_request`, and `step`,
`has_unfinished_requests`):
it owns the request ids (one input processor makes every sequence), routes each request
to a replica (`jprefix.core.routing.Router`: prefix affinity read from the replicas'
tries, least loaded on ties and misses, the imbalance bound), forwards aborts to the
replica holding the request, and steps every replica with work in turn from the caller's
thread. Each replica is a whole LLMEngine (scheduler, prefix cache, runner) on
`tensor_parallel_size` devices of its own; with async scheduling a replica's next step is
on its devices while the others' host work runs, so the devices overlap.

One process drives all replicas (docs/ARCHITECTURE.md, "Data parallelism", says why and
how replicas on other hosts fit): the router needs of a replica only a `CacheView` of its
trie and its load, and of the rest the engine surface above.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

from jprefix.core.outputs import RequestOutput
from jprefix.core.prefix_cache import Prefix, PrefixCacheStats
from jprefix.core.routing import Router, TrieView
from jprefix.core.sequence import Sequence
from jprefix.engine.args import EngineArgs
from jprefix.engine.front import EngineFront
from jprefix.engine.kv_events import with_rank
from jprefix.engine.kv_tier import host_summary
from jprefix.engine.llm_engine import LLMEngine
from jprefix.engine.stats import CACHE_COUNTERS, EngineStats, summarize_stats
from jprefix.worker.parallel import device_groups


class _StepStats:
    """Every replica's `step_stats` as one sequence (benchmarks clear and read them)."""

    def __init__(self, replicas: list[LLMEngine]):
        self._replicas = replicas

    def __iter__(self):
        return itertools.chain.from_iterable(r.step_stats for r in self._replicas)

    def __len__(self) -> int:
        return sum(len(r.step_stats) for r in self._replicas)

    def clear(self) -> None:
        for r in self._replicas:
            r.step_stats.clear()


class ReplicaPools:
    """`PrefixPool`'s user surface over every replica's pool: a prefix registered, pinned
    or deleted is so on every replica (pinning holds the blocks a replica has cached);
    stats are summed; `reset` resets every replica whose blocks are all free and says
    whether all were."""

    def __init__(self, replicas: list[LLMEngine]):
        self.pools = [r.scheduler.prefix_pool for r in replicas]

    def add_or_get_prefix(self, token_ids: Any, prefix_len: int | None = None,
                          salt: str | None = None, pin: bool = False) -> Prefix:
        return [p.add_or_get_prefix(token_ids, prefix_len, salt, pin) for p in self.pools][0]

    def get_prefix(self, prefix_hash: int) -> Prefix | None:
        return self.pools[0].get_prefix(prefix_hash)

    def pin(self, prefix_hash: int) -> int:
        return sum(p.pin(prefix_hash) for p in self.pools)

    def unpin(self, prefix_hash: int) -> None:
        for p in self.pools:
            p.unpin(prefix_hash)

    def delete_prefix(self, prefix_hash: int) -> int:
        """Deletes it wherever it is registered or cached; ValueError if nowhere."""
        freed, found = 0, False
        for p in self.pools:
            if p.get_prefix(prefix_hash) is not None or p.trie.find(prefix_hash) is not None:
                freed += p.delete_prefix(prefix_hash)
                found = True
        if not found:
            raise ValueError(f"prefix_hash {prefix_hash} is neither registered nor cached "
                             "on any replica")
        return freed

    def reset(self) -> bool:
        return all([p.reset() for p in self.pools])  # (a list: every pool tries)

    def stats(self) -> PrefixCacheStats:
        each = [p.stats() for p in self.pools]
        return PrefixCacheStats(*(sum(getattr(s, k) for s in each) for k in CACHE_COUNTERS))


class DataParallelEngine(EngineFront):
    """`args.data_parallel_size` LLMEngines, each on its own `tensor_parallel_size`
    devices, behind one front that routes, aborts and steps them (its request surface is
    `EngineFront`'s, as a single engine's)."""

    def __init__(self, model: Any, args: EngineArgs, devices: list[Any] | None = None,
                 replicas: list[LLMEngine] | None = None):
        """`model`: a LoadedModel (each replica places a copy of its weights on its own
        devices) or a name (each replica loads it onto its devices); `devices`: the
        devices to split into groups (default: all of this process's). `replicas`:
        engines built elsewhere to front instead (`model` and `devices` unused; host
        benchmarks front engines over stub runners)."""
        self.args = args
        if replicas is None:
            self.device_groups = device_groups(args.data_parallel_size,
                                               args.tensor_parallel_size, devices)
            replicas = [LLMEngine(model, dataclasses.replace(  # (own events port each)
                args, kv_events_config=with_rank(args.kv_events_config, i)), devices=g)
                for i, g in enumerate(self.device_groups)]
        else:
            self.device_groups = [[] for _ in replicas]
        self.replicas = replicas
        # requests are validated against the smallest context any replica's cache holds
        front = min(self.replicas, key=lambda r: r.max_model_len)
        self.model, self.inputs, self.max_model_len = front.model, front.inputs, front.max_model_len
        self.router = Router([TrieView(r.scheduler.prefix_pool.trie, r.scheduler.prefix_pool.host)
                              for r in self.replicas],
                             args.block_size, args.routing_policy)
        # one set of grammar matchers for all replicas: a structured request is validated
        # (its grammar compiled) before it is routed, and the matchers are keyed by
        # sequence, so any replica's steps find theirs; each replica's view tracks its
        # own sequences, so one waits only for its own structured tokens in flight
        self.structured = self.replicas[0].structured
        for replica in self.replicas[1:]:
            replica.structured = self.structured.replica_view()
        self.prefix_pool = ReplicaPools(self.replicas)
        self.step_stats = _StepStats(self.replicas)
        self._lock = threading.Lock()  # the router (add, abort and step run on any thread)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def _queue(self, seq: Sequence, prompt: str | None = None) -> int:
        """Routes a validated sequence to a replica and queues it there; returns the
        replica. ValueError if its request id is in flight already."""
        with self._lock:
            replica = self.router.route(seq.request_id, seq.all_token_ids,
                                        self._shareable_blocks(seq), seq.cache_salt,
                                        self._loads())
        try:
            self.replicas[replica]._queue(seq, prompt)
        except BaseException:
            with self._lock:  # (not queued: no step would ever forget its route)
                self.router.finish(seq.request_id)
            raise
        return replica

    def replica_of(self, request_id: str) -> int | None:
        """The replica an unfinished request runs on (None: unknown or finished)."""
        with self._lock:
            return self.router.replica_of(request_id)

    def abort_request(self, request_id: str) -> None:
        """Aborts a request on its replica at that replica's next step."""
        replica = self.replica_of(request_id)
        if replica is not None:
            self.replicas[replica].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued, running or routed: `step` forgets a route
        just after its replica finishes the request, and until then the request still
        counts, so that once this is False `replica_of` is None for every request."""
        if any(r.has_unfinished_requests() for r in self.replicas):
            return True
        with self._lock:
            return self.router.num_in_flight > 0

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work; their outputs (the requests they
        finished, and DELTA / CUMULATIVE requests' progress)."""
        outputs = []
        for replica in self.replicas:
            if not replica.has_unfinished_requests():
                continue
            done = replica.step()
            if done:
                with self._lock:
                    for out in done:
                        if out.finished:  # (a DELTA request's progress keeps its route)
                            self.router.finish(out.request_id)
                outputs += done
        return outputs

    @property
    def stats(self) -> EngineStats:
        """The replicas' token, request and latency counters together (/metrics)."""
        return EngineStats.merged([r.stats for r in self.replicas])

    @property
    def scheduler(self) -> Any:
        raise ValueError(f"data_parallel_size {len(self.replicas)}: each replica has its "
                         "own scheduler (engine.replicas[i].scheduler)")

    def summary(self) -> dict[str, Any]:
        """/stats' body (`counters`)."""
        return self.counters()

    def counters(self) -> dict[str, Any]:
        """`summarize_stats` of the replicas: each replica's engine counters, its devices
        and the router's (requests routed, of which by prefix affinity)."""
        reps = [r.counters() for r in self.replicas]
        with self._lock:
            counters = [(c.requests, c.affinity) for c in self.router.counters]
        for i, (s, (routed, affinity)) in enumerate(zip(reps, counters, strict=True)):
            s.update(replica=i, devices=[str(d) for d in self.device_groups[i]],
                     requests=routed, affinity_requests=affinity)
        return summarize_stats(reps, data_parallel_size=len(self.replicas),
                               routing_policy=self.args.routing_policy, **host_summary(reps))

    def save_prefix_cache(self, path: str) -> int:
        raise ValueError(f"data_parallel_size {len(self.replicas)}: each replica has its own "
                         "prefix cache (engine.replicas[i].save_prefix_cache(path))")

    def _shareable_blocks(self, seq: Sequence) -> int:
        """The leading blocks the replica's scheduler will match and cache for seq."""
        if not self.args.enable_prefix_caching:
            return 0
        return seq.num_shareable_blocks(self.args.block_size)

    def _loads(self) -> list[int]:
        """Per replica: the prompt tokens of its unfinished requests plus the output
        tokens of its running ones (`LLMEngine.stats`' queued_tokens, kept incrementally
        for the prompts)."""
        return [c.prompt_tokens + sum(s.num_output_tokens
                                      for s in list(r.scheduler.running.values()))
                for c, r in zip(self.router.counters, self.replicas, strict=True)]
