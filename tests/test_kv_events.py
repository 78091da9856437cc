"""KV cache events (`kv_events_config`, vLLM's format): a subscriber replaying the events
arrives at exactly the blocks each tier holds, and at the engine's counts of blocks
stored and removed per tier; over ZMQ as vLLM publishes them (where pyzmq is installed);
bad configs are refused naming the problem."""

import json
import socket
import time

import numpy as np
import pytest

from jprefix import LLM, SamplingParams
from jprefix.core.kv_events import as_array
from jprefix.engine.args import EngineArgs

BS = 8
SP = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def replay(events: list[list]) -> tuple[dict[str, set], dict[str, int], dict[str, int]]:
    """Blocks held per medium after the events (wire form), and stored / removed counts."""
    held: dict[str, set] = {"GPU": set(), "CPU": set()}
    stored = {"GPU": 0, "CPU": 0}
    removed = {"GPU": 0, "CPU": 0}
    for e in events:
        if e[0] == "BlockStored":
            held[e[6]].update(e[1])
            stored[e[6]] += len(e[1])
        elif e[0] == "BlockRemoved":
            assert set(e[1]) <= held[e[2]], "removed a block never stored"
            held[e[2]].difference_update(e[1])
            removed[e[2]] += len(e[1])
        else:
            assert e == ["AllBlocksCleared"]
            held = {"GPU": set(), "CPU": set()}
    return held, stored, removed


def workload(llm: LLM) -> None:
    rng = np.random.default_rng(5)
    histories = [rng.integers(3, 200, 4 * BS + 2).tolist() for _ in range(5)]
    for _ in range(2):
        for h in histories:
            llm.generate([h], SP, use_tqdm=False)


def check_against_engine(engine, held, stored, removed) -> None:
    pool, host = engine.prefix_pool, engine.kv_tier.pool
    assert held["GPU"] == {n.prefix_hash for n in pool.trie.nodes()}
    assert held["CPU"] == {node.prefix_hash for _, _, node in host.entries()}
    sink = engine.kv_events.sink
    assert stored == {m: sink.stored[m] for m in stored}
    assert removed == {m: sink.removed[m] for m in removed}
    assert stored["CPU"] == host.num_stored_blocks > 0
    assert removed["GPU"] > 0 and removed["CPU"] == host.num_dropped_blocks


def test_replayed_events_equal_both_tiers(sharp_tiny):
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "null"})
    llm = LLM(sharp_tiny, block_size=BS, num_kv_blocks=14, attention_backend="xla",
              kv_offloading_size=0.0001, kv_events_config=cfg)
    engine, seen = llm.engine, []
    sink = engine.kv_events.sink
    engine.kv_events.flush = lambda: seen.extend(as_array(e) for e in sink.drain())
    workload(llm)
    held, stored, removed = replay(seen)
    check_against_engine(engine, held, stored, removed)
    assert llm.reset_prefix_cache()
    engine.step()
    held, _, _ = replay(seen)
    assert held == {"GPU": set(), "CPU": set()} and seen[-1] == ["AllBlocksCleared"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_zmq_subscriber_sees_the_blocks_the_engine_reports(sharp_tiny):
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    port = _free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"})
    llm = LLM(sharp_tiny, block_size=BS, num_kv_blocks=14, attention_backend="xla",
              kv_offloading_size=0.0001, kv_events_config=cfg)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.5)  # (PUB/SUB: a subscriber sees only what is sent after it joined)
    try:
        workload(llm)
        events, seqs = [], []
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big"))
            ts, batch, rank = msgspec.msgpack.decode(payload)
            assert rank == 0 and ts > 0
            events += batch
        assert seqs == list(range(1, len(seqs) + 1))  # none lost
        assert len(seqs) == llm.engine.kv_events.num_batches
        check_against_engine(llm.engine, *replay(events))
    finally:
        sub.close(linger=0)
        ctx.term()
        llm.engine.kv_events.close()


@pytest.mark.parametrize("spec,match", [
    ("{not json", "not JSON"), ('["x"]', "not a JSON object"),
    ('{"enable_kv_cache_events": true, "bogus": 1}', "unknown keys"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "kafka"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:1"}', "replay_endpoint")])
def test_bad_kv_events_configs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(kv_events_config=spec)
