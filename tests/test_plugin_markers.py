"""The vram_budget / saved_bytes markers, judged by vramguard's pytest plugin: pass under budget,
fail over it with one line naming what was measured, the budget and the probe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

# imported once here: in-process pytester runs restore sys.modules afterwards, and importing it again
# would register its op library twice
import torch._inductor.test_operators  # noqa: F401

import vramguard
from vramguard.pytest.plugin import MARKERS, marker_help

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]

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

class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([ToyDecoderLayer(), ToyDecoderLayer()])
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

@pytest.mark.saved_bytes(max="10 MiB", per_layer="100 KiB", device="cpu")
def test_layers():
    Toy()(torch.randn(128, 128)).sum().backward()
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-rf")
    result.assert_outcomes(failed=1)
    line = _failure_line(result, "kept for backward")
    # the ledger's names (as `vramguard audit` prints them), not the class name; layers.1 keeps its tanh
    # output only (its input is layers.0's, counted there; the weight it saves is a parameter)
    assert "saved_bytes: layers.0 kept for backward 128.00 KiB" in line, line
    assert "> budget 100.00 KiB" in line and "more)" not in line, line
    assert "saved_bytes: layers.1 kept for backward: 64.00 KiB (65536 B)" in result.stdout.str()


# a tiny Qwen2 with LoRA (random weights): ops save LoRA A/B, the norm weights and the fp32 lm_head
QWEN = """
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

def qwen():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model = get_peft_model(Qwen2ForCausalLM(config), lora)
    model.train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}
"""


def test_saved_bytes_is_the_ledgers_number(pytester: pytest.Pytester) -> None:
    """A budget copied from the ledger (what `vramguard audit` prints) holds exactly under the marker."""
    from vramguard.measure.decoder import decoder_layer
    from vramguard.measure.ledger import SavedTensorLedger

    namespace: dict[str, object] = {}
    exec(QWEN, namespace)  # the same model the test file below builds
    model, batch = namespace["qwen"]()  # type: ignore[operator]
    with SavedTensorLedger(model) as ledger:
        loss = model(**batch).loss
        ledger.add_roots(loss)
    report = ledger.report
    assert report.resident and report.bytes_by("ctx") == 0  # parameters were saved by ops; all via hooks
    total = report.saved_bytes
    per_layer: dict[str, int] = {}
    for r in report.records:
        layer = decoder_layer(r.module)
        if layer is not None:
            short = layer[layer.rfind("layers.") :]
            per_layer[short] = per_layer.get(short, 0) + r.bytes
    worst = max(per_layer, key=per_layer.__getitem__)

    def run(max_: int, layer_max: int) -> pytest.RunResult:
        pytester.makepyfile(
            QWEN
            + f"""
import pytest

@pytest.mark.saved_bytes(max={max_}, per_layer={layer_max}, device="cpu")
def test_step():
    model, batch = qwen()
    model(**batch).loss.backward()
"""
        )
        return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-rf")

    run(total, per_layer[worst]).assert_outcomes(passed=1)
    result = run(total - 1, 10**9)
    result.assert_outcomes(failed=1)
    line = _failure_line(result, "saved_bytes: bytes kept for backward at once")
    assert f"({total} B) > budget" in line and "not counted" in line, line
    result = run(10**9, per_layer[worst] - 1)
    result.assert_outcomes(failed=1)
    line = _failure_line(result, f"saved_bytes: {worst} kept for backward")
    assert f"({per_layer[worst]} B) > budget" in line, line


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


def test_a_missing_size_or_an_unknown_keyword_fails_with_one_line(pytester: pytest.Pytester) -> None:
    """The marker's arguments are bound to its declaration: a typo is not silently ignored."""
    result = _run(pytester, "@pytest.mark.saved_bytes(device='cpu')")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.saved_bytes needs a size, e.g. saved_bytes('12 MiB')*"])
    result = _run(pytester, '@pytest.mark.vram_budget("4 MiB", devce="cpu")')
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.vram_budget: got an unexpected keyword argument 'devce'*"])
    assert "Traceback" not in result.stdout.str()


# --- the markers are declared once -------------------------------------------------------------------


def _registered_markers(cwd: Path) -> list[str]:
    """The ``@pytest.mark.`` lines of ``pytest --markers`` run in ``cwd`` (its ini file and the plugins
    installed, as a user sees them)."""
    src = str(Path(vramguard.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--markers", "-p", "no:randomly", "-p", "no:cacheprovider"],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if line.startswith("@pytest.mark.")]


def _name(line: str) -> str:
    return line.removeprefix("@pytest.mark.").split(":")[0].split("(")[0]


def test_each_marker_is_declared_once_with_the_help_of_its_declaration() -> None:
    """In this project (pyproject.toml's markers and every plugin) each marker has one help line, and
    vramguard's are the plugin's own: built from the functions in MARKERS."""
    lines = _registered_markers(ROOT)
    names = [_name(line) for line in lines]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    for name in MARKERS:
        assert f"@pytest.mark.{marker_help(name)}" in lines
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert [_name(m) for m in ini["markers"] if _name(m) in MARKERS] == []
    assert "slow" in names and "benchmark" in names  # the project's own, and pytest-benchmark's


def test_marker_help_is_the_declaration_s_signature_and_docstring() -> None:
    assert marker_help("gpu").startswith("gpu: needs a CUDA device")
    assert marker_help("saved_bytes").startswith("saved_bytes(max, per_layer=None, device=None): fail when")
    assert "\n" not in marker_help("vram_budget")


# --- --vram-require-gpu ------------------------------------------------------------------------------

GPU_BODY = """
import pytest

@pytest.mark.gpu
def test_on_gpu():
    pass

def test_anywhere():
    pass
"""


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_gpu_tests_without_cuda_are_skipped_and_the_run_is_green(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a mislabelled runner looks like without the option: exit 0, everything gpu skipped."""
    _no_cuda(monkeypatch)
    pytester.makepyfile(GPU_BODY)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "gpu", "-rs")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(skipped=1, deselected=1)


@pytest.mark.parametrize("marker", ["gpu", "not gpu"])
def test_require_gpu_fails_the_session_at_start_without_cuda(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, marker: str
) -> None:
    _no_cuda(monkeypatch)
    pytester.makepyfile(GPU_BODY)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", marker, "--vram-require-gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [ln for ln in result.errlines if ln.strip()]
    assert len(errors) == 1, result.errlines
    assert errors[0].startswith("ERROR: --vram-require-gpu: no usable CUDA device: torch.cuda.is_available()")
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert "passed" not in result.stdout.str() and "skipped" not in result.stdout.str()  # nothing ran


def test_require_gpu_rejects_a_visible_but_unusable_device(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.version.cuda is not None:
        pytest.skip("needs a torch built without CUDA (a visible device that cannot allocate)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # claims a device, cannot allocate
    pytester.makepyfile(GPU_BODY)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--vram-require-gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [ln for ln in result.errlines if ln.strip()]
    assert len(errors) == 1 and "a CUDA device is visible but unusable" in errors[0], result.errlines


def test_require_gpu_runs_normally_with_a_usable_device(pytester: pytest.Pytester) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytester.makepyfile(GPU_BODY)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "gpu", "--vram-require-gpu")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, deselected=1)
