"""What the default suite imports is declared: ``pip install -c constraints.txt -e ".[test]"`` on a new
machine installs every package the README's test command needs, and every one of them is pinned.

Why: a machine that earlier sessions installed things on by hand passes a suite that a new user's
machine fails (trl and datasets were imported by the default suite and declared nowhere). The scan
reads the code, not the machine: every import of vramguard, its suites and its benchmarks (a
function-level import and ``pytest.importorskip`` count; an import guarded by ``except ImportError``
is optional and does not) must be provided by a distribution that ``pyproject.toml`` declares in its
dependencies or its ``test`` extra, and every declared distribution has a pin in ``constraints.txt``.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
#: what the README's test command collects (pyproject's testpaths), the package, and the root conftest
SCANNED = ("src/vramguard", "tests", "tests_memory", "tests_grad", "benchmarks", "conftest.py")
#: the extras the README's install line names
EXTRAS = ("test",)


def declared(pyproject: Path = ROOT / "pyproject.toml", extras: Iterable[str] = EXTRAS) -> set[str]:
    """Canonical names of the distributions ``pip install -e ".[extras]"`` asks for on this platform."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    out = set()
    for line in reqs:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.add(canonicalize_name(req.name))
    return out


def _guarded(tree: ast.AST) -> set[int]:
    """ids of import nodes inside a ``try`` that catches ImportError / ModuleNotFoundError."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        names = set()
        for handler in node.handlers:
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            names |= {k.id for k in kinds if isinstance(k, ast.Name)}
        if names & {"ImportError", "ModuleNotFoundError"}:
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports_of(source: str, filename: str = "<string>") -> Iterator[tuple[str, int]]:
    """(top-level module, line) of every unguarded import in ``source``, ``pytest.importorskip`` included."""
    tree = ast.parse(source, filename)
    skip = _guarded(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], node.lineno
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value.split(".")[0], node.lineno


def python_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for entry in SCANNED:
        path = root / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def undeclared(files: Iterable[Path], allowed: set[str], dists: dict[str, list[str]]) -> list[str]:
    """One line per import that no declared distribution provides."""
    files = list(files)
    local = {"vramguard", "conftest"} | {p.stem for p in files}
    problems = []
    for path in files:
        for top, line in imports_of(path.read_text(), str(path)):
            if top in sys.stdlib_module_names or top in local:
                continue
            providers = {canonicalize_name(d) for d in dists.get(top, [])}
            if not providers & allowed:
                where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"
                got = ", ".join(sorted(providers)) or "no installed distribution"
                problems.append(f"{where} imports {top} ({got}), which no dependency or extra declares")
    return sorted(set(problems))


def pins(constraints: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """``constraints.txt`` as {canonical name: version}."""
    out = {}
    for raw in constraints.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            out[canonicalize_name(req.name)] = str(req.specifier)
    return out


def test_the_default_suite_imports_only_declared_packages() -> None:
    assert undeclared(python_files(), declared(), md.packages_distributions()) == []


def test_an_undeclared_import_is_found(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import os\nimport torch\n\ndef test():\n    import datasets\n    pytest.importorskip('trl.kernels')\n"
        "try:\n    import liger_kernel\nexcept ImportError:\n    pass\n"
    )
    dists = {"torch": ["torch"], "datasets": ["datasets"], "trl": ["trl"], "liger_kernel": ["liger_kernel"]}
    found = undeclared([tmp_path / "test_x.py"], {"torch"}, dists)
    assert [line.split(" imports ")[1].split(" ")[0] for line in found] == ["datasets", "trl"]


def test_the_integrations_dependencies_are_in_the_test_extra() -> None:
    """The two that were missing: the SFTTrainer tests need trl and datasets."""
    assert {"trl", "datasets"} <= declared()


def test_every_declared_distribution_is_pinned() -> None:
    pinned = pins()
    missing = sorted(name for name in declared() if name not in pinned)
    assert missing == [], f"declared but not pinned in constraints.txt: {missing}"
    assert all(spec.startswith("==") for spec in pinned.values()), pinned


@pytest.mark.parametrize("name", sorted(declared()))
def test_each_declared_distribution_is_installed_at_its_pin(name: str) -> None:
    """The environment the suite runs in is the one the README's install line makes (a newer release
    here means the run is not the pinned one: the newest-releases CI path sets VRAMGUARD_UNPINNED)."""
    import os

    spec = pins().get(name)
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        pytest.fail(
            f"{name} is declared but not installed: the environment was not made by the README's command"
        )
    if os.environ.get("VRAMGUARD_UNPINNED"):
        pytest.skip(f"newest-releases run: {name} {version} (pinned {spec})")
    from packaging.specifiers import SpecifierSet

    assert version in SpecifierSet(spec) or version.split("+")[0] in SpecifierSet(spec), (name, version, spec)
