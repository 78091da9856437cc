"""The code's layering: which side each folder runs on and what it may import.

- jprefix/core/ (the host's logic) never imports jax, nor the layers above it;
- importing `jprefix` loads no jax and changes no environment variable;
- jprefix/worker/ (the device side) imports no engine or entrypoint, jprefix/engine/ no
  entrypoint; models/ and pallas_kernels/ never import jprefix, and models/ never
  imports pallas_kernels/ (a fused kernel's reference may use the model's own function);
- jprefix/entrypoints/ consume the engine's RequestOutputs: they import no
  `core.sequence`, `engine.detokenizer`, `engine.logprobs` or worker module;
- one owner per piece of request state: nothing outside jprefix/core sets an attribute
  of a Sequence (the scheduler's state);
- no first-party import cycle, and no file far over the ~300-line rule.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jprefix", "models", "pallas_kernels")
MAX_LINES = 320


def _modules() -> dict[str, Path]:
    """First-party module name -> file."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (at any depth, outside `if TYPE_CHECKING:` blocks); a
    `from a import b` where a.b is a first-party module counts as importing a.b."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if f"{node.module}.{a.name}" in MODULES)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _first_party(names: set[str]) -> set[str]:
    return {n for n in names if n in MODULES}


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_every_core_module_loads_no_jax():
    core = [m for m in MODULES if m.startswith("jprefix.core")]
    assert len(core) >= 10
    code = ("import importlib, json, sys\n"
            f"for m in {core!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib'))))")
    assert _run(code) == []


def test_importing_jprefix_sets_no_environment_variable_and_loads_no_jax():
    code = ("import json, os, sys\nbefore = dict(os.environ)\nimport jprefix\n"
            "jprefix.__all__\n"
            "print(json.dumps({'env': dict(os.environ) == before, "
            "'jax': 'jax' in sys.modules}))")
    assert _run(code) == {"env": True, "jax": False}


@pytest.mark.parametrize("layer, forbidden", [
    ("jprefix.core", ("jax", "jaxlib", "jprefix.engine", "jprefix.worker", "jprefix.entrypoints",
                      "models", "pallas_kernels")),
    ("jprefix.engine", ("jprefix.entrypoints",)),
    ("jprefix.worker", ("jprefix.engine", "jprefix.entrypoints")),
    ("models", ("jprefix", "pallas_kernels")),
    ("pallas_kernels", ("jprefix",)),
    ("jprefix.entrypoints", ("jprefix.core.sequence", "jprefix.engine.detokenizer",
                             "jprefix.engine.logprobs", "jprefix.worker")),
])
def test_each_layer_imports_only_what_is_below_it(layer, forbidden):
    bad = []
    for name, path in MODULES.items():
        if name == layer or name.startswith(layer + "."):
            bad += [(name, imp) for imp in _imports(path)
                    if any(imp == f or imp.startswith(f + ".") for f in forbidden)]
    assert not bad, f"{layer} imports what it must not: {bad}"


def test_no_first_party_import_cycle():
    graph = {name: _first_party(_imports(path)) - {name} for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_source_file_is_far_over_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def _sequence_attributes() -> set[str]:
    """The attributes `Sequence.__init__` sets (`self.<name> = ...`)."""
    tree = ast.parse(MODULES["jprefix.core.sequence"].read_text())
    init = next(n for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


SEQUENCE_NAMES = {"seq", "sequence", "child", "victim", "request"}


def sequence_writes(source: str, attributes: set[str]) -> list[str]:
    """Statements of `source` that set an attribute of what looks like a Sequence: any
    attribute of a name such as `seq` (or of `x.seq`), a Sequence attribute's name on
    anything but `self`, and `setattr` on such names."""
    def is_seq(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Name) and node.id in SEQUENCE_NAMES)
                or (isinstance(node, ast.Attribute) and node.attr == "seq"))

    bad = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        for t in targets:
            if isinstance(t, ast.Attribute) and (is_seq(t.value) or (
                    t.attr in attributes and not (isinstance(t.value, ast.Name)
                                                  and t.value.id in ("self", "cls")))):
                bad.append(f"line {node.lineno}: {ast.unparse(t)} = ...")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr" and node.args and is_seq(node.args[0])):
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    return bad


def _own_attributes(path: Path) -> set[str]:
    """The attributes a module's code sets on `self` (its classes' own)."""
    return {t.attr for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


def test_only_core_sets_sequence_attributes():
    # (an attribute name that another class also owns, such as EngineStats'
    # num_preemptions, counts only on a name such as `seq`)
    others = set().union(*(_own_attributes(p) for n, p in MODULES.items()
                           if n != "jprefix.core.sequence"))
    attributes = _sequence_attributes() - others
    assert {"num_computed_tokens", "block_table", "num_pending"} <= attributes
    bad = {name: found for name, path in MODULES.items() if not name.startswith("jprefix.core")
           if (found := sequence_writes(path.read_text(), attributes))}
    assert not bad, f"Sequence attributes set outside jprefix.core: {bad}"


def test_the_sequence_write_check_catches_writes():
    attributes = _sequence_attributes()
    assert sequence_writes("seq.detokenizer = d", attributes)
    assert sequence_writes("sc.seq.stop_text = t", attributes)
    assert sequence_writes("setattr(seq, '_cache', x)", attributes)
    assert sequence_writes("other.num_pending += 1", attributes)
    assert not sequence_writes("self.num_pending = 0\nstate.text = ''", attributes)
