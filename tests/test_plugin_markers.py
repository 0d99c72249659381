"""The vram_budget / saved_bytes markers, judged by vramguard's pytest plugin: pass under budget,
fail over it with one line naming what was measured, the budget and the probe."""

from __future__ import annotations

import pytest
import torch

# imported once here: in-process pytester runs restore sys.modules afterwards, and importing it again
# would register its op library twice
import torch._inductor.test_operators  # noqa: F401

pytest_plugins = ["pytester"]

BODY = """
import pytest, torch

def work(n):
    w = torch.nn.Parameter(torch.randn(n, n))   # created in the test: counts as live
    x = torch.randn(64, n)
    y = torch.tanh(x @ w)                        # tanh keeps its fp32 output (64*n*4 B) for backward
    y.sum().backward()
"""


def _failure_line(result: pytest.RunResult, needle: str) -> str:
    """The failure message: one line, whole (the FAILED summary line is cut to the terminal width)."""
    lines = [
        ln for ln in result.outlines if needle in ln and "> budget" in ln and not ln.startswith("FAILED")
    ]
    assert len(lines) == 1, result.outlines
    return lines[0]


def _run(pytester: pytest.Pytester, marker: str, n: int = 256) -> pytest.RunResult:
    pytester.makepyfile(BODY + f"\n{marker}\ndef test_it():\n    work({n})\n")
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly", "-q", "-rf")


def test_vram_budget_passes_under(pytester: pytest.Pytester) -> None:
    # n=256: w 256 KiB, x 64 KiB, x@w and tanh 64 KiB each, grads: ~0.6 MiB peak
    _run(pytester, '@pytest.mark.vram_budget("4 MiB", device="cpu")').assert_outcomes(passed=1)


def test_vram_budget_fails_over_with_one_line(pytester: pytest.Pytester) -> None:
    result = _run(pytester, '@pytest.mark.vram_budget("100 KiB", device="cpu")')
    result.assert_outcomes(failed=1)
    line = _failure_line(result, "vram_budget: peak live bytes")
    assert "> budget 100.00 KiB (102400 B)" in line and "storage tracker" in line


def test_saved_bytes_exact_boundary(pytester: pytest.Pytester) -> None:
    # tanh keeps its output, 64 x 256 fp32 = 65536 B; matmul with requires-grad w keeps x (65536 B):
    # at most 131072 B are saved at once
    _run(pytester, '@pytest.mark.saved_bytes(max="128 KiB", device="cpu")').assert_outcomes(passed=1)
    result = _run(pytester, '@pytest.mark.saved_bytes(max=131071, device="cpu")')
    result.assert_outcomes(failed=1)
    line = _failure_line(result, "saved_bytes: bytes kept for backward at once")
    assert "128.00 KiB (131072 B) > budget 128.00 KiB (131071 B)" in line
    assert "saved-tensor hooks" in line


def test_saved_bytes_per_layer(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
import pytest, torch

class ToyDecoderLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(128, 128)
    def forward(self, x):
        return torch.tanh(self.lin(x))     # keeps x (64 KiB) and the tanh output (64 KiB)

@pytest.mark.saved_bytes(max="10 MiB", per_layer="100 KiB", device="cpu")
def test_layers():
    m = ToyModel()
    m(torch.randn(128, 128)).sum().backward()

class ToyModel(torch.nn.Module):  # decoder layers are elements of a ModuleList called `layers`
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([ToyDecoderLayer(), ToyDecoderLayer()])
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-rf")
    result.assert_outcomes(failed=1)
    line = _failure_line(result, "kept for backward")
    assert "layers.0" in line and "> budget 100.00 KiB" in line and "(+1 more)" in line


def test_bad_size_fails_with_one_line(pytester: pytest.Pytester) -> None:
    result = _run(pytester, '@pytest.mark.vram_budget("lots")')
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["@pytest.mark.vram_budget: not a size: 'lots'*"])
    assert "During handling" not in result.stdout.str()  # one line, no chained exception


@pytest.mark.parametrize(
    ("device", "message"),
    [("bogus", "not a device: 'bogus'"), ("cuda:0", "device 'cuda:0' requested but CUDA is not available")],
)
def test_bad_device_fails_with_one_line(pytester: pytest.Pytester, device: str, message: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        device, message = "bogus", "not a device: 'bogus'"
    for marker in (
        f'vram_budget("4 MiB", device="{device}")',
        f'saved_bytes(max="4 MiB", device="{device}")',
    ):
        result = _run(pytester, f"@pytest.mark.{marker}")
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines([f"@pytest.mark.*: {message}"])
        assert "Traceback" not in result.stdout.str() and "Error:" not in result.stdout.str()
