"""The layout holds: the core parts import no face (rich, argparse, pytest), the parts form no import
cycle, and the pytest plugins cost a session nothing (no torch) until a vramguard marker asks."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vramguard

SRC = Path(vramguard.__file__).resolve().parents[1]
PACKAGE = SRC / "vramguard"

#: Parts that measure, estimate, check and record; they never render nor parse a command line.
CORE = ("measure", "model", "workload", "grad", "history", "bisect", "step", "audit", "estimate")
#: Imports that belong to a face (the CLI, the pytest plugins), never to the core.
FACES = ("rich", "argparse", "pytest", "_pytest", "vramguard.cli", "vramguard.pytest", "vramguard.view")
#: The one part that draws: every rich import is in it (the CLI, the pytest plugins and the integrations draw
#: through it).
VIEW = "vramguard.view"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> every module it imports, at any depth of its code (a function-level import counts). A new
    copy each call (the tests that prove a check can fail add an import to theirs); the sources are parsed
    once a process (:func:`_parsed_import_graph`: 0.6 CPU s a parse, eight tests read it)."""
    return {module: set(names) for module, names in _parsed_import_graph().items()}


@functools.cache
def _parsed_import_graph() -> dict[str, frozenset[str]]:
    graph: dict[str, frozenset[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[_module_name(path)] = frozenset(found)
    return graph


def part_of(module: str) -> str:
    """``vramguard.measure.ledger`` -> ``measure``; a top-level module is its own part."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def faces_in(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, names in graph.items()
        if module.startswith("vramguard.") and part_of(module) in CORE
        for name in names
        if any(name == face or name.startswith(face + ".") for face in FACES)
    )


def rich_outside_the_view(graph: dict[str, set[str]]) -> list[str]:
    """Modules outside :data:`VIEW` that import rich (integrations, cli and pytest included)."""
    return sorted(
        f"{module} imports {name}"
        for module, names in graph.items()
        if module != VIEW and not module.startswith(VIEW + ".")
        for name in names
        if name == "rich" or name.startswith("rich.")
    )


def part_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles among the parts (``measure -> model -> measure``), found by depth-first search."""
    edges: dict[str, set[str]] = {}
    for module, names in graph.items():
        for name in names:
            if name in graph and name.startswith("vramguard.") and part_of(name) != part_of(module):
                edges.setdefault(part_of(module), set()).add(part_of(name))
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt in path:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif len(path) < len(edges) + 1:
                visit(nxt, path + [nxt])

    for start in sorted(edges):
        visit(start, [start])
    return cycles


def test_every_part_is_a_package() -> None:
    for part in (*CORE, "cli", "pytest", "view"):
        assert (PACKAGE / part / "__init__.py").is_file(), part


def test_the_core_imports_no_face() -> None:
    assert faces_in(import_graph()) == []


def test_a_face_in_the_core_is_found() -> None:
    """The check can fail: a core module that imports rich is named."""
    graph = import_graph()
    graph["vramguard.measure.ledger"] = graph["vramguard.measure.ledger"] | {"rich.console"}
    assert faces_in(graph) == ["vramguard.measure.ledger imports rich.console"]


def test_only_the_view_imports_rich() -> None:
    assert rich_outside_the_view(import_graph()) == []


def test_a_rich_import_outside_the_view_is_found() -> None:
    """The check can fail: a face (here the Trainer callback) that imports rich itself is named."""
    graph = import_graph()
    name = "vramguard.integrations.transformers"
    graph[name] = graph[name] | {"rich.table", "rich.table.Table"}
    assert rich_outside_the_view(graph) == [f"{name} imports rich.table", f"{name} imports rich.table.Table"]


def test_the_parts_form_no_cycle() -> None:
    assert part_cycles(import_graph()) == []


def test_a_cycle_is_found() -> None:
    graph = import_graph()
    graph["vramguard.measure.storage"] = graph["vramguard.measure.storage"] | {"vramguard.audit.run"}
    assert ["measure", "audit", "measure"] in part_cycles(graph)


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
        check=False,
    )


def test_importing_the_plugins_imports_no_torch(tmp_path: Path) -> None:
    code = (  # the plugins, which are the pytest11 entry-point modules
        "import sys, vramguard, vramguard.pytest.plugin, vramguard.pytest.benchmark; "
        "print(sorted(m for m in ('torch', 'rich') if m in sys.modules))"
    )
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("body", "torch_loaded"),
    [
        ("def test_plain():\n    pass\n", False),
        ("import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n    pass\n", True),
    ],
    ids=["no-vramguard-marker", "gpu-marker"],
)
def test_a_pytest_session_imports_torch_only_when_a_marker_asks(
    tmp_path: Path, body: str, torch_loaded: bool
) -> None:
    """A project that merely has vramguard installed pays nothing for it; a gpu test does import torch
    (to ask for CUDA), which shows the probe can see torch arrive."""
    (tmp_path / "test_x.py").write_text(body)
    (tmp_path / "conftest.py").write_text(
        "import sys\n\ndef pytest_sessionfinish(session):\n    print('TORCH', 'torch' in sys.modules)\n"
    )
    code = (
        # vramguard's plugins load through their pytest11 entry points, as in any project that installs it
        "import sys, pytest; sys.exit(pytest.main(['-q', '-s', '-p', 'no:cacheprovider', '-p', 'no:randomly', "
        "'-o', 'addopts=', '--rootdir', '.', 'test_x.py']))"
    )
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"TORCH {torch_loaded}" in out.stdout, out.stdout


# -- every public name says what it is for ------------------------------------------------------------


def public_names(path: Path) -> list[tuple[str, ast.AST]]:
    """The public functions, classes and methods of a module (names without a leading underscore; the
    methods of public classes, nested classes included), each with its node."""
    found: list[tuple[str, ast.AST]] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name.startswith("_"):
                    continue
                found.append((prefix + node.name, node))
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(path.read_text(), str(path)).body, "")
    return found


def undocumented(path: Path, root: Path = SRC) -> list[str]:
    """``file:line name`` of each public name in ``path`` without a docstring that says something: none,
    or one that is only the name again (``'Run.'`` on ``run``) or shorter than three words."""
    out = []
    for name, node in public_names(path):
        doc = ast.get_docstring(node) or ""  # type: ignore[arg-type]
        words = doc.lower().replace("_", " ").split()
        if len(words) < 3 or " ".join(words).strip(".") == name.split(".")[-1].lower().replace("_", " "):
            out.append(f"{path.relative_to(root)}:{node.lineno} {name}")  # type: ignore[attr-defined]
    return out


def test_every_public_name_has_a_docstring() -> None:
    missing = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__main__.py"
        for line in undocumented(path)
    ]
    assert missing == []


def test_a_missing_docstring_is_found(tmp_path: Path) -> None:
    """The check can fail: an undocumented function, a method, a docstring that only repeats the name."""
    module = tmp_path / "vramguard" / "m.py"
    module.parent.mkdir()
    module.write_text(
        'def documented():\n    """Says what the function is for."""\n\n'
        "def bare():\n    pass\n\n"
        'def run():\n    """Run."""\n\n'
        'class Thing:\n    """A thing that is documented."""\n\n'
        "    def method(self):\n        return 1\n\n"
        "    def _private(self):\n        return 2\n"
    )
    assert undocumented(module, tmp_path) == [
        "vramguard/m.py:4 bare",
        "vramguard/m.py:7 run",
        "vramguard/m.py:13 Thing.method",
    ]


# -- the estimate stands on shared step pieces, in small functions -----------------------------------------

#: The part that prices a step on meta; it shares the step's pieces with the audit, never imports it.
ESTIMATE = "vramguard.estimate"
#: The longest function, in lines (its ``def`` to its last line, docstring included), and the most parameters
#: (``*args`` and ``**kwargs`` count one each; ``self`` and ``cls`` none) a function in :data:`ESTIMATE` has.
MAX_LINES, MAX_PARAMETERS = 80, 6
#: Functions that stand in for a library's own function on meta: their signature is the library's (transformers
#: inspects flash-attn's for the arguments it passes), so their parameters are not the estimate's to choose.
LIBRARY_SIGNATURES = {
    "vramguard.estimate.flash.flash_attn_func",
    "vramguard.estimate.flash.flash_attn_varlen_func",
}


def audit_imports_in_the_estimate(graph: dict[str, set[str]]) -> list[str]:
    """``module imports name`` for each import of ``vramguard.audit`` by a module of :data:`ESTIMATE`."""
    return sorted(
        f"{module} imports {name}"
        for module, names in graph.items()
        if module == ESTIMATE or module.startswith(ESTIMATE + ".")
        for name in names
        if name == "vramguard.audit" or name.startswith("vramguard.audit.")
    )


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters a function takes: positional and keyword-only, ``*args`` and ``**kwargs`` one each;
    a method's ``self`` or ``cls`` not counted."""
    a = node.args
    names = [*a.posonlyargs, *a.args]
    own = 1 if names and names[0].arg in ("self", "cls") else 0
    return len(names) - own + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def oversized_functions(path: Path, module: str) -> list[str]:
    """``module.function: N lines, M parameters`` for each function (nested ones and methods included) of
    ``path`` longer than :data:`MAX_LINES` or taking more than :data:`MAX_PARAMETERS` parameters."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if f"{module}.{node.name}" in LIBRARY_SIGNATURES:
            continue
        lines, parameters = (node.end_lineno or node.lineno) - node.lineno + 1, parameter_count(node)
        if lines > MAX_LINES or parameters > MAX_PARAMETERS:
            out.append(f"{module}.{node.name}: {lines} lines, {parameters} parameters")
    return out


def test_the_estimate_imports_no_audit() -> None:
    """The estimate and the audit both build on the step's shared pieces (refusals, the analytic expectation,
    report assembly, the report schema); the estimate does not reach into the audit for them."""
    assert audit_imports_in_the_estimate(import_graph()) == []


def test_an_audit_import_in_the_estimate_is_found() -> None:
    """The check can fail: an estimate module that imports the audit's loop is named."""
    graph = import_graph()
    graph["vramguard.estimate.fit"] = graph["vramguard.estimate.fit"] | {"vramguard.audit.run"}
    assert "vramguard.estimate.fit imports vramguard.audit.run" in audit_imports_in_the_estimate(graph)


def test_the_estimate_has_small_functions() -> None:
    found = [
        line
        for path in sorted((PACKAGE / "estimate").rglob("*.py"))
        for line in oversized_functions(path, _module_name(path))
    ]
    assert found == []


def test_an_oversized_function_is_found(tmp_path: Path) -> None:
    """The check can fail: a function of 81 lines and one of 7 parameters (a method's self not counted) are
    named, one of 80 lines and 6 parameters is not."""
    path = tmp_path / "m.py"
    body = "    x = 1\n"
    path.write_text(
        "def long():\n" + body * 80
        + "def fits():\n" + body * 79
        + "def many(a, b, c, d, e, f, *args):\n    pass\n"
        + "class C:\n    def six(self, a, b, c, d, e, **kw):\n        pass\n"
    )
    assert oversized_functions(path, "m") == ["m.long: 81 lines, 0 parameters", "m.many: 2 lines, 7 parameters"]
