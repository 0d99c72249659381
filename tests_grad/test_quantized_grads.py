"""Properties of bitsandbytes 4-bit / 8-bit linears and PEFT LoRA over them, for every patch.

Each property: outputs and gradients (input, bias, LoRA A/B, fp16 weight) match the float64 reference
within :mod:`vramguard.grad.tolerance`; output/gradient dtypes and shapes equal the input's; a patch that
claims to change memory only is bit-identical to the unpatched library. Combinations the installed
library cannot run here are skipped per example (``hypothesis.assume``) with the reason as an event.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, event, example, given

from vramguard.grad import runner as gradcheck
from vramguard.grad import strategies
from vramguard.grad.patches import Patch


def covering(cases: list[gradcheck.Case]):  # type: ignore[no-untyped-def]
    """Run every case of ``cases`` as an explicit example before the generated ones, so that each
    combination of the path-deciding axes is exercised whatever hypothesis happens to draw. A case this
    bitsandbytes cannot run here is assumed away when its example runs, as a drawn one is (hypothesis passes
    an explicit example that ``assume`` rejects), not filtered out at import: deciding it probes the kernels
    (:func:`~vramguard.grad.runner.dequantize_4bit_defect`), and bitsandbytes compiles its CPU fallback once a
    shape, so filtering at import compiled every covering shape in every xdist worker while it collected."""

    def decorate(test):  # type: ignore[no-untyped-def]
        for case in reversed(cases):
            test = example(case=case)(test)
        return test

    return decorate


def _check(case: gradcheck.Case, patch: Patch | None) -> None:
    try:
        gradcheck.check_supported(case)
    except gradcheck.Unsupported as exc:
        event(f"skipped: {exc}")
        assume(False)
    gradcheck.check(case, patch)


def _check_deterministic(case: gradcheck.Case) -> None:
    try:
        gradcheck.check_supported(case)
    except gradcheck.Unsupported as exc:
        event(f"skipped: {exc}")
        assume(False)
    gradcheck.check_deterministic(case)


@covering(strategies.covering_4bit_cases())
@given(case=strategies.linear4bit_cases())
def test_4bit_matches_reference(case: strategies.Linear4bitCase, patch: Patch | None) -> None:
    _check(case, patch)


@covering(strategies.covering_8bit_cases())
@given(case=strategies.linear8bit_cases())
def test_8bit_matches_reference(case: strategies.Linear8bitCase, patch: Patch | None) -> None:
    _check(case, patch)


@covering(strategies.covering_lora_cases())
@given(case=strategies.lora_cases())
def test_lora_matches_reference(case: strategies.LoraCase, patch: Patch | None) -> None:
    _check(case, patch)


@given(case=strategies.linear4bit_cases() | strategies.linear8bit_cases() | strategies.lora_cases())
def test_deterministic_for_fixed_seed(case: gradcheck.Case) -> None:
    _check_deterministic(case)


# --- the same properties on CUDA (deselected by default; skipped without CUDA) --------------------


@pytest.mark.gpu
@covering(strategies.covering_4bit_cases(device="cuda"))
@given(case=strategies.linear4bit_cases(device="cuda"))
def test_gpu_4bit_matches_reference(case: strategies.Linear4bitCase, patch: Patch | None) -> None:
    _check(case, patch)


@pytest.mark.gpu
@covering(strategies.covering_8bit_cases(device="cuda"))
@given(case=strategies.linear8bit_cases(device="cuda"))
def test_gpu_8bit_matches_reference(case: strategies.Linear8bitCase, patch: Patch | None) -> None:
    _check(case, patch)


@pytest.mark.gpu
@covering(strategies.covering_lora_cases(device="cuda"))
@given(case=strategies.lora_cases(device="cuda"))
def test_gpu_lora_matches_reference(case: strategies.LoraCase, patch: Patch | None) -> None:
    _check(case, patch)
