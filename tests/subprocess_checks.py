"""Named checks for tests whose assertions run in a subprocess (a fixed jax device count
needs a fresh process), so a failure names the check, not one opaque return code.

`instrument(code)` rewrites every `assert COND, DETAIL` of the script, and every
`raise AssertionError(MSG)`, into `_check(NAME, COND, lambda: DETAIL)`: the check prints
one JSON line (name, ok, detail) and the script goes on. NAME is the condition's source
(or MSG's), with ` #2`, ` #3` ... on repeats. `check_names(code)` lists the names at
collection time, for one parametrized test per check; `run_checks` runs the script once
(callers cache it per module); `assert_check` asserts one check by name. A check run
several times (in a loop) fails if any run failed, with the first failure's detail. A
check the script never reached passes when the script ran to its end (a branch another
backend takes), and fails with the script's output when it stopped early; the pseudo
check `RAN_TO_END` asserts the exit status itself.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAN_TO_END = "the script ran to its end (exit status 0)"
MARK = "JPREFIX_CHECK "
_PRELUDE = f"""
import json as _json
def _check(name, ok, detail):
    row = {{"name": name, "ok": bool(ok), "detail": "" if ok else repr(detail())[:3000]}}
    print({MARK!r} + _json.dumps(row), flush=True)
"""


class _Rewrite(ast.NodeTransformer):
    def __init__(self, source: str):
        self.source, self.names = source, []

    def _check(self, node: ast.stmt, name_of: ast.expr, ok: ast.expr,
               detail: ast.expr | None) -> ast.stmt:
        if isinstance(name_of, ast.Constant) and isinstance(name_of.value, str):
            name = name_of.value
        else:
            name = " ".join(ast.get_source_segment(self.source, name_of).split())
        if name in self.names:
            name = f"{name} #{sum(n.split(' #')[0] == name for n in self.names) + 1}"
        self.names.append(name)
        lazy = ast.Lambda(ast.arguments([], [], None, [], [], None, []),
                          detail or ast.Constant(None))
        call = ast.Call(ast.Name("_check", ast.Load()), [ast.Constant(name), ok, lazy], [])
        return ast.copy_location(ast.Expr(call), node)

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        return self._check(node, node.test, self.visit(node.test), node.msg)

    def visit_Raise(self, node: ast.Raise) -> ast.stmt:
        exc = node.exc
        if (isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name)
                and exc.func.id == "AssertionError" and exc.args):
            return self._check(node, exc.args[0], ast.Constant(False), exc.args[0])
        return node


def _rewrite(code: str) -> _Rewrite:
    rewrite = _Rewrite(code)
    rewrite.tree = ast.fix_missing_locations(rewrite.visit(ast.parse(code)))
    return rewrite


def instrument(code: str) -> str:
    """The script with its assertions turned into named checks."""
    return _PRELUDE + ast.unparse(_rewrite(code).tree)


def check_names(code: str) -> list[str]:
    """The script's check names, in source order, then `RAN_TO_END`."""
    return _rewrite(code).names + [RAN_TO_END]


@dataclass
class CheckRun:
    """One run: each check's aggregate row by name, the exit status, the output's tail."""

    rows: dict[str, dict]
    returncode: int
    output: str


def device_env(num_devices: int, cpu: bool = True) -> dict[str, str]:
    """A jax with `num_devices` virtual CPU devices, importing this checkout (and the
    suite's own XLA_FLAGS, conftest.py's); on the CPU platform, or (`cpu` False) on the
    platform the caller's environment picks."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = f"{flags} --xla_force_host_platform_device_count={num_devices}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), PYTHONPATH=str(ROOT))
    return env | {"JAX_PLATFORMS": "cpu"} if cpu else env


def run_checks(code: str, args: list[str], env: dict[str, str], timeout: float) -> CheckRun:
    """Runs the instrumented script once (`python -c`, cwd the repository root)."""
    run = subprocess.run([sys.executable, "-c", instrument(code), *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    rows: dict[str, dict] = {}
    for line in run.stdout.splitlines():
        if line.startswith(MARK):
            row = json.loads(line[len(MARK):])
            seen = rows.setdefault(row["name"], row)
            if seen["ok"] and not row["ok"]:
                rows[row["name"]] = row
    kept = [ln for ln in run.stdout.splitlines() if not ln.startswith(MARK)]
    return CheckRun(rows, run.returncode, "\n".join(kept)[-2000:] + run.stderr[-4000:])


def assert_check(run: CheckRun, name: str) -> None:
    """Asserts one named check of a run (see the module docstring)."""
    if name == RAN_TO_END:
        assert run.returncode == 0, run.output
        return
    row = run.rows.get(name)
    if row is None:
        assert run.returncode == 0, f"not reached: the script stopped first\n{run.output}"
        return
    assert row["ok"], f"{name}: {row['detail']}"
