"""Multi-host serving over JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same program: it joins the others (`initialize`), builds the same
global mesh over all processes' devices, loads its shards of the weights and the KV
cache, and runs the same jitted step. Process 0 (the leader) alone schedules: before each
step it broadcasts the step's packed host inputs (`StepChannel.send`: a fixed-size header,
then one int32 payload holding the flat batch, its layout and any token bitmask) to the
others, which run the step from them (`follow`) in the same order. A step's tokens are
replicated on every device, so the leader reads them from its own.

Failure: a process that dies breaks the next collective (gloo / NCCL report the lost
peer) or, when all are idle, stops sending heartbeats (JAX's coordination service stops
every process after `timeout_s`). A failed collective on any process is fatal to the run:
`fatal` prints why and ends the process at once (no shutdown barrier to wait on).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_started: list[Any] = []  # the run's one runner (a follower builds one and exits)
# op, flat size, layout bytes, bitmask rows, bitmask words, decode, greedy, cascade, extra
_HEADER = 9
_STOP, _STEP = 0, 1


def requested(coordinator_address: str | None, num_processes: int | None,
              process_id: int | None) -> bool:
    """Whether these settings (or JAX's own JAX_COORDINATOR_ADDRESS) ask for a
    multi-process run."""
    return bool(coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
                or (num_processes or 1) > 1 or process_id is not None)


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None, timeout_s: int) -> bool:
    """Joins this process to the others through `jax.distributed.initialize` (values left
    None are JAX's to find: JAX_COORDINATOR_ADDRESS, or a cluster it detects, e.g.
    SLURM) and returns True; False where nothing asks for more than one process. Must run
    before jax touches a device. CPU processes reduce over gloo. Joining waits at most
    `timeout_s` for all processes (RuntimeError naming the coordinator after that), and
    a process silent for `timeout_s` later stops the run."""
    if not requested(coordinator_address, num_processes, process_id):
        return False
    if _started:
        raise ValueError("a multi-process run has one engine per process; this process "
                         "built one already (the other processes follow only that one)")
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    who = f"process {process_id} of {num_processes}"
    if address and process_id:  # (JAX's client aborts the process where none answers)
        _wait_for_coordinator(address, timeout_s, who)
    # JAX ends the process itself (a fatal log) when the others do not all join in time:
    # this line says what it was waiting for
    print(f"jprefix multi-host: {who} joining the run at coordinator {address} (waiting "
          f"up to {timeout_s} s for every process)", file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(
            coordinator_address, num_processes, process_id,
            initialization_timeout=timeout_s, heartbeat_timeout_seconds=timeout_s)
    except Exception as exc:  # (jax raises RuntimeError / XlaRuntimeError / ValueError)
        raise RuntimeError(
            f"{who} could not join the run at coordinator {address} within {timeout_s} s "
            f"(every process must start, with the same coordinator address and process "
            f"count, before jax touches a device): {exc}"
        ) from exc
    return jax.process_count() > 1


def _wait_for_coordinator(address: str, timeout_s: int, who: str) -> None:
    """Waits until process 0's coordinator accepts TCP connections at `address`
    ("host:port"); RuntimeError after `timeout_s`."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{who} could not join the run at coordinator {address} within "
                    f"{timeout_s} s: nothing accepts connections there ({exc}); start "
                    f"process 0 with the same --coordinator-address") from exc
            time.sleep(0.2)


def check_mesh(mesh: Mesh | None) -> None:
    """ValueError unless `mesh` spans every device of every process (a multi-process step
    runs on all of them: tensor_parallel_size = jax.device_count())."""
    n = jax.device_count()
    if mesh is None or mesh.size != n:
        tp = 1 if mesh is None else mesh.size
        raise ValueError(f"tensor_parallel_size {tp}: a run over {jax.process_count()} "
                         f"processes shards over all their {n} devices "
                         f"(tensor_parallel_size {n})")


def smallest(n: int) -> int:
    """The smallest of every process's `n` (each process calls it at the same point)."""
    return int(np.min(multihost_utils.process_allgather(np.array([n], np.int64))))


def fatal(exc: BaseException, what: str) -> None:
    """Ends this process at once after a failed multi-process collective (the others'
    state can no longer match), saying why on stderr."""
    print(f"jprefix multi-host: process {jax.process_index()} of {jax.process_count()}: "
          f"{what} failed, so the run stops (another process most likely died or was "
          f"killed; see its log): {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    os._exit(1)


class StepChannel:
    """The leader's steps to the other processes, through `broadcast_one_to_all` (a psum
    over every device: every process calls it in the same order)."""

    def __init__(self, mesh: Mesh):
        self.leader = jax.process_index() == 0
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.stopped = False

    def global_array(self, x: np.ndarray) -> jax.Array:
        """A host array the same on every process as one replicated global array."""
        return jax.make_array_from_process_local_data(self.replicated, x)

    def send(self, flat: np.ndarray, layout: Any, bitmask: np.ndarray | None,
             decode: bool, greedy: bool, cascade: bool, extra: bool) -> None:
        """(Leader) broadcasts one step's inputs."""
        code = np.frombuffer(json.dumps(layout).encode(), np.uint8)
        code = np.pad(code, (0, -code.size % 4)).view(np.int32)
        words = np.zeros(0, np.int32) if bitmask is None else bitmask.astype(np.int32).ravel()
        rows, cols = (0, 0) if bitmask is None else bitmask.shape
        payload = np.concatenate([flat.astype(np.int32, copy=False), code, words])
        payload = np.pad(payload, (0, _padded(payload.size) - payload.size))
        header = np.array([_STEP, flat.size, code.size, rows, cols, decode, greedy, cascade,
                           extra], np.int32)
        multihost_utils.broadcast_one_to_all(header)
        multihost_utils.broadcast_one_to_all(payload)

    def stop(self) -> None:
        """(Leader) tells the others that no step follows; once only."""
        if not self.stopped:
            self.stopped = True
            multihost_utils.broadcast_one_to_all(np.full(_HEADER, _STOP, np.int32))

    def receive(self) -> tuple | None:
        """(Follower) the next step's (flat, layout, bitmask, decode, greedy, cascade,
        extra); None once the leader stops."""
        header = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32)))
        op, n_flat, n_code, rows, cols, decode, greedy, cascade, extra = (int(v) for v in header)
        if op == _STOP:
            return None
        size = _padded(n_flat + n_code + rows * cols)
        payload = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(size, np.int32)))
        flat = payload[:n_flat].copy()
        code = payload[n_flat:n_flat + n_code].view(np.uint8).tobytes().rstrip(b"\0")
        layout = tuple((name, tuple(shape), dtype) for name, shape, dtype in json.loads(code))
        bitmask = (payload[n_flat + n_code:n_flat + n_code + rows * cols].reshape(rows, cols)
                   if rows else None)
        return flat, layout, bitmask, bool(decode), bool(greedy), bool(cascade), bool(extra)


def _padded(n: int) -> int:
    """Payload sizes rounded up to a power of two (>= 1024), so the broadcast compiles
    for few shapes."""
    return max(1024, 1 << (n - 1).bit_length())


def start(runner: Any) -> None:
    """After every process built its runner: on process 0, `runner.stop_followers` at
    exit; elsewhere `follow` until process 0 stops, then SystemExit(0). One engine per
    multi-process run (the others follow only the first: `initialize` refuses a second)."""
    _started.append(runner)
    if jax.process_index() == 0:
        atexit.register(runner.stop_followers)
        return
    follow(runner)
    raise SystemExit(0)


def follow(runner: Any) -> None:
    """(Follower) runs the leader's steps until it stops (`ModelRunner.run_step`); a
    failed step or broadcast ends the process (`fatal`)."""
    try:
        while (message := runner.channel.receive()) is not None:
            runner.run_step(*message)
    except Exception as exc:
        fatal(exc, "following process 0's steps")
