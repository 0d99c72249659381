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
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from vramguard.bisect import _IMPORT_CHECK, probe_env, run_command, verdict_for
from vramguard.bisect_search import probe_bound
from vramguard.cli import main
from vramguard.overlay import MARKER, InstallError, OverlayCache

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


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
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
        capsys,
        "vg-dummy",
        "--good",
        "1.0",
        "--bad",
        "1.9",
        "--find-links",
        str(wheelhouse),
        "--cache-dir",
        str(shared_cache),
        "--log",
        str(log),
        command=PROBE_LEAK,
    )
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
        capsys,
        *args,
        "--find-links",
        str(empty),
        "--versions",
        versions,
        "--log",
        str(tmp_path / "2.json"),
        command=PROBE_LEAK,
    )
    assert code == 0, err
    second = json.loads((tmp_path / "2.json").read_text())
    assert second["installs"] == 0 and {p["overlay"] for p in second["probes"]} == {"cached"}
    assert second["result"] == first["result"] and second["result"]["first_bad"] == "1.5"
    assert sorted(p.name for p in (cache / "vg-dummy").iterdir()) == entries


def test_broken_version_is_skipped(capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    code, out, err = bisect(
        capsys,
        "vg-dummy",
        "--good",
        "1.0",
        "--bad",
        "1.5",
        "--versions",
        ALL,
        "--find-links",
        str(wheelhouse),
        "--cache-dir",
        str(shared_cache),
        "--log",
        str(log),
        command=PROBE_LEAK,
    )
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
        capsys,
        "vg-dummy",
        "--good",
        "1.0",
        "--bad",
        "1.9",
        "--versions",
        ALL,
        "--find-links",
        str(wheelhouse),
        "--cache-dir",
        str(shared_cache),
        "--log",
        str(tmp_path / "l.json"),
        command=probe,
    )
    assert code == 3, err
    result = json.loads((tmp_path / "l.json").read_text())["result"]
    assert result["first_bad"] is None and result["possible"] == ["1.3", "1.4"]
    assert result["last_good"] == "1.2" and "undetermined, one of 1.3, 1.4" in out


def test_find_fix_finds_first_good(capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    code, out, err = bisect(
        capsys,
        "vg-dummy",
        "--bad",
        "1.0",
        "--good",
        "1.9",
        "--find-fix",
        "--versions",
        ALL,
        "--find-links",
        str(wheelhouse),
        "--cache-dir",
        str(shared_cache),
        "--log",
        str(log),
        command=PROBE_FIX,
    )
    assert code == 0, err
    data = json.loads(log.read_text())
    assert data["mode"] == "find-fix"
    assert data["result"]["first_fixed"] == "1.7" and data["result"]["last_bad"] == "1.6"
    assert "first fixed version: vg-dummy 1.7" in out
    assert len(data["probes"]) <= probe_bound(10)


def test_pre_releases_only_when_asked(capsys, wheelhouse: Path, shared_cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    code, _, err = bisect(
        capsys,
        "vg-dummy",
        "--good",
        "1.6",
        "--bad",
        "1.9",
        "--pre",
        "--find-links",
        str(wheelhouse),
        "--cache-dir",
        str(shared_cache),
        "--log",
        str(log),
        command=PROBE_FIX,
    )
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
        capsys,
        "vg-dummy",
        "--good",
        good,
        "--bad",
        bad,
        "--versions",
        ALL,
        "--find-links",
        str(wheelhouse),
        "--cache-dir",
        str(shared_cache),
        "--log",
        str(log),
        command=PROBE_LEAK,
    )
    assert_one_line_error(code, out, err, needle)
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
        "5",  # generous: a good probe must finish within it even on a loaded machine
        "--find-links",
        str(wheelhouse),
        "--cache-dir",
        str(shared_cache),
        "--log",
        str(log),
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
        capsys,
        "vg-dummy",
        "--good",
        "1.0",
        "--bad",
        "1.9",
        "--find-links",
        str(tmp_path / "nowhere"),
        command=PROBE_LEAK,
    )
    assert_one_line_error(code, out, err, "no such directory")


def test_no_network_for_the_index(capsys, tmp_path: Path) -> None:
    # Port 9 (discard) on localhost is closed: the connection is refused at once, as with no network.
    code, out, err = bisect(
        capsys,
        "vg-dummy",
        "--good",
        "1.0",
        "--bad",
        "1.9",
        "--index-url",
        "http://127.0.0.1:9/simple",
        "--index-timeout",
        "5",
        "--cache-dir",
        str(tmp_path / "c"),
        command=PROBE_LEAK,
    )
    assert_one_line_error(code, out, err, "cannot reach the package index http://127.0.0.1:9/simple")
    assert_cache_consistent(tmp_path / "c")


def test_version_that_cannot_be_installed_is_an_untestable_endpoint(
    capsys, wheelhouse: Path, tmp_path: Path
) -> None:
    # An explicit list bypasses the index query; 2.0 has no wheel, so the --bad endpoint cannot be tested.
    cache = tmp_path / "c"
    code, out, err = bisect(
        capsys,
        "vg-dummy",
        "--good",
        "1.0",
        "--bad",
        "2.0",
        "--versions",
        "1.0,2.0",
        "--find-links",
        str(wheelhouse),
        "--cache-dir",
        str(cache),
        command=PROBE_LEAK,
    )
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
