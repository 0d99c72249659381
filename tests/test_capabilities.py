"""vramguard.grad.capabilities: a probe that kills its process is recorded with the signal and the other
probes still run; the K=1 int8 probe's verdict is stable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vramguard.grad import capabilities

FAKE = """
import os, signal, sys, time
from vramguard.grad import capabilities
PROBES = {
    "fine": lambda: (True, "fine"),
    "crash": lambda: os.kill(os.getpid(), signal.SIGSEGV),
    "raises": lambda: 1 / 0,
    "after": lambda: (False, "seen after the crash"),
    "slow": lambda: (time.sleep(600), (True, "too late"))[1],
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


def test_a_probe_out_of_time_is_no_verdict_and_what_needs_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe still running when its child's time runs out (a loaded machine) is tried once more, then gives
    no verdict: ``get`` raises instead of reporting a lacking capability, which tests would skip. The probes
    after it still run. (Under a load of 12-18 on 2 cores one probe once took over 180 s: five tests of the
    0.49.2 matrix were skipped as "lacks blocksize_remainder_cpu".)"""
    (tmp_path / "fakeprobes.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    # 2 s, waited twice: "fine" and the child's start (stdlib and vramguard.grad.capabilities: ~0.1 s) fit
    # many times over (a first child out of time retries "fine" in another); "slow" never does (sleeps 600 s)
    got = capabilities.run_probes(["fine", "slow", "after"], timeout=2, module="fakeprobes")
    assert got["fine"].ok and not got["after"] and got["after"].detail == "seen after the crash"
    assert got["slow"].timed_out and not got["slow"] and "twice" in got["slow"].detail
    monkeypatch.setattr(capabilities, "probe_all", lambda: got)
    with pytest.raises(capabilities.ProbeUndecided, match="probe slow: the probe did not finish"):
        capabilities.get("slow")
    assert capabilities.get("fine").ok


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU model is read from /proc/cpuinfo")
def test_int8_k1_probe_is_stable_and_names_the_cpu() -> None:
    verdicts = {capabilities.probe_int8_k1_cpu() for _ in range(20)}
    assert len({ok for ok, _ in verdicts}) == 1, verdicts
    ok, detail = next(iter(verdicts))
    import torch

    assert torch.backends.cpu.get_cpu_capability() in detail
    assert ok == capabilities.get("defect:int8_k1_cpu").ok  # the session's (child process) verdict agrees


def test_fp4_code_probe_finds_one_wrong_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe sees a kernel that stores one element as a code other than the nearest (as 0.47-0.49.2's
    CPU kernels do near the midpoints between codes): here one nibble is changed after quantizing."""
    import bitsandbytes.functional as bnbF

    real = bnbF.quantize_4bit

    def one_wrong(w, **kw):  # type: ignore[no-untyped-def]
        packed, qs = real(w, **kw)
        flat = packed.view(-1).view(torch.uint8)
        flat[7] ^= 0x10  # the high nibble of byte 7: element 14
        return packed, qs

    assert capabilities.probe_fp4_codes_cpu()[0] == capabilities.get("defect:fp4_codes_cpu").ok
    monkeypatch.setattr(bnbF, "quantize_4bit", one_wrong)
    ok, detail = capabilities.probe_fp4_codes_cpu()
    assert not ok and "element 14 " in detail and capabilities.cpu_description() in detail


def test_kn_one_row_probe_finds_a_failing_inference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import bitsandbytes as bnb

    real = bnb.matmul_4bit

    def fails_on_one_row(x, w, quant_state=None, **kw):  # type: ignore[no-untyped-def]
        if x.numel() == x.shape[-1] and not x.requires_grad:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (1x32 and 1x32)")
        return real(x, w, quant_state=quant_state, **kw)

    monkeypatch.setattr(bnb, "matmul_4bit", fails_on_one_row)
    ok, detail = capabilities.probe_kn_one_row()
    assert not ok and "mat1 and mat2" in detail


def test_the_property_cases_of_a_probed_defect_are_skipped_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a probe finds a defect, the cases it covers are known-defect skips, named, never failures."""
    from vramguard.grad import runner, strategies

    real = capabilities.get
    fake = {
        "defect:fp4_codes_cpu": capabilities.Probe("defect:fp4_codes_cpu", False, "wrong codes here"),
        "defect:kn_one_row": capabilities.Probe("defect:kn_one_row", False, "gemv fails here"),
    }
    monkeypatch.setattr(runner, "_cap", lambda name: fake[name] if name in fake else real(name))
    base = {
        "lead": (1,),
        "in_features": 32,
        "out_features": 1,
        "blocksize": 32,
        "dtype": torch.float32,
        "compress_statistics": False,
        "bias": False,
        "input_requires_grad": False,
        "seed": 0,
        "device": "cpu",
    }
    kn = strategies.Linear4bitCase(quant_type="nf4", call="functional_kn", **base)
    fp4 = strategies.Linear4bitCase(quant_type="fp4", call="functional_t", **base)
    for case, reason in ((kn, runner.KNOWN_DEFECT_KN_ONE_ROW), (fp4, runner.KNOWN_DEFECT_FP4_CODES)):
        with pytest.raises(runner.Unsupported, match="known bitsandbytes defect") as info:
            runner.check_supported(case)
        assert reason in str(info.value)
    runner.check_supported(
        strategies.Linear4bitCase(
            quant_type="nf4", call="functional_kn", **{**base, "input_requires_grad": True}
        )
    )


def test_partial_block_probe_finds_a_kernel_that_divides_in_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantizer that divides the last, partial block by its absmax in bfloat16 before choosing the
    nearest code (0.47-0.49's CPU path) is seen; the exact division is not. The fake kernel is written here
    from the format, so the probe's verdict does not rest on the installed release."""
    import bitsandbytes.functional as bnbF

    from vramguard.grad import reference

    table = torch.tensor(reference.NF4_CODE)
    real = bnbF.quantize_4bit

    def quantize(w, in_dtype: bool, **kw):  # type: ignore[no-untyped-def]
        packed, qs = real(w, **kw)
        flat = w.reshape(-1)
        bs = kw.get("blocksize", 64)
        rest = flat.numel() % bs
        last = flat[flat.numel() - rest :]
        scaled = (last / last.abs().max()) if in_dtype else (last.double() / last.abs().max().double())
        codes = (scaled.double().unsqueeze(1) - table.double()).abs().argmin(1)
        nib = packed.view(-1).view(torch.uint8)
        for j, code in enumerate(codes.tolist()):
            i = flat.numel() - rest + j
            byte, high = divmod(i, 2)
            nib[byte] = (nib[byte] & 0x0F) | (code << 4) if high == 0 else (nib[byte] & 0xF0) | code
        return packed, qs

    monkeypatch.setattr(bnbF, "quantize_4bit", lambda w, **kw: quantize(w, False, **kw))
    ok, detail = capabilities.probe_partial_block_16bit()
    assert ok, detail
    monkeypatch.setattr(bnbF, "quantize_4bit", lambda w, **kw: quantize(w, True, **kw))
    ok, detail = capabilities.probe_partial_block_16bit()
    assert not ok and "4-bit codes" in detail
    assert reference.partial_block_rounding_hits(capabilities.partial_block_traps(), 64, "nf4")


def test_dynamic_map_probe_finds_a_kernel_that_overwrites_the_map(monkeypatch: pytest.MonkeyPatch) -> None:
    """A blockwise kernel that writes code[0] = -1 into the map it is given (0.46-0.49 on CPU) is seen."""
    import bitsandbytes  # noqa: F401

    real = torch.ops.bitsandbytes.quantize_blockwise.default

    class Ops:
        class quantize_blockwise:  # mirrors torch.ops.bitsandbytes.quantize_blockwise
            @staticmethod
            def default(a, code, blocksize):  # type: ignore[no-untyped-def]
                code[0] = -1.0
                return real(a, code, blocksize)

    ok, _ = capabilities.probe_dynamic_map_cpu()
    assert ok == capabilities.get("defect:dynamic_map_cpu").ok
    monkeypatch.setattr(torch.ops, "bitsandbytes", Ops)
    ok, detail = capabilities.probe_dynamic_map_cpu()
    assert not ok and "overwrites code[0]" in detail


def test_nested_and_partial_block_cases_are_skipped_only_where_their_data_hits_the_defect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the defect probed present, a case is a known-defect skip only when its own weight triggers it
    (an element of a bf16 partial block that the bf16 division moves to another code; a block scale in
    the band where the overwritten map changes the nested code); other cases still run."""
    from vramguard.grad import reference, runner, strategies

    real = capabilities.get
    fake = {
        "defect:partial_block_16bit": capabilities.Probe(
            "defect:partial_block_16bit", False, "bf16 division"
        ),
        "defect:dynamic_map_cpu": capabilities.Probe("defect:dynamic_map_cpu", False, "map overwritten"),
    }
    monkeypatch.setattr(runner, "_cap", lambda name: fake[name] if name in fake else real(name))

    def case(
        seed: int, dtype: torch.dtype, k: int, n: int, bs: int, nested: bool
    ) -> strategies.Linear4bitCase:
        return strategies.Linear4bitCase((1,), k, n, bs, dtype, "nf4", nested, False, "module", False, seed)

    hits = {True: None, False: None}
    for seed in range(400):
        c = case(seed, torch.bfloat16, 6, 7, 32, False)
        hit = reference.partial_block_rounding_hits(runner._inputs(c)["weight"], 32, "nf4")
        hits.setdefault(hit, c)
        hits[hit] = hits[hit] or c
    assert hits[True] is not None and hits[False] is not None
    with pytest.raises(runner.Unsupported, match="partial block"):
        runner.check_supported(hits[True])
    runner.check_supported(hits[False])

    lo, hi = reference.dynamic_most_negative_band()
    band = {True: None, False: None}
    for seed in range(2000):
        c = case(seed, torch.float16, 42, 33, 64, True)
        _, _, pos = reference.nested_statistics(runner._inputs(c)["weight"], 64)
        inside = bool(((pos > lo) & (pos < hi)).any())
        band[inside] = band[inside] or c
        if all(band.values()):
            break
    assert band[True] is not None and band[False] is not None
    with pytest.raises(runner.Unsupported, match="code\\[0\\] = -1"):
        runner.check_supported(band[True])
    runner.check_supported(band[False])


def test_the_defect_trigger_reads_the_layout_the_case_quantizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The [K, N] form quantizes the transposed weight, whose partial last block holds other elements: the
    nightly profile drew W(4,146) bf16 bs=32 seed 0, whose [N, K] layout does not trigger the 16-bit
    partial-block defect and whose [K, N] layout does."""
    from vramguard.grad import reference, runner, strategies

    real = capabilities.get
    fake = {"defect:partial_block_16bit": capabilities.Probe("defect:partial_block_16bit", False, "16-bit")}
    monkeypatch.setattr(runner, "_cap", lambda name: fake[name] if name in fake else real(name))
    case = strategies.Linear4bitCase(
        (1,), 146, 4, 32, torch.bfloat16, "nf4", False, False, "functional_kn", False, 0
    )
    w = runner._inputs(case)["weight"]
    assert not reference.partial_block_rounding_hits(w, 32, "nf4")
    assert reference.partial_block_rounding_hits(w.T.contiguous(), 32, "nf4")
    with pytest.raises(runner.Unsupported, match="partial block"):
        runner.check_supported(case)


def test_a_one_byte_kn_weight_is_the_known_defect_with_an_empty_input_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The [K, N] form of a 2-element weight fails on an empty input as on any other ("0x1 and 2x1"; the
    nightly profile drew it on 0.50.2): the case is the known defect's skip, not a failure."""
    from vramguard.grad import runner, strategies

    real = capabilities.get
    fake = {"defect:one_byte_weight": capabilities.Probe("defect:one_byte_weight", False, "transposed")}
    monkeypatch.setattr(runner, "_cap", lambda name: fake[name] if name in fake else real(name))
    for lead in ((0,), (1,)):
        case = strategies.Linear4bitCase(
            lead, 1, 2, 32, torch.float16, "nf4", False, False, "functional_kn", False, 0
        )
        with pytest.raises(runner.Unsupported, match="2 elements packs to"):
            runner.check_supported(case)
