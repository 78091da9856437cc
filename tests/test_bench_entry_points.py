"""Every tool in scripts/ and scripts/probes/ runs as `python scripts/NAME.py` from the
repository root with no PYTHONPATH, importing this checkout's code (not an installed
copy); `jprefix bench` lists its three benchmarks.

One subprocess (cwd the root, PYTHONPATH unset) runs each script's `--help` as Python runs
a script: its own folder first on sys.path, no first-party module imported yet, run as
`__main__`; it prints one JSON line per script, and each script is a test of its own here.
Two scripts also run for real in a process of their own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = {"__init__.py", "device_trace.py", "kernel_timing.py", "memcheck.py",
             "bench_write_kv.py"}  # (imported by the tools, not run)
SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("scripts/*.py"),
                                                    *ROOT.glob("scripts/probes/*.py")]
                 if p.name not in LIBRARIES)

CHECK = r"""
import contextlib, io, json, os, runpy, sys
FIRST_PARTY = ("jprefix", "models", "pallas_kernels", "scripts")
root, scripts = sys.argv[1], sys.argv[2:]
base_path = [p for p in sys.path[1:] if os.path.abspath(p or ".") != root]
for script in scripts:
    for name in [m for m in sys.modules if m.split(".")[0] in FIRST_PARTY]:
        del sys.modules[name]
    sys.path[:] = [os.path.dirname(os.path.join(root, script))] + base_path
    sys.argv = [script, "--help"]
    out, ok, detail = io.StringIO(), False, ""
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(os.path.join(root, script), run_name="__main__")
        detail = "exited without SystemExit"
    except SystemExit as e:
        jp = sys.modules.get("jprefix")
        where = os.path.dirname(os.path.dirname(jp.__file__)) if jp else root
        ok = e.code in (0, None) and "usage:" in out.getvalue() and where == root
        detail = f"exit {e.code}, jprefix from {where}, output {out.getvalue()[:80]!r}"
    except BaseException as e:
        detail = f"{type(e).__name__}: {e}"
    print(json.dumps({"name": script, "ok": ok, "detail": detail}), flush=True)
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def help_runs() -> dict[str, dict]:
    proc = subprocess.run([sys.executable, "-c", CHECK, str(ROOT), *SCRIPTS], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["name"]: row for row in rows} | {"_stderr": {"detail": proc.stderr[-2000:]}}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs_without_pythonpath(help_runs, script):
    row = help_runs.get(script)
    assert row is not None, f"no result (the check process died?): {help_runs['_stderr']}"
    assert row["ok"], row["detail"]


@pytest.mark.parametrize("script", ["scripts/bench_throughput.py",
                                    "scripts/probes/probe_host.py"])
def test_a_script_runs_as_python_runs_it(script):
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


def test_jprefix_bench_lists_its_benchmarks(capsys):
    from jprefix.entrypoints import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("throughput", "latency", "serve"))


def test_the_engine_never_imports_the_benchmarks():
    import ast

    found = []
    for folder in ("core", "engine", "worker"):
        for path in sorted((ROOT / "jprefix" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [f"{node.module}.{a.name}" for a in node.names]
                         if isinstance(node, ast.ImportFrom) else [])
                found += [f"{path.name}: {n}" for n in names
                          if n.startswith("jprefix.benchmarks")]
    assert found == []
