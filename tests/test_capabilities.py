"""vramguard.grad.capabilities: a probe that kills its process is recorded with the signal and the other
probes still run; the K=1 int8 probe's verdict is stable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vramguard.grad import capabilities

FAKE = """
import os, signal, sys
from vramguard.grad import capabilities
PROBES = {
    "fine": lambda: (True, "fine"),
    "crash": lambda: os.kill(os.getpid(), signal.SIGSEGV),
    "raises": lambda: 1 / 0,
    "after": lambda: (False, "seen after the crash"),
}
capabilities._child(sys.argv[1:], PROBES)
"""


def test_a_crashing_probe_is_a_failed_probe_and_the_rest_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fakeprobes.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    got = capabilities.run_probes(["fine", "crash", "raises", "after"], timeout=60, module="fakeprobes")
    assert got["fine"].ok and got["fine"].detail == "fine"
    assert not got["crash"] and "killed by SIGSEGV" in got["crash"].detail
    assert not got["raises"] and got["raises"].detail.startswith("ZeroDivisionError")
    assert not got["after"] and got["after"].detail == "seen after the crash"


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU model is read from /proc/cpuinfo")
def test_int8_k1_probe_is_stable_and_names_the_cpu() -> None:
    verdicts = {capabilities.probe_int8_k1_cpu() for _ in range(20)}
    assert len({ok for ok, _ in verdicts}) == 1, verdicts
    ok, detail = next(iter(verdicts))
    import torch

    assert torch.backends.cpu.get_cpu_capability() in detail
    assert ok == capabilities.get("defect:int8_k1_cpu").ok  # the session's (child process) verdict agrees
