"""``vramguard bisect`` end to end, offline: a local index of generated wheels of a dummy package.

``vg-dummy`` (imported as ``vgdummy``, so dist and import names differ) exists as 1.0 .. 1.9 plus
1.8rc1. ``LEAK`` turns 1 at 1.5 (the regression), ``FIXED`` turns 1 at 1.7 (the fix), 1.3 is a broken
build (its import raises). Probes print the version they imported, so every log line proves which
overlay ran.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from packaging.version import Version

import vramguard
from vramguard.bisect.overlay import MARKER, InstallError, OverlayCache
from vramguard.bisect.run import _IMPORT_CHECK, probe_env, run_command, verdict_for
from vramguard.bisect.search import probe_bound
from vramguard.cli import main

VERSIONS = [f"1.{i}" for i in range(10)] + ["1.8rc1"]
BROKEN = "1.3"
ALL = ",".join(f"1.{i}" for i in range(10))  # --versions: skips the index query where it is not under test
ALL_PRE = ",".join(VERSIONS)
PROBE_LEAK = [
    sys.executable,
    "-c",
    "import vgdummy, sys; print('vgdummy', vgdummy.__version__); sys.exit(vgdummy.LEAK)",
]
PROBE_FIX = [
    sys.executable,
    "-c",
    "import vgdummy, sys; print('vgdummy', vgdummy.__version__); sys.exit(0 if vgdummy.FIXED else 1)",
]


def _module_source(version: str) -> str:
    if version == BROKEN:
        return "raise ImportError('broken build of vg-dummy')\n"
    v = Version(version)
    return (
        f"__version__ = {version!r}\nLEAK = {int(v >= Version('1.5'))}\nFIXED = {int(v >= Version('1.7'))}\n"
    )


def build_wheel(directory: Path, version: str) -> Path:
    """A minimal valid wheel: module, METADATA, WHEEL and a RECORD with hashes."""
    info = f"vg_dummy-{version}.dist-info"
    files = {
        "vgdummy/__init__.py": _module_source(version),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: vg-dummy\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: vramguard-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = directory / f"vg_dummy-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


@pytest.fixture(scope="session", name="wheelhouse")
def wheelhouse_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated vg-dummy wheels of every version, built once per session (test_sweep_cli uses it too)."""
    directory = tmp_path_factory.mktemp("wheelhouse")
    for version in VERSIONS:
        build_wheel(directory, version)
    return directory


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One overlay cache for tests that are not about installing: each version is installed once."""
    return tmp_path_factory.mktemp("overlays")


@pytest.fixture(autouse=True)
def _no_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMGUARD_CACHE", str(tmp_path / "default-cache"))


def bisect(capsys, *args: str, command: list[str] | None = None) -> tuple[int, str, str]:
    argv = ["bisect", *args]
    if command is not None:
        argv += ["--", *command]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def bisect_1_0_to_1_5(
    capsys, wheelhouse: Path, cache: Path, log: Path, command: list[str]
) -> tuple[int, str, str]:
    """``vramguard bisect`` of vg-dummy between 1.0 (good) and 1.5 (bad), offline, two candidates."""
    return bisect(
        capsys, "vg-dummy", "--good", "1.0", "--bad", "1.5", "--versions", "1.0,1.5",
        *offline(wheelhouse, cache, log), command=command,
    )  # fmt: skip


def offline(wheelhouse: Path, cache: Path, log: Path) -> list[str]:
    """The options of a bisection that installs from the generated wheels only, into ``cache``, logging
    to ``log``."""
    return ["--find-links", str(wheelhouse), "--cache-dir", str(cache), "--log", str(log)]


def assert_cache_consistent(root: Path) -> None:
    """No half-installed entry is ever visible: every entry dir is complete, no temp dir is left."""
    if not root.exists():
        return
    tmp = root / ".tmp"
    assert not tmp.exists() or list(tmp.iterdir()) == []
    for entry in root.glob("*/*"):
        if entry.parent.name.startswith("."):
            continue
        assert (entry / MARKER).is_file(), f"incomplete cache entry {entry}"


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("vramguard: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Traceback" not in out
    for needle in needles:
        assert needle in lines[0], lines[0]


# -- finding the change -------------------------------------------------------------------------------
def test_finds_first_bad_within_the_probe_bound(
    capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path
) -> None:
    log = tmp_path / "log.json"
    code, out, err = bisect(
        capsys, "vg-dummy", "--good", "1.0", "--bad", "1.9", *offline(wheelhouse, shared_cache, log),
        command=PROBE_LEAK,
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(log.read_text())
    assert data["candidates"] == [f"1.{i}" for i in range(10)]  # ordered, pre-release 1.8rc1 excluded
    assert data["status"] == "found"
    assert data["result"]["first_bad"] == "1.5" and data["result"]["last_good"] == "1.4"
    assert "first bad version: vg-dummy 1.5" in out and "last good version: vg-dummy 1.4" in out
    assert data["probe_count"] == len(data["probes"]) <= probe_bound(10) == 6
    for probe in data["probes"]:  # the overlay version, not the environment's, is what the probe saw
        assert f"vgdummy {probe['version']}" in probe["output_tail"]
        assert probe["verdict"] == ("bad" if Version(probe["version"]) >= Version("1.5") else "good")
        assert probe["exit_code"] == (1 if probe["verdict"] == "bad" else 0) and probe["duration_s"] >= 0
    assert [p["version"] for p in data["probes"]][:2] == ["1.0", "1.9"]  # endpoints verified first
    assert err.count("step ") == len(data["probes"])  # one progress line per probe
    assert "step 1 (≤ 6): vg-dummy 1.0 -> good (exit 0, " in err  # the line as it is: no markup left in it
    assert_cache_consistent(shared_cache)


def test_log_is_written_by_default_and_never_overwritten(
    capsys, wheelhouse: Path, shared_cache: Path
) -> None:
    args = [
        "vg-dummy",
        "--good",
        "1.0",
        "--bad",
        "1.5",
        "--versions",
        "1.0,1.5",
        "--find-links",
        str(wheelhouse),
        "--cache-dir",
        str(shared_cache),
    ]
    logs = []
    for _ in range(2):
        code, out, err = bisect(capsys, *args, command=PROBE_LEAK)
        assert code == 0, err
        (line,) = [ln for ln in out.splitlines() if ln.startswith("log: ")]
        logs.append(Path(line[len("log: ") :]))
    assert logs[0] != logs[1] and all(p.is_file() for p in logs)
    assert [json.loads(p.read_text())["result"]["first_bad"] for p in logs] == ["1.5", "1.5"]


def test_second_run_installs_nothing(capsys, wheelhouse: Path, tmp_path: Path) -> None:
    cache, empty = tmp_path / "c", tmp_path / "empty"
    empty.mkdir()
    args = ["vg-dummy", "--good", "1.0", "--bad", "1.9", "--cache-dir", str(cache)]
    code, _, err = bisect(
        capsys, *args, "--find-links", str(wheelhouse), "--log", str(tmp_path / "1.json"), command=PROBE_LEAK
    )
    assert code == 0, err
    first = json.loads((tmp_path / "1.json").read_text())
    assert first["installs"] == len(first["probes"]) > 0
    entries = sorted(p.name for p in (cache / "vg-dummy").iterdir())
    # Second run: the only wheel source is empty, so any install attempt would fail and be a skip.
    versions = ",".join(f"1.{i}" for i in range(10))
    code, _out, err = bisect(
        capsys, *args, "--find-links", str(empty), "--versions", versions, "--log", str(tmp_path / "2.json"),
        command=PROBE_LEAK,
    )  # fmt: skip
    assert code == 0, err
    second = json.loads((tmp_path / "2.json").read_text())
    assert second["installs"] == 0 and {p["overlay"] for p in second["probes"]} == {"cached"}
    assert second["result"] == first["result"] and second["result"]["first_bad"] == "1.5"
    assert sorted(p.name for p in (cache / "vg-dummy").iterdir()) == entries


def test_broken_version_is_skipped(capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    code, out, err = bisect(
        capsys, "vg-dummy", "--good", "1.0", "--bad", "1.5", "--versions", ALL,
        *offline(wheelhouse, shared_cache, log), command=PROBE_LEAK,
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(log.read_text())
    assert data["result"]["first_bad"] == "1.5" and data["result"]["skipped"] == ["1.3"]
    (skip,) = [p for p in data["probes"] if p["verdict"] == "skip"]
    assert skip["version"] == "1.3" and "broken build" in skip["reason"]
    assert "skipped: 1.3" in out
    n_skips = 1
    assert len(data["probes"]) <= probe_bound(len(data["candidates"])) + n_skips


def test_change_next_to_a_skipped_version_is_reported_as_ambiguous(
    capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path
) -> None:
    # This probe turns bad at 1.4, right after the broken 1.3: the first bad is 1.3 or 1.4, not knowable.
    probe = [sys.executable, "-c", "import vgdummy, sys; sys.exit(vgdummy.__version__ >= '1.4')"]
    code, out, err = bisect(
        capsys, "vg-dummy", "--good", "1.0", "--bad", "1.9", "--versions", ALL,
        *offline(wheelhouse, shared_cache, tmp_path / "l.json"), command=probe,
    )  # fmt: skip
    assert code == 3, err
    result = json.loads((tmp_path / "l.json").read_text())["result"]
    assert result["first_bad"] is None and result["possible"] == ["1.3", "1.4"]
    assert result["last_good"] == "1.2" and "undetermined, one of 1.3, 1.4" in out


def test_find_fix_finds_first_good(capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    code, out, err = bisect(
        capsys, "vg-dummy", "--bad", "1.0", "--good", "1.9", "--find-fix", "--versions", ALL,
        *offline(wheelhouse, shared_cache, log), command=PROBE_FIX,
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(log.read_text())
    assert data["mode"] == "find-fix"
    assert data["result"]["first_fixed"] == "1.7" and data["result"]["last_bad"] == "1.6"
    assert "first fixed version: vg-dummy 1.7" in out
    assert len(data["probes"]) <= probe_bound(10)


def test_pre_releases_only_when_asked(capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    code, _, err = bisect(
        capsys, "vg-dummy", "--good", "1.6", "--bad", "1.9", "--pre", *offline(wheelhouse, shared_cache, log),
        command=PROBE_FIX,
    )  # fmt: skip
    # FIXED turns on at 1.7 < 1.8rc1, so with --good 1.6 this is "good is bad": but 1.6 is FIXED=0 -> exit 1.
    assert code == 2 and "--good 1.6 is not good" in err
    assert json.loads(log.read_text())["candidates"] == ["1.6", "1.7", "1.8rc1", "1.8", "1.9"]


@pytest.mark.parametrize(
    ("good", "bad", "needle"),
    [
        ("1.6", "1.9", "--good 1.6 is not good: the probe exited 1"),
        ("1.0", "1.4", "--bad 1.4 is not bad: the probe exited 0"),
        ("1.3", "1.9", "--good 1.3 cannot be tested (import check failed"),
    ],
)
def test_endpoints_are_verified_first(
    capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path, good: str, bad: str, needle: str
) -> None:
    log = tmp_path / "log.json"
    code, out, err = bisect(
        capsys, "vg-dummy", "--good", good, "--bad", bad, "--versions", ALL,
        *offline(wheelhouse, shared_cache, log), command=PROBE_LEAK,
    )  # fmt: skip
    assert_one_line_error(code, out, err, needle)
    # above the error: the probe's last lines on that endpoint and the log's path
    assert f"log: {log}" in err
    if "exited" in needle:
        endpoint = good if needle.startswith("--good") else bad
        assert f"  | vgdummy {endpoint}" in err, err
    data = json.loads(log.read_text())  # the probes run before the error are kept
    assert data["status"] == "endpoint_error" and needle in data["error"]
    assert 1 <= len(data["probes"]) <= 2 and data["probes"][0]["version"] == good
    assert_cache_consistent(shared_cache)


def test_probe_timeout_counts_as_bad(capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path) -> None:
    probe = [sys.executable, "-c", "import time, vgdummy\nif vgdummy.LEAK: time.sleep(120)"]
    log = tmp_path / "log.json"
    code, _out, err = bisect(
        capsys,
        "vg-dummy",
        "--good",
        "1.0",
        "--bad",
        "1.5",
        "--versions",
        "1.0,1.5",
        "--timeout",
        "2.5",  # generous: a good probe (a Python that imports the dummy, ~0.05 s) finishes within it loaded
        *offline(wheelhouse, shared_cache, log),
        command=probe,
    )
    assert code == 0, err
    data = json.loads(log.read_text())
    assert data["result"]["first_bad"] == "1.5" and [p["verdict"] for p in data["probes"]] == ["good", "bad"]
    timed_out = [p for p in data["probes"] if p["verdict"] == "bad"]
    assert timed_out and all(p["exit_code"] is None and p["reason"] == "timeout" for p in timed_out)
    assert all(p["duration_s"] < 40 for p in timed_out)  # killed at the timeout, not after the 120 s sleep


# -- bad input: one line, exit 2, cache consistent ----------------------------------------------------
@pytest.mark.parametrize(
    ("args", "command", "needle"),
    [
        (
            ["nope-not-a-package", "--good", "1.0", "--bad", "1.9"],
            PROBE_LEAK,
            "'nope-not-a-package' not found",
        ),
        (["vg-dummy", "--good", "1.42", "--bad", "1.9"], PROBE_LEAK, "--good 1.42 is not a version listed"),
        # The same checks apply to an explicit list; it saves an index query per case.
        (["vg-dummy", "--good", "1.0", "--bad", "1.8rc1", "--versions", ALL_PRE], PROBE_LEAK, "add --pre"),
        (
            ["vg-dummy", "--good", "one", "--bad", "1.9", "--versions", ALL],
            PROBE_LEAK,
            "'one' is not a version",
        ),
        (["vg-dummy", "--good", "1.9", "--bad", "1.0", "--versions", ALL], PROBE_LEAK, "use --find-fix"),
        (
            ["vg-dummy", "--good", "1.0", "--bad", "1.9", "--find-fix", "--versions", ALL],
            PROBE_LEAK,
            "must be older than --good",
        ),
        (["vg-dummy", "--good", "1.0", "--bad", "1.9"], None, "missing COMMAND"),
        (["vg-dummy", "--good", "1.0", "--bad", "1.9"], [], "missing COMMAND"),
        (["vg-dummy", "--bad", "1.9"], PROBE_LEAK, "required: --good"),
        (["vg-dummy", "--good", "1.0", "--bad", "1.9", "--cache-max", "lots"], PROBE_LEAK, "not a size"),
        (["vg-dummy", "--good", "1.0", "--bad", "1.9", "--timeout", "-1"], PROBE_LEAK, "must be positive"),
        (["vg-dummy", "--good", "1.0", "--bad", "1.9", "--timeout", "nan"], PROBE_LEAK, "must be positive"),
        (["vg-dummy", "--good", "1.0", "--bad", "1.9", "--timeout", "inf"], PROBE_LEAK, "must be positive"),
        # past the OS's timers: an OverflowError from subprocess before (fuzzing)
        (["vg-dummy", "--good", "1.0", "--bad", "1.9", "--index-timeout", "1e300"], PROBE_LEAK, "at most"),
        (
            ["../vg-dummy", "--good", "1.0", "--bad", "1.9", "--versions", ALL],
            PROBE_LEAK,
            "not a package name",
        ),
        (
            ["vg-dummy", "--good", "1.0", "--bad", "1.9", "--versions", ALL, "--log", "/dev/null/log.json"],
            PROBE_LEAK,
            "--log /dev/null/log.json: cannot write",
        ),
        (
            ["vg-dummy", "--good", "1.0", "--bad", "1.9", "--versions", "1.0,x,1.9"],
            PROBE_LEAK,
            "--versions: 'x' is not",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(
    capsys, wheelhouse: Path, tmp_path: Path, args, command, needle
) -> None:
    cache = tmp_path / "c"
    code, out, err = bisect(
        capsys, *args, "--find-links", str(wheelhouse), "--cache-dir", str(cache), command=command
    )
    assert_one_line_error(code, out, err, needle)
    assert not (cache / "vg-dummy").exists()  # rejected before anything was installed
    assert_cache_consistent(cache)


def test_missing_wheel_directory(capsys, tmp_path: Path) -> None:
    code, out, err = bisect(
        capsys, "vg-dummy", "--good", "1.0", "--bad", "1.9", "--find-links", str(tmp_path / "nowhere"),
        command=PROBE_LEAK,
    )  # fmt: skip
    assert_one_line_error(code, out, err, "no such directory")


def test_no_network_for_the_index(capsys, tmp_path: Path) -> None:
    # Port 9 (discard) on localhost is closed: the connection is refused at once, as with no network.
    code, out, err = bisect(
        capsys, "vg-dummy", "--good", "1.0", "--bad", "1.9", "--index-url", "http://127.0.0.1:9/simple",
        "--index-timeout", "5", "--cache-dir", str(tmp_path / "c"), command=PROBE_LEAK,
    )  # fmt: skip
    assert_one_line_error(code, out, err, "cannot reach the package index http://127.0.0.1:9/simple")
    assert_cache_consistent(tmp_path / "c")


def test_version_that_cannot_be_installed_is_an_untestable_endpoint(
    capsys, wheelhouse: Path, tmp_path: Path
) -> None:
    # An explicit list bypasses the index query; 2.0 has no wheel, so the --bad endpoint cannot be tested.
    cache = tmp_path / "c"
    code, out, err = bisect(
        capsys, "vg-dummy", "--good", "1.0", "--bad", "2.0", "--versions", "1.0,2.0", "--find-links",
        str(wheelhouse), "--cache-dir", str(cache), command=PROBE_LEAK,
    )  # fmt: skip
    assert_one_line_error(code, out, err, "--bad 2.0 cannot be tested (install failed")
    assert not (cache / "vg-dummy" / "2.0-").exists()
    assert [p.name.split("-")[0] for p in (cache / "vg-dummy").iterdir()] == ["1.0"]
    assert_cache_consistent(cache)


def test_console_entry_point_error_has_no_traceback(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vramguard", "bisect", "vg-dummy", "--good", "1.0", "--bad", "1.9"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "vramguard: error: missing COMMAND: give the probe after --, e.g. -- python -m pytest tests_grad/x.py"
    ]


# -- overlay cache and probe machinery ----------------------------------------------------------------
def pip_args(wheelhouse: Path) -> list[str]:
    return ["--no-index", "--find-links", str(wheelhouse)]


def test_overlay_records_import_name_and_lru_eviction(wheelhouse: Path, tmp_path: Path) -> None:
    cache = OverlayCache(tmp_path / "c", max_bytes=10**9)
    a = cache.get("vg-dummy", "1.0", pip_args(wheelhouse))
    assert a.installed_now and a.import_names == ("vgdummy",)  # dist vg-dummy, module vgdummy
    b = cache.get("vg-dummy", "1.1", pip_args(wheelhouse))
    os.utime(a.path / MARKER, (1, 1))  # pretend both are old, a older than b ...
    os.utime(b.path / MARKER, (2, 2))
    assert cache.lookup("vg-dummy", "1.0") is not None  # ... then use a: b is now least recently used
    size = max(s for _, _, s in cache.entries())
    cache.max_bytes = 2 * size + size // 2  # room for two entries
    c = cache.get("vg-dummy", "1.2", pip_args(wheelhouse))
    assert {p.name.split("-")[0] for p, _, _ in cache.entries()} == {"1.0", "1.2"}
    assert not b.path.exists() and c.path.exists()
    cache.max_bytes = 0  # nothing fits: the entry being used is still kept
    assert cache.evict(keep=c.path) == [a.path]
    assert [p.name.split("-")[0] for p, _, _ in cache.entries()] == ["1.2"]
    assert_cache_consistent(cache.root)


def test_failed_install_leaves_no_entry(wheelhouse: Path, tmp_path: Path) -> None:
    cache = OverlayCache(tmp_path / "c", max_bytes=10**9)
    with pytest.raises(InstallError, match="vg-dummy==7.0|No matching distribution"):
        cache.get("vg-dummy", "7.0", pip_args(wheelhouse))
    assert cache.lookup("vg-dummy", "7.0") is None and not cache.entry_dir("vg-dummy", "7.0").exists()
    assert_cache_consistent(cache.root)


def test_import_check_rejects_a_module_from_outside_the_overlay(
    wheelhouse: Path, shared_cache: Path, tmp_path: Path
) -> None:
    cache = OverlayCache(shared_cache, max_bytes=10**9)
    overlay = cache.get("vg-dummy", "1.2", pip_args(wheelhouse))
    env = probe_env(overlay.path, "vg-dummy", "1.2")
    check = [sys.executable, "-c", _IMPORT_CHECK, "vg-dummy", "1.2"]
    code, tail = run_command([*check, str(overlay.path), "vgdummy"], env, 60)
    assert code == 0, tail
    code, tail = run_command([*check, str(tmp_path), "vgdummy"], env, 60)  # claims another root
    assert code == 5 and "not from the overlay" in tail[-1]
    code, tail = run_command(
        [sys.executable, "-c", _IMPORT_CHECK, "vg-dummy", "1.1", str(overlay.path)], env, 60
    )
    assert code == 3 and "shadowed" in tail[-1]


def test_verdicts_follow_git_bisect_run() -> None:
    assert [verdict_for(c) for c in (0, 1, 2, 124, 125, 126, -9, None)] == [
        "good",
        "bad",
        "bad",
        "bad",
        "skip",
        "bad",
        "bad",
        "bad",
    ]


def test_unusable_cache_dir_from_the_environment_is_one_line(
    capsys, wheelhouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("not a folder\n")
    monkeypatch.setenv("VRAMGUARD_CACHE", str(afile))
    args = ["vg-dummy", "--good", "1.0", "--bad", "1.9", "--versions", ALL, "--find-links", str(wheelhouse)]
    code, out, err = bisect(capsys, *args, command=PROBE_LEAK)
    assert_one_line_error(code, out, err, f"overlay cache {afile}: not a directory")


@pytest.mark.parametrize("kind", ["file", "below a file", "read-only folder", "folder no one may write"])
def test_unusable_cache_dir_is_one_line_exit_2(capsys, wheelhouse: Path, tmp_path: Path, kind: str) -> None:
    needle = "cannot write there"
    if kind == "file":
        cache = tmp_path / "a-file"
        cache.write_text("not a folder\n")
        needle = "not a directory"
    elif kind == "below a file":
        (tmp_path / "a-file").write_text("not a folder\n")
        cache = tmp_path / "a-file" / "cache"
    elif kind == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into a 0o555 folder; the next case is read-only for root too")
        cache = tmp_path / "ro"
        cache.mkdir()
        cache.chmod(0o555)
    else:  # sysfs refuses new folders to everyone, root included
        cache = Path("/sys/vramguard-test-cache")
        if not Path("/sys/kernel").is_dir():
            pytest.skip("no sysfs here")
    args = ["vg-dummy", "--good", "1.0", "--bad", "1.9", "--versions", ALL, "--find-links", str(wheelhouse)]
    code, out, err = bisect(capsys, *args, "--cache-dir", str(cache), command=PROBE_LEAK)
    assert_one_line_error(code, out, err, f"--cache-dir {cache}: {needle}")


def test_output_tail_is_bounded_in_bytes(
    capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path
) -> None:
    # One 20 MB line, then 3 MB of what JSON escapes worst (control characters: 6 bytes each), then a
    # last line: the log keeps the end of the output and stays small.
    probe = [
        sys.executable,
        "-c",
        (
            "import sys, vgdummy\n"
            "sys.stdout.write('x' * 20_000_000 + '\\n' + '\\x01' * 3_000_000 + '\\nthe last line\\n')\n"
            "sys.exit(vgdummy.LEAK)"
        ),
    ]
    log = tmp_path / "log.json"
    code, _out, err = bisect_1_0_to_1_5(capsys, wheelhouse, shared_cache, log, probe)
    assert code == 0, err
    assert log.stat().st_size < 128 * 1024  # was 76 MB: both lines of both probes, escaped
    data = json.loads(log.read_text())
    assert [p["verdict"] for p in data["probes"]] == ["good", "bad"]
    for p in data["probes"]:
        assert p["output_tail"][-1] == "the last line"
        assert p["output_tail"][0].startswith("[vramguard] output cut")
        assert len(json.dumps(p["output_tail"])) <= 64 * 1024


# -- signals and killed runs --------------------------------------------------------------------------
def _running(pid: int) -> bool:
    """Whether ``pid`` still runs; a zombie does not (in a container nothing may reap an orphan)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout} s for {what}")
        time.sleep(0.05)


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


# A probe that starts a grandchild (as pytest -n or a shell would), records both pids, and hangs.
HANGING_PROBE = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def _start_bisect(tmp_path: Path, *args: str, command: list[str]) -> subprocess.Popen[bytes]:
    """``python -m vramguard bisect ...`` as a separate process (a signal to it must not reach pytest)."""
    env = dict(os.environ)
    src = str(Path(vramguard.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "vramguard", "bisect", "vg-dummy", "--good", "1.0", "--bad", "1.5"]
    argv += ["--versions", "1.0,1.5", *args, "--", *command]
    with open(tmp_path / "stdout.txt", "wb") as out, open(tmp_path / "stderr.txt", "wb") as err:
        return subprocess.Popen(argv, stdout=out, stderr=err, env=env)


def _hanging_run(tmp_path: Path, wheelhouse: Path, cache: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    script, pids_file = tmp_path / "hang.py", tmp_path / "pids"
    script.write_text(HANGING_PROBE)
    args = ["--find-links", str(wheelhouse), "--cache-dir", str(cache), "--log", str(tmp_path / "log.json")]
    proc = _start_bisect(tmp_path, *args, command=[sys.executable, str(script), str(pids_file)])
    try:  # generous: two interpreters start and a wheel is installed on a loaded machine first
        _wait_until(lambda: pids_file.exists() or proc.poll() is not None, 180, "the probe to start")
    except BaseException:
        proc.kill()
        raise
    if not pids_file.exists():
        raise AssertionError(f"bisect exited {proc.returncode}: {(tmp_path / 'stderr.txt').read_text()}")
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2 and all(_running(p) for p in pids)
    return proc, pids


def _the_next_run(capsys, wheelhouse: Path, cache: Path, tmp_path: Path) -> str:
    """A complete bisection on the cache a killed run used (log ``second.json``): it must succeed, and
    clean up after the dead one on its way. Its stderr."""
    code, _out, err = bisect_1_0_to_1_5(capsys, wheelhouse, cache, tmp_path / "second.json", PROBE_LEAK)
    assert code == 0, err
    return err


def test_sigterm_ends_the_probe_group_and_writes_the_log(
    wheelhouse: Path, shared_cache: Path, tmp_path: Path
) -> None:
    proc, pids = _hanging_run(tmp_path, wheelhouse, shared_cache)
    try:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        err = (tmp_path / "stderr.txt").read_text()
        assert code == 128 + signal.SIGTERM, err
        assert "Traceback" not in err and err.splitlines()[-1] == "vramguard: terminated by SIGTERM"
        _wait_until(lambda: not any(_running(p) for p in pids), 30, "the probe and its child to end")
    finally:
        proc.kill()
        _kill_leftovers(pids)
    data = json.loads((tmp_path / "log.json").read_text())
    assert data["status"] == "interrupted" and data["error"] == "interrupted by SIGTERM"
    assert list((shared_cache / ".runs").iterdir()) == []  # the run unregistered itself


def test_sigkill_ends_the_probe_group_and_a_later_run_marks_the_log(
    capsys, wheelhouse: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "c"
    proc, pids = _hanging_run(tmp_path, wheelhouse, cache)
    try:
        proc.kill()
        proc.wait(timeout=60)
        _wait_until(lambda: not any(_running(p) for p in pids), 30, "the orphaned probe group to be killed")
    finally:
        _kill_leftovers(pids)
    log = tmp_path / "log.json"
    assert json.loads(log.read_text())["status"] == "running"  # nobody could say otherwise yet
    err = _the_next_run(capsys, wheelhouse, cache, tmp_path)
    assert f"marked the log of a killed run: {log}" in err
    data = json.loads(log.read_text())
    assert data["status"] == "killed" and f"pid {proc.pid} " in data["error"]
    assert json.loads((tmp_path / "second.json").read_text())["status"] == "found"
    assert list((cache / ".runs").iterdir()) == []


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and _running(int(entry.name)):
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds pip through /proc")
def test_sigkill_during_an_install_kills_pip_and_the_next_run_cleans_up(
    capsys, wheelhouse: Path, tmp_path: Path
) -> None:
    # An index that accepts connections and never answers: pip hangs inside the install.
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    cache = tmp_path / "c"
    index = f"http://127.0.0.1:{server.getsockname()[1]}/simple"
    args = ["--index-url", index, "--index-timeout", "600", "--cache-dir", str(cache)]
    proc = _start_bisect(tmp_path, *args, "--log", str(tmp_path / "log.json"), command=PROBE_LEAK)
    pips: list[int] = []
    try:
        _wait_until(lambda: held or proc.poll() is not None, 180, "pip to ask the index")
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
        pips = _processes_mentioning(str(cache / ".tmp"))
        assert pips  # pip (and what runs it) install into the cache's temporary folder
        proc.kill()
        proc.wait(timeout=60)
        _wait_until(lambda: not _processes_mentioning(str(cache / ".tmp")), 30, "pip to be killed")
    finally:
        proc.kill()
        _kill_leftovers(pips)
        server.close()
        for conn in held:
            conn.close()
    assert list((cache / ".tmp").iterdir())  # what the killed install left
    _the_next_run(capsys, wheelhouse, cache, tmp_path)
    assert_cache_consistent(cache)  # no temporary folder is left


def test_a_live_install_s_temporary_folder_is_kept(wheelhouse: Path, tmp_path: Path) -> None:
    from filelock import FileLock

    cache = OverlayCache(tmp_path / "c", max_bytes=10**9)
    cache.get("vg-dummy", "1.0", pip_args(wheelhouse))
    name = f"{cache.entry_dir('vg-dummy', '1.1').parent.name}-{cache.entry_dir('vg-dummy', '1.1').name}"
    live, dead = cache.tmp / f"{name}~live0000", cache.tmp / f"{name.replace('1.1', '1.2')}~dead0000"
    for folder in (live, dead):
        (folder / "t").mkdir(parents=True)
    with FileLock(str(cache.locks / f"{name}.lock")):  # an install of 1.1 is running (in this test)
        cache.evict()
        assert live.exists() and not dead.exists()
    cache.evict()
    assert not live.exists()
    assert_cache_consistent(cache.root)


def test_only_dead_runs_logs_are_marked_killed(tmp_path: Path) -> None:
    from vramguard.bisect.run import LiveRuns

    runs = LiveRuns(tmp_path / ".runs")
    logs = {name: tmp_path / f"{name}.json" for name in ("live", "dead", "reused")}
    for name, log in logs.items():
        log.write_text(json.dumps({"status": "running", "run_id": name, "probes": []}))
    logs["reused"].write_text(json.dumps({"status": "running", "run_id": "a newer run", "probes": []}))
    with runs.register("live", logs["live"], "vg-dummy", ["true"]):
        for name in ("dead", "reused"):  # records whose lock nobody holds: their runs are gone
            info = {"run_id": name, "log": str(logs[name]), "pid": 1, "host": "h"}
            (runs.folder / f"{name}.json").write_text(json.dumps(info))
            (runs.folder / f"{name}.lock").touch()
        assert runs.mark_stale() == [logs["dead"]]
        status = {name: json.loads(log.read_text())["status"] for name, log in logs.items()}
        assert status == {"live": "running", "dead": "killed", "reused": "running"}
        assert sorted(p.name for p in runs.folder.iterdir()) == ["live.json", "live.lock"]
    assert list(runs.folder.iterdir()) == []


def test_a_repeated_signal_does_not_cut_the_clean_up_short() -> None:
    from vramguard.bisect.run import Terminated, signals_end_the_run

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be set in the main thread")  # else SIGTERM ends pytest
    before = signal.getsignal(signal.SIGTERM)
    cleaned_up = False
    with pytest.raises(Terminated, match="SIGTERM"), signals_end_the_run():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_until(lambda: False, 30, "SIGTERM to be handled")
        except Terminated:
            os.kill(os.getpid(), signal.SIGTERM)  # a second one while cleaning up: ignored
            for _ in range(50):  # bytecodes run, so a pending handler would raise here
                time.sleep(0.002)
            cleaned_up = True
            raise
    assert cleaned_up
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_unexpected_error_does_not_leave_the_log_running(
    capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vramguard.bisect.run import BisectRun

    real_probe = BisectRun.probe

    def probe(self: BisectRun, version: str):
        if self.probes:
            raise RuntimeError("the machine fell over")
        return real_probe(self, version)

    monkeypatch.setattr(BisectRun, "probe", probe)
    log = tmp_path / "log.json"
    code, _, err = bisect_1_0_to_1_5(capsys, wheelhouse, shared_cache, log, PROBE_LEAK)
    assert code == 3 and "internal error: RuntimeError: the machine fell over" in err  # a bug, not a verdict
    data = json.loads(log.read_text())
    assert data["status"] == "failed" and data["error"] == "the machine fell over"
    assert [p["version"] for p in data["probes"]] == ["1.0"]  # what it measured is kept
    assert list((shared_cache / ".runs").iterdir()) == []
