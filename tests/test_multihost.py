"""Multi-host on one machine: 2 processes x 2 CPU devices joined through jax.distributed
(gloo collectives, coordinator on 127.0.0.1), TP 4 across both; process 0 schedules and
broadcasts each step's inputs, process 1 follows. Greedy tokens equal one process's at
TP 1; a killed process makes the other exit with a clear error within a bounded time.

Every process is a subprocess (the device count and the distributed runtime are fixed
when jax starts), each bounded by a timeout.
"""

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from subprocess_checks import device_env

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 20  # jax.distributed's join and heartbeat timeout when a process is killed
# ... and when none is: three processes compiling on a 2-core CI machine can starve a
# heartbeat for longer than TIMEOUT_S, which the coordination service takes for a crash
HEALTHY_TIMEOUT_S = 120

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    from jprefix import LLM, SamplingParams
    mode, pid, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    multi = {} if mode == "single" else dict(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
        distributed_timeout_s=int(sys.argv[5]))
    # a cache sized per process (here: the CPU fallback, 64 or 80 blocks) is one global
    # cache of the smallest size
    blocks = dict(num_kv_blocks=64) if mode == "single" else dict(cpu_num_kv_blocks=64 + 16 * pid)
    llm = LLM("tiny-llama3", tensor_parallel_size=1 if mode == "single" else 4,
              dtype="float32", load_format="dummy", block_size=8, max_model_len=256, **blocks,
              attention_backend="xla", unroll_layers=True, cascade_min_group=2,
              cascade_min_blocks=1, max_num_batched_tokens=24, **multi)
    assert pid == 0, "only process 0 returns from LLM(...)"
    assert llm.engine.runner.num_blocks == 64, llm.engine.runner.num_blocks
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 200, 24).tolist()
    prompts = [shared + rng.integers(3, 200, n).tolist() for n in (3, 9, 17)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts[:1], sp, prefix_pos=24, use_tqdm=False)
    tokens = [o.token_ids for o in llm.generate(prompts, sp, prefix_pos=24, use_tqdm=False)]
    seen = llm.engine.runner.shapes_seen
    assert any(s[4] for s in seen) and any(s[5] for s in seen), seen  # cascade, mixed
    out.write_text(json.dumps(tokens))
    if mode == "multi":  # process 1 follows this engine only: a second one is refused
        try:
            LLM("tiny-llama3", tensor_parallel_size=4, load_format="dummy", **multi)
        except ValueError as e:
            assert "one engine per process" in str(e), e
        else:
            raise AssertionError("a second engine in a multi-process run was accepted")
    while mode == "kill":  # keeps stepping until the other process is killed
        llm.generate(prompts, sp, use_tqdm=False)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(mode: str, pid: int, port: int, out: Path, timeout_s: int = TIMEOUT_S
           ) -> subprocess.Popen:
    env = device_env(2)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(pid), str(port),
                             str(out), str(timeout_s)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"process did not exit within {timeout} s: {err[-3000:]}"
                             ) from None
    return proc.returncode, err


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_two_processes_tp4_match_one_process_tp1(tmp_path):
    port = _free_port()
    procs = [_start("multi", pid, port, tmp_path / f"multi{pid}.json", HEALTHY_TIMEOUT_S)
             for pid in (0, 1)]
    single = _start("single", 0, port, tmp_path / "single.json")
    try:
        for name, proc in (("process 0", procs[0]), ("process 1", procs[1]),
                           ("single", single)):
            rc, err = _finish(proc, 300)
            assert rc == 0, f"{name}: rc {rc}: {err[-4000:]}"
    finally:
        _kill(procs + [single])
    got = json.loads((tmp_path / "multi0.json").read_text())
    want = json.loads((tmp_path / "single.json").read_text())
    assert got == want and len(got) == 3 and all(len(t) == 6 for t in got), (got, want)
    assert not (tmp_path / "multi1.json").exists()  # process 1 only followed


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_process_makes_the_other_exit_with_a_clear_error(tmp_path, victim):
    port = _free_port()
    procs = [_start("kill", pid, port, tmp_path / f"kill{pid}.json") for pid in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "kill0.json").exists():  # both run steps by now
            assert time.monotonic() < deadline, "the run never got going"
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
            time.sleep(0.2)
        procs[victim].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc, err = _finish(procs[1 - victim], 6 * TIMEOUT_S)
        waited = time.monotonic() - t0
    finally:
        _kill(procs)
    assert rc != 0 and waited < 6 * TIMEOUT_S
    survivor = 1 - victim
    clear = (f"jprefix multi-host: process {survivor} of 2:" in err
             or "another task died" in err)
    assert clear, err[-4000:]


def test_a_process_that_cannot_join_raises_naming_the_coordinator(tmp_path):
    """Process 1 of 2 alone: no coordinator answers at the address, so it gives up after
    the join timeout with a RuntimeError naming it; process 0 alone (its coordinator up,
    nobody joining) is ended by JAX after the timeout, its log saying what it waited for.
    Neither hangs."""
    port = _free_port()
    script = textwrap.dedent(f"""
        from jprefix import LLM
        try:
            LLM("tiny-llama3", tensor_parallel_size=4, dtype="float32", load_format="dummy",
                coordinator_address="127.0.0.1:{port}", num_processes=2, process_id=1,
                distributed_timeout_s=3)
        except RuntimeError as e:
            print("REFUSED", e)
    """)
    env = device_env(2)
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert f"REFUSED process 1 of 2 could not join the run at coordinator 127.0.0.1:{port} " \
           f"within 3 s" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]
    alone = subprocess.run([sys.executable, "-c", script.replace("process_id=1", "process_id=0")],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert alone.returncode != 0, alone.stdout[-2000:]
    assert f"process 0 of 2 joining the run at coordinator 127.0.0.1:{port} (waiting up to 3 s" \
        in alone.stderr, alone.stderr[-3000:]


def test_multi_host_flags_reach_the_engine_args_and_bad_values_raise():
    from jprefix.engine.args import EngineArgs
    from jprefix.entrypoints import cli
    from jprefix.entrypoints.cli_args import engine_kwargs

    args = cli._build_parser().parse_args([
        "serve", "--coordinator-address", "10.0.0.1:1234", "--num-processes", "2",
        "--process-id", "1", "--distributed-timeout-s", "30", "--tensor-parallel-size", "16"])
    kw = engine_kwargs(args)
    assert (kw["coordinator_address"], kw["num_processes"], kw["process_id"],
            kw["distributed_timeout_s"]) == ("10.0.0.1:1234", 2, 1, 30)
    EngineArgs(**kw)
    for bad, why in ((dict(num_processes=2, process_id=2), "process_id 2 is outside"),
                     (dict(num_processes=0), "num_processes must be >= 1"),
                     (dict(distributed_timeout_s=0), "distributed_timeout_s must be >= 1")):
        with pytest.raises(ValueError, match=why):
            EngineArgs(**bad)
