"""``vramguard bisect --git``: the commits of a local clone, end to end and offline.

The test makes a git repository of a tiny pure-Python package, ``vg-tiny`` (imported as ``vgtiny``), built by
an in-tree PEP 517 backend that needs nothing from an index, so pip builds each commit offline. Six commits:
``LEAK`` turns 1 at the fifth (the regression) and the third does not build (its backend raises).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramguard.bisect.overlay import OverlayCache
from vramguard.cli import main

BACKEND = '''"""An in-tree PEP 517 backend: a wheel of vgtiny/ with nothing to install first."""
import base64, hashlib, os, zipfile

BROKEN = False
INFO = "vg_tiny-0.1.0.dist-info"


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    if BROKEN:
        raise RuntimeError("vg-tiny does not build at this commit")
    files = {f"vgtiny/{n}": open(os.path.join("vgtiny", n), "rb").read() for n in os.listdir("vgtiny")}
    files[f"{INFO}/METADATA"] = b"Metadata-Version: 2.1\\nName: vg-tiny\\nVersion: 0.1.0\\n"
    files[f"{INFO}/WHEEL"] = b"Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    files[f"{INFO}/RECORD"] = ("\\n".join(record + [f"{INFO}/RECORD,,"]) + "\\n").encode()
    name = "vg_tiny-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return name
'''
PYPROJECT = """[build-system]
requires = []
build-backend = "_backend"
backend-path = ["."]

[project]
name = "vg-tiny"
version = "0.1.0"
"""
# (subject, LEAK, builds): index 2 does not build, index 4 is the regression
HISTORY = [
    ("vg-tiny: first commit", 0, True),
    ("docs: a readme", 0, True),
    ("build: break the backend", 0, False),
    ("build: mend the backend", 0, True),
    ("cache the activations (the regression)", 1, True),
    ("docs: changelog", 1, True),
]
PROBE = [sys.executable, "-c", "import vgtiny, sys; print('vgtiny LEAK', vgtiny.LEAK); sys.exit(vgtiny.LEAK)"]


GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env
    ).stdout.strip()


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The test repository and its commits' shas, oldest first."""
    repo = tmp_path_factory.mktemp("vg-tiny")
    _git(repo, "init", "-q", "-b", "main")
    (repo / "vgtiny").mkdir()
    (repo / "pyproject.toml").write_text(PYPROJECT)
    shas = []
    for i, (subject, leak, builds) in enumerate(HISTORY):
        (repo / "vgtiny" / "__init__.py").write_text(f"LEAK = {leak}\n")
        (repo / "_backend.py").write_text(BACKEND.replace("BROKEN = False", f"BROKEN = {not builds}"))
        if i == 1:
            (repo / "README").write_text("vg-tiny\n")
        if i == 5:
            (repo / "CHANGELOG").write_text("leak\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", subject)
        shas.append(_git(repo, "rev-parse", "HEAD"))
    _git(repo, "tag", "v-good", shas[0])
    _git(repo, "tag", "v-bad", shas[-1])
    return repo, shas


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("overlays")


def _bisect(capsys, repo: Path, cache: Path, log: Path, *args: str) -> tuple[int, str, str]:
    offline = log.parent / "no-index"
    offline.mkdir(exist_ok=True)
    argv = ["bisect", "vg-tiny", "--git", str(repo), *args, "--cache-dir", str(cache), "--log", str(log)]
    code = main([*argv, "--find-links", str(offline), "--", *PROBE])  # --find-links alone: pip offline
    out, err = capsys.readouterr()
    return code, out, err


def test_bisects_the_commits_of_a_clone(capsys, clone, cache: Path, tmp_path: Path) -> None:
    repo, shas = clone
    state = (
        _git(repo, "rev-parse", "HEAD"),
        _git(repo, "status", "--porcelain"),
        _git(repo, "worktree", "list"),
    )
    log = tmp_path / "log.json"
    code, out, err = _bisect(capsys, repo, cache, log, "--good", "v-good", "--bad", "v-bad")
    assert code == 0, err
    assert f"first bad commit: vg-tiny {shas[4]} cache the activations (the regression)" in out
    assert f"last good commit: vg-tiny {shas[3]} build: mend the backend" in out
    assert f"skipped: {shas[2][:12]} build: break the backend (build failed:" in out
    assert "vg-tiny does not build at this commit" in out  # the build's own last words name the reason
    data = json.loads(log.read_text())
    assert data["status"] == "found" and data["candidates"] == shas
    assert data["result"]["first_bad"] == shas[4] and data["result"]["skipped"] == [shas[2]]
    assert [c["subject"] for c in data["git"]["commits"]] == [h[0] for h in HISTORY]
    by_sha = {p["version"]: p for p in data["probes"]}
    assert by_sha[shas[4]]["verdict"] == "bad" and "vgtiny LEAK 1" in by_sha[shas[4]]["output_tail"]
    assert by_sha[shas[2]]["overlay"] == "install-failed"
    # each commit that built is an overlay entry of its own, named after its sha
    built = {p.parent.name for p in (cache / "vg-tiny").glob("git-*/.vramguard-overlay.json")}
    assert set(by_sha) == set(shas)  # 6 candidates: every one probed (endpoints, the skip, its neighbours)
    assert {name.split("-")[1] for name in built} == {shas[i] for i in (0, 1, 3, 4, 5)}
    # the user's clone is as it was: HEAD, work tree, no worktree added
    assert (
        _git(repo, "rev-parse", "HEAD"),
        _git(repo, "status", "--porcelain"),
        _git(repo, "worktree", "list"),
    ) == state

    # a second run builds nothing that built before: every overlay that built is reused
    code, out, err = _bisect(
        capsys, repo, cache, tmp_path / "again.json", "--good", shas[0], "--bad", "v-bad"
    )
    assert code == 0, err
    probes = json.loads((tmp_path / "again.json").read_text())["probes"]
    assert {p["overlay"] for p in probes if p["verdict"] != "skip"} == {"cached"}


def test_endpoint_error_shows_the_probe_and_the_log(capsys, clone, cache: Path, tmp_path: Path) -> None:
    repo, shas = clone
    log = tmp_path / "log.json"
    code, _, err = _bisect(capsys, repo, cache, log, "--good", shas[4], "--bad", "v-bad")
    lines = [ln for ln in err.splitlines() if ln.startswith("vramguard: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert (
        f"--good {shas[4][:12]} (cache the activations (the regression)) is not good: the probe exited 1"
        in lines[0]
    )
    assert "  | vgtiny LEAK 1" in err  # the probe's own last lines
    assert f"log: {log}" in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--good", "v-good", "--bad", "no-such-ref"), "--bad no-such-ref: not a commit in"),
        (("--good", "v-bad", "--bad", "v-good"), "--good v-bad is not an ancestor of --bad v-good"),
        (("--good", "v-good", "--bad", "v-good"), "are the same commit"),
        (("--good", "v-good", "--bad", "v-bad", "--versions", "1,2"), "--versions chooses releases"),
    ],
)
def test_bad_refs_are_one_line(
    capsys, clone, cache: Path, tmp_path: Path, args: tuple[str, ...], needle: str
) -> None:
    repo, _ = clone
    code, _, err = _bisect(capsys, repo, cache, tmp_path / "log.json", *args)
    lines = [ln for ln in err.splitlines() if ln.startswith("vramguard: error:")]
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_not_a_clone_and_build_without_git(capsys, tmp_path: Path) -> None:
    argv = ["bisect", "vg-tiny", "--good", "a", "--bad", "b", "--cache-dir", str(tmp_path / "c")]
    assert main([*argv, "--git", str(tmp_path), "--", "true"]) == 2
    assert f"--git {tmp_path}: not a git repository" in capsys.readouterr().err
    assert main([*argv, "--build", "make", "--", "true"]) == 2
    assert "--build builds commits: it needs --git PATH" in capsys.readouterr().err


def test_commit_entries_are_evicted_like_releases(tmp_path: Path) -> None:
    """A commit's overlay is a cache entry as a release's is: listed, sized, and evicted under the bound."""
    cache = OverlayCache(tmp_path, max_bytes=0)
    cache.prepare()

    def fill(work: Path, target: Path) -> None:
        (target / "vgtiny").mkdir(parents=True)
        (target / "vgtiny" / "__init__.py").write_text("LEAK = 0\n")
        (target / "vg_tiny-0.1.0.dist-info").mkdir()
        (target / "vg_tiny-0.1.0.dist-info" / "METADATA").write_text("Name: vg-tiny\nVersion: 0.1.0\n")

    first = cache.get_commit("vg-tiny", "a" * 40, fill)
    assert first.version == "0.1.0" and first.import_names == ("vgtiny",) and first.installed_now
    second = cache.get_commit("vg-tiny", "b" * 40, fill)
    assert not first.path.exists() and second.path.exists()  # max_bytes 0: only the newest is kept
    assert cache.get_commit("vg-tiny", "b" * 40, fill).installed_now is False


def test_another_build_command_is_another_entry(tmp_path: Path) -> None:
    """A commit built by one command (the CPU default) is not reused for another (a CUDA build): the entry is
    keyed by the command too, where the same folder had silently served both."""
    cache = OverlayCache(tmp_path, max_bytes=10**9)
    cache.prepare()
    built: list[str] = []

    def fill_as(how: str):
        def fill(work: Path, target: Path) -> None:
            built.append(how)
            (target / "vgtiny").mkdir(parents=True)
            (target / "vgtiny" / "__init__.py").write_text(f"BUILT = {how!r}\n")
            (target / "vg_tiny-0.1.0.dist-info").mkdir()
            (target / "vg_tiny-0.1.0.dist-info" / "METADATA").write_text("Name: vg-tiny\nVersion: 0.1.0\n")

        return fill

    cpu = cache.get_commit("vg-tiny", "c" * 40, fill_as("cpu"), build="cmake -DCOMPUTE_BACKEND=cpu")
    cuda = cache.get_commit("vg-tiny", "c" * 40, fill_as("cuda"), build="cmake -DCOMPUTE_BACKEND=cuda")
    assert built == ["cpu", "cuda"] and cpu.path != cuda.path
    assert "'cuda'" in (cuda.path / "vgtiny" / "__init__.py").read_text()
    again = cache.get_commit("vg-tiny", "c" * 40, fill_as("cpu"), build="cmake -DCOMPUTE_BACKEND=cpu")
    assert again.installed_now is False and built == ["cpu", "cuda"]


def test_good_merged_in_from_a_side_branch_is_one_line(capsys, tmp_path: Path) -> None:
    """--good on a side branch merged into --bad's line is not on its first-parent line: the commits between
    would not all contain it, so it is refused in one line, as docs/bisect.md says."""
    repo = tmp_path / "merged"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    for name in ("m1", "m2"):
        (repo / name).write_text(name)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", name)
    _git(repo, "checkout", "-q", "-b", "side", "HEAD~1")
    (repo / "s1").write_text("s1")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "s1")
    _git(repo, "tag", "good")
    _git(repo, "checkout", "-q", "main")
    _git(repo, "merge", "-q", "--no-ff", "-m", "merge side", "side")
    _git(repo, "tag", "bad")
    code, _, err = _bisect(capsys, repo, tmp_path / "c", tmp_path / "log.json", "--good", "good", "--bad", "bad")
    assert code == 2 and "--good good is not on the first-parent line of --bad bad" in err, err
