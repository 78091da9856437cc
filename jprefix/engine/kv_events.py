"""Publishing KV cache events (`jprefix.core.kv_events`) as vLLM does.

`--kv-events-config` takes vLLM's JSON (`KVEventsConfig`): `enable_kv_cache_events`,
`publisher` ("null": counted, not sent; "zmq"), `endpoint` (default "tcp://*:5557"),
`topic`, `hwm`; vLLM's `replay_endpoint`, `buffer_steps` and `max_queue_size` are
accepted only at their defaults (no replay socket is built). With "zmq" (the optional
pyzmq and msgspec packages) each step's events go out as one `KVEventBatch` on a PUB
socket: the multipart message (topic, sequence number as 8 big-endian bytes, msgpack
payload `[ts, [event, ...], data_parallel_rank]`, each event vLLM's array-like tagged
form). Data-parallel replica i binds the endpoint's port + i, as vLLM does.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from jprefix.core.config import json_object
from jprefix.core.kv_events import KVEventSink, as_array

_DEFAULTS = {"enable_kv_cache_events": False, "publisher": "null",
             "endpoint": "tcp://*:5557", "replay_endpoint": None, "buffer_steps": 10_000,
             "hwm": 100_000, "max_queue_size": 100_000, "topic": "",
             "data_parallel_rank": 0}  # (the last: set per replica by dp_engine)
_UNBUILT = ("replay_endpoint", "buffer_steps", "max_queue_size")


def parse_config(spec: str | None) -> dict[str, Any] | None:
    """The config of a `--kv-events-config` JSON string; None when events are off."""
    if spec is None:
        return None
    raw = json_object("kv_events_config", spec, _DEFAULTS)
    cfg = _DEFAULTS | raw
    if cfg["publisher"] not in ("null", "zmq"):
        raise ValueError(f"kv_events_config publisher {cfg['publisher']!r} is not null or zmq")
    for key in _UNBUILT:
        if cfg[key] != _DEFAULTS[key]:
            raise ValueError(f"kv_events_config {key}={cfg[key]!r} is not supported")
    return cfg if cfg["enable_kv_cache_events"] else None


def with_rank(spec: str | None, rank: int) -> str | None:
    """The config of data-parallel replica `rank`."""
    if spec is None:
        return None
    return json.dumps(json.loads(spec) | {"data_parallel_rank": rank})


def offset_port(endpoint: str, rank: int) -> str:
    match = re.search(r":(\d+)$", endpoint)
    if rank == 0 or match is None:
        return endpoint
    return endpoint[:match.start()] + f":{int(match.group(1)) + rank}"


class KVEventPublisher:
    """Drains the sink after each step and sends the events (or only counts them)."""

    def __init__(self, cfg: dict[str, Any], sink: KVEventSink):
        self.sink, self.rank, self.topic = sink, cfg["data_parallel_rank"], cfg["topic"]
        self.num_batches = self.num_events = 0
        self._sock = None
        if cfg["publisher"] == "zmq":
            try:
                import msgspec
                import zmq
            except ImportError as exc:
                raise ValueError("kv_events_config publisher 'zmq' needs pyzmq and msgspec "
                                 f"(pip install pyzmq msgspec): {exc}") from None
            self._encode = msgspec.msgpack.encode
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.PUB)
            self._sock.set_hwm(cfg["hwm"])
            self._sock.bind(offset_port(cfg["endpoint"], self.rank))

    def flush(self) -> None:
        events = self.sink.drain()
        if not events:
            return
        self.num_batches += 1
        self.num_events += len(events)
        if self._sock is not None:
            batch = [time.time(), [as_array(e) for e in events], self.rank]
            self._sock.send_multipart([self.topic.encode(), self.num_batches.to_bytes(
                8, "big"), self._encode(batch)])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()
            self._sock = None
