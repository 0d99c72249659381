"""pytest plugin (entry point ``pytest11``): vramguard's markers, and skipping of ``gpu`` tests without CUDA
(or, with ``--vram-require-gpu``, a session that fails at start when there is no usable CUDA device)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

# -- the markers, declared once -----------------------------------------------------------------------
# As in pytest-memray: each marker is a function whose signature is the marker's (its arguments are bound
# to it) and whose docstring is its help line; pytest_configure registers them from MARKERS, and nothing
# else declares them (the project's pyproject.toml keeps only its own `slow`; `benchmark` is
# pytest-benchmark's).


def gpu() -> None:
    """needs a CUDA device: skipped when none is available (with --vram-require-gpu the session fails at
    start instead); run with `pytest -m gpu` on a GPU machine"""


def vram_budget(max: str | int, device: str | None = None) -> None:
    """fail when the test's call phase peaks more than `max` live bytes above its start (an int or a size
    string like '1.5 GiB'; storage tracker on CPU, CUDA allocator on cuda; device: default cuda when
    available)"""


def saved_bytes(max: str | int, per_layer: str | int | None = None, device: str | None = None) -> None:
    """fail when more than `max` bytes are kept alive for backward at once during the test (saved-tensor
    hooks, per storage; parameters, buffers and quantization state are resident and not counted, as in
    the ledger and `vramguard audit`); per_layer caps any one decoder layer (named as the ledger does:
    layers.N)"""


#: vramguard's markers: name -> the function that declares it (signature and help line).
MARKERS: dict[str, Callable[..., None]] = {"gpu": gpu, "vram_budget": vram_budget, "saved_bytes": saved_bytes}


def marker_help(name: str) -> str:
    """The ``markers`` ini line of a vramguard marker, from its function: ``name(args): docstring``."""
    fn = MARKERS[name]
    params = [
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in inspect.signature(fn).parameters.values()
    ]
    signature = f"({', '.join(params)})" if params else ""
    return f"{name}{signature}: {' '.join((inspect.getdoc(fn) or '').split())}"


def marker_arguments(mark: pytest.Mark) -> dict[str, Any]:
    """The arguments a vramguard marker was given, by name, defaults filled in; a missing size or an
    unknown keyword fails the test with one line."""
    try:
        bound = inspect.signature(MARKERS[mark.name]).bind(*mark.args, **mark.kwargs)
    except TypeError as exc:
        message = f"@pytest.mark.{mark.name}: {exc}"
        if "'max'" in str(exc) and "missing" in str(exc):
            message = f"@pytest.mark.{mark.name} needs a size, e.g. {mark.name}('12 MiB')"
    else:
        bound.apply_defaults()
        return dict(bound.arguments)
    pytest.fail(message, pytrace=False)  # outside the except: no chained exception in the report


REQUIRE_GPU = "--vram-require-gpu"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--vram-require-gpu`` (a GPU CI job without a usable GPU fails instead of skipping)."""
    group = parser.getgroup("vramguard", "vramguard")
    group.addoption(
        REQUIRE_GPU,
        action="store_true",
        default=False,
        help="fail the session at start when no usable CUDA device is present (instead of skipping every "
        "gpu test): for GPU CI, so that a job on a runner without a GPU is red, not green with skips",
    )


def cuda_unusable() -> str | None:
    """Why CUDA cannot be used here (one line), or None when a device answers a small allocation."""
    import torch

    if not torch.cuda.is_available():
        built = f"with CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA"
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, built {built})"
    try:
        torch.ones(1, device="cuda").add_(1).item()
    except (RuntimeError, AssertionError) as exc:  # driver mismatch, a device in a bad state, no CUDA build
        text = " ".join(str(exc).split())
        return f"a CUDA device is visible but unusable: {type(exc).__name__}: {text[:200]}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    """Register vramguard's markers from MARKERS and, with ``--vram-require-gpu``, fail at start without a
    usable CUDA device."""
    for name in MARKERS:
        config.addinivalue_line("markers", marker_help(name))
    if config.getoption("vram_require_gpu", default=False):
        reason = cuda_unusable()
        if reason is not None:
            raise pytest.UsageError(f"{REQUIRE_GPU}: no usable CUDA device: {reason}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``gpu`` tests when CUDA is not available (torch is imported only when there is one)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:  # torch is imported only when a vramguard marker or option asks for it
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker) and none is available")
    for item in gpu:
        item.add_marker(skip)


# --- memory-budget markers (vram_budget, saved_bytes) --------------------------------------------


def _marker_size(mark: pytest.Mark, key: str) -> int | None:
    """The size argument ``key`` of a budget marker in bytes (None when not given); a bad one fails the test."""
    from vramguard.errors import UsageError
    from vramguard.units import parse_size

    value = marker_arguments(mark)[key]
    if value is None:
        if key == "max":
            pytest.fail(f"@pytest.mark.{mark.name} needs a size, e.g. {mark.name}('12 MiB')", pytrace=False)
        return None
    try:
        return parse_size(value)
    except UsageError as exc:
        message = f"@pytest.mark.{mark.name}: {exc}"
    pytest.fail(message, pytrace=False)  # outside the except: no chained exception in the report


def _marker_device(mark: pytest.Mark) -> str:
    """The device a budget marker measures (default cuda when available); a bad one fails the test."""
    import torch

    device = str(marker_arguments(mark)["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind is None:
        pytest.fail(f"@pytest.mark.{mark.name}: not a device: {device!r}", pytrace=False)
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.fail(
            f"@pytest.mark.{mark.name}: device {device!r} requested but CUDA is not available", pytrace=False
        )
    return device


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):  # type: ignore[no-untyped-def]
    """Judge ``vram_budget`` / ``saved_bytes`` over the test's own call phase (not its fixtures)."""
    vram = item.get_closest_marker("vram_budget")
    saved = item.get_closest_marker("saved_bytes")
    if vram is None and saved is None:
        return (yield)
    import contextlib

    import torch

    from vramguard.measure.meters import PeakMeter, SavedBytesMeter
    from vramguard.units import format_bytes

    checks: list[tuple[str, int, int, str]] = []  # (what, measured, limit, detail)
    with contextlib.ExitStack() as stack:
        peak = saved_meter = None
        if vram is not None:
            vram_max = _marker_size(vram, "max")
            peak = stack.enter_context(PeakMeter(_marker_device(vram)))
        if saved is not None:
            saved_max = _marker_size(saved, "max")
            layer_max = _marker_size(saved, "per_layer")
            device = torch.device(_marker_device(saved)).type
            saved_meter = stack.enter_context(SavedBytesMeter(device, per_layer=layer_max is not None))
        result = yield
    if peak is not None:
        checks.append(
            (
                "vram_budget: peak live bytes",
                peak.peak_above_start,
                vram_max,
                f"device {peak.device}, {'CUDA allocator' if peak.device.type == 'cuda' else 'storage tracker'}",
            )
        )
    if saved_meter is not None:
        largest = saved_meter.largest
        what = f"largest saved {largest[1]} {largest[2]} {largest[0]} B" if largest else "nothing saved"
        resident = sum(saved_meter.resident_saved.values())
        checks.append(
            (
                "saved_bytes: bytes kept for backward at once",
                saved_meter.peak,
                saved_max,
                f"saved-tensor hooks, the ledger's definition (parameters/quant state saved by ops: "
                f"{resident} B, not counted); {what}",
            )
        )
        if layer_max is not None:
            for layer, value in sorted(saved_meter.layer_peaks.items(), key=lambda kv: -kv[1]):
                checks.append(
                    (
                        f"saved_bytes: {layer} kept for backward",
                        value,
                        layer_max,
                        "saved-tensor hooks, per layer",
                    )
                )
    lines = [
        f"{what}: {format_bytes(v)} ({v} B), budget {format_bytes(lim)} ({lim} B) [{detail}]"
        for what, v, lim, detail in checks
    ]
    item.add_report_section("call", "vramguard budget", "\n".join(lines))
    item.user_properties.extend((what, v) for what, v, _, _ in checks)
    over = [(what, v, lim, detail) for what, v, lim, detail in checks if v > lim]
    if over:
        what, v, lim, detail = over[0]
        more = f" (+{len(over) - 1} more)" if len(over) > 1 else ""
        pytest.fail(
            f"{what} {format_bytes(v)} ({v} B) > budget {format_bytes(lim)} ({lim} B); {detail}{more}",
            pytrace=False,
        )
    return result
