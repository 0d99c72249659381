"""What the installed bitsandbytes can do on this machine, and which of its known defects reproduce here.

Why: the suites promise a true verdict on every release from ``bitsandbytes>=0.46`` on, and on every
CPU. Version strings cannot say that fp4 exists on CPU, which weight orientation ``matmul_4bit`` takes,
or that the int8 CPU matmul with one input feature returns uninitialised memory on *this* processor
(it depends on the ISA torch dispatches to). So each capability and each defect is *probed*: a tiny,
exact computation with the installed library, compared with a float64 / int64 reference.

The probes run in a child process (``python -m vramguard.grad.capabilities``) that prints one JSON line per
probe. A probe that kills the child (the 0.47/0.48 CPU ``quantize_blockwise`` segfault) is recorded with
its signal and the child is restarted for the remaining probes, so a native crash can never take the
calling process (a pytest session) down. :func:`probe_all` is cached: once per process.

Core module: no pytest, no rich.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

#: one line per probe result in the child's stdout
_PREFIX = "VRAMGUARD-PROBE "
PROBE_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Probe:
    """One probe's verdict: ``ok`` (the capability is there / the behaviour is correct) and what was seen.
    ``timed_out``: no verdict at all (the probe did not finish in time, twice): :func:`get` raises
    :class:`ProbeUndecided` for it, so what depends on it fails instead of being skipped as a lacking
    capability (a slow, loaded machine is no property of the library)."""

    name: str
    ok: bool
    detail: str = ""
    timed_out: bool = False

    def __bool__(self) -> bool:
        return self.ok


# --- the probes (run in the child) ------------------------------------------------------------------


def _err(exc: BaseException) -> str:
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {line[:240]}"


def _quiet() -> None:
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def _q4(w, **kw):  # type: ignore[no-untyped-def]
    import bitsandbytes.functional as bnbF

    return bnbF.quantize_4bit(w, **{"blocksize": 64, "quant_type": "nf4", **kw})


def probe_fp4_cpu() -> tuple[bool, str]:
    """Whether bitsandbytes can quantize to fp4 on the CPU (the fp4 cases are skipped when not)."""
    import torch

    _q4(torch.randn(4, 64), quant_type="fp4")
    return True, "quantize_4bit(quant_type='fp4') works on CPU"


def probe_blocksize_remainder_cpu() -> tuple[bool, str]:
    """Whether 4-bit quantization works on CPU when the tensor's size is not a multiple of the blocksize."""
    import torch

    _q4(torch.randn(2, 40))  # 80 elements, blocksize 64
    return True, "4-bit quantization of a tensor whose size is not a multiple of the blocksize works on CPU"


def probe_quant_storage_cpu() -> tuple[bool, str]:
    """Whether 4-bit weights packed into a bfloat16 ``quant_storage`` dequantize on CPU."""
    import bitsandbytes.functional as bnbF
    import torch

    w = torch.randn(4, 64)
    packed, qs = _q4(w, quant_storage=torch.bfloat16)
    bnbF.dequantize_4bit(packed, qs)
    return True, "4-bit weights stored as bfloat16 (quant_storage) dequantize on CPU"


def _form_result(form: str):  # type: ignore[no-untyped-def]
    """Output of matmul_4bit in call form ``form`` and the float64 reference on its dequantized weight."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF
    import torch

    gen = torch.Generator().manual_seed(0)
    n, k = 4, 64
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(3, k, generator=gen)
    src = w.T.contiguous() if form == "functional_kn" else w
    packed, qs = _q4(src)
    w_dq = bnbF.dequantize_4bit(packed, qs).double()
    if form == "functional_kn":
        w_dq = w_dq.T
    arg = packed.t() if form == "functional_t" else packed
    y = bnb.matmul_4bit(x, arg, quant_state=qs)
    return y, x.double() @ w_dq.T


def _probe_form(form: str, text: str) -> tuple[bool, str]:
    import torch

    y, ref = _form_result(form)
    if tuple(y.shape) != tuple(ref.shape):
        return False, f"{text} gives shape {tuple(y.shape)}, want {tuple(ref.shape)}"
    if not torch.allclose(y.double(), ref, rtol=1e-3, atol=1e-3):
        return False, f"{text} computes a different product than x @ W.T"
    return True, f"{text} computes x @ W.T"


def probe_matmul_4bit_plain() -> tuple[bool, str]:
    """Whether ``matmul_4bit`` with the packed weight as stored computes ``x @ W.T``."""
    return _probe_form("functional", "matmul_4bit(x, W, quant_state) with W packed as stored")


def probe_matmul_4bit_t() -> tuple[bool, str]:
    """Whether ``matmul_4bit`` with the transposed packed weight (``W.t()``, as ``Linear4bit`` passes it)
    computes ``x @ W.T``."""
    return _probe_form("functional_t", "matmul_4bit(x, W.t(), quant_state)")


def probe_matmul_4bit_kn() -> tuple[bool, str]:
    """Whether ``matmul_4bit`` with a weight quantized in [K, N] layout computes ``x @ W``."""
    return _probe_form("functional_kn", "matmul_4bit(x, W, quant_state) with W quantized from [K, N]")


def probe_cpu_8bit_training_path() -> tuple[bool, str]:
    """ok: CPU training of an 8-bit weight runs MatMul8bitFp (dequantize + float matmul)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF
    import torch

    state = bnb.MatmulLtState()
    state.is_training = True
    cb, scb, _ = bnbF.int8_vectorwise_quant(torch.randn(4, 8).half())
    state.CB, state.SCB = cb, scb
    y = bnb.matmul(torch.randn(2, 8, requires_grad=True), cb, state=state)
    name = type(y.grad_fn).__name__
    return "MatMul8bitFp" in name, f"CPU training of an 8-bit layer runs {name.removesuffix('Backward')}"


def probe_transformers_4bit() -> tuple[bool, str]:
    """Whether the installed transformers accepts the installed bitsandbytes for 4-bit models (and the minimum
    it wants when not)."""
    import bitsandbytes as bnb
    import transformers
    from transformers.utils import import_utils

    need = getattr(import_utils, "BITSANDBYTES_MIN_VERSION", None)
    ok = bool(import_utils.is_bitsandbytes_available())
    text = f"transformers {transformers.__version__} {'loads' if ok else 'refuses'} 4-bit models with bitsandbytes {bnb.__version__}"
    return ok, text + (f" (needs >= {need})" if need and not ok else "")


# defects: ok = the behaviour is correct here (the defect does not reproduce)


def probe_odd_numel_4bit() -> tuple[bool, str]:
    """Whether a tensor with an odd number of elements (the last byte half full) can be quantized to 4 bits."""
    import torch

    w = torch.randn(3, 5)  # 15 four-bit codes: the last byte is half full
    try:
        packed, _ = _q4(w)
    except RuntimeError as exc:
        return False, f"quantize_4bit of 15 elements raises {_err(exc)}"
    return True, f"quantize_4bit of 15 elements packs to {tuple(packed.shape)}"


def probe_nested_single_block() -> tuple[bool, str]:
    """Nested statistics of a weight with ONE 4-bit block: absmax - mean(absmax) is all zeros, and the
    CPU quantize_blockwise of an all-zero tensor crashes on 0.47/0.48 (this probe may kill the child)."""
    import bitsandbytes.functional as bnbF
    import torch

    w = torch.randn(1, 64)
    packed, qs = _q4(w, compress_statistics=True)
    w_dq = bnbF.dequantize_4bit(packed, qs)
    if not torch.isfinite(w_dq).all():
        return False, "nested statistics of a one-block weight dequantize to non-finite values"
    return True, "nested statistics of a one-block weight quantize and dequantize"


def probe_one_byte_weight() -> tuple[bool, str]:
    """Whether dequantizing a weight packed into a single byte returns the quantized shape."""
    import bitsandbytes.functional as bnbF
    import torch

    w = torch.tensor([[0.25, -0.5]])
    packed, qs = _q4(w)
    got = tuple(bnbF.dequantize_4bit(packed, qs).shape)
    if got != tuple(qs.shape):
        return False, f"dequantize_4bit of a [1, 1] packed weight returns {got}, want {tuple(qs.shape)}"
    return True, "dequantize_4bit of a one-byte packed weight has the quantized shape"


def probe_one_byte_backward() -> tuple[bool, str]:
    """Whether ``matmul_4bit`` can backpropagate through a weight packed into a single byte."""
    import bitsandbytes as bnb
    import torch

    packed, qs = _q4(torch.tensor([[0.25, -0.5]]))
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]], requires_grad=True)
    y = bnb.matmul_4bit(x, packed, quant_state=qs)  # [1, 1]: the plain and the .t() form are the same
    try:
        y.backward(torch.ones_like(y))
    except RuntimeError as exc:
        return False, f"MatMul4Bit.backward with a one-byte packed weight raises {_err(exc)}"
    return True, "MatMul4Bit.backward with a one-byte packed weight runs"


def probe_8bit_fp_3d_backward() -> tuple[bool, str]:
    """Whether the 8-bit matmul with fp16 weights backpropagates a 3-d (batch, sequence, features) input."""
    import bitsandbytes as bnb
    import torch

    state = bnb.MatmulLtState()
    state.has_fp16_weights = True
    state.is_training = True
    w = torch.randn(4, 8, requires_grad=True)
    x = torch.randn(2, 3, 8, requires_grad=True)
    y = bnb.matmul(x, w, state=state)
    if "MatMul8bitFp" not in type(y.grad_fn).__name__:
        return True, f"not reached: CPU training runs {type(y.grad_fn).__name__}"
    try:
        y.backward(torch.ones(2, 3, 4))
    except RuntimeError as exc:
        return False, f"MatMul8bitFp.backward of a 3-D input raises {_err(exc)}"
    return True, "MatMul8bitFp.backward handles a 3-D input"


def probe_kn_one_row() -> tuple[bool, str]:
    """Whether ``matmul_4bit`` in the [K, N] form computes ``x @ W`` for a one-row input that needs no
    gradient: the inference path (``gemv_4bit``) that bitsandbytes takes when ``x.numel() == x.shape[-1]``
    and ``x.requires_grad`` is False. The property tests draw such inputs in every call form."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF
    import torch

    gen = torch.Generator().manual_seed(3)
    bad = []
    for k, n in ((32, 1), (64, 3)):
        w = torch.randn(k, n, generator=gen)  # [K, N], the deprecated orientation
        x = torch.randn(1, k, generator=gen)
        packed, qs = bnbF.quantize_4bit(w, blocksize=32, quant_type="nf4")
        want = x.double() @ bnbF.dequantize_4bit(packed, qs).double()
        try:
            y = bnb.matmul_4bit(x, packed, quant_state=qs)
        except RuntimeError as exc:
            bad.append(f"W[{k},{n}]: {_err(exc)}")
            continue
        if tuple(y.shape) != tuple(want.shape) or not torch.allclose(y.double(), want, rtol=1e-3, atol=1e-3):
            bad.append(f"W[{k},{n}]: a different product than x @ W")
    if bad:
        return False, "matmul_4bit(x[1, K], W[K, N]) without grad (gemv_4bit) fails: " + "; ".join(bad)
    return True, "matmul_4bit(x[1, K], W[K, N]) without grad (gemv_4bit) computes x @ W"


#: (shape, dtype, blocksize) of the fp4 code probe: the property tests' shapes (W(38, 256) is the case
#: seen wrong on an AMX Xeon), each input dtype, and the blocksizes the strategies draw
_FP4_CODE_CASES = (
    ((38, 256), "float32", 64),
    ((96, 160), "float32", 32),
    ((64, 128), "bfloat16", 64),
    ((64, 128), "float16", 128),
    ((256, 256), "float32", 256),
)


def probe_fp4_codes_cpu() -> tuple[bool, str]:
    """Whether the CPU ``quantize_4bit`` stores every element as its *nearest* fp4 code (checked by
    :func:`vramguard.grad.reference.check_4bit_quantization`, which reads no bitsandbytes state but the
    codes and scales it produced). Some CPU kernels round wrongly on some processors (0.49.2 on an
    AVX-512/AMX Intel Xeon: 2 of 9,728 elements stored as the subnormal code 0.0052 instead of 0.1667)."""
    import torch

    from vramguard.grad import reference

    where = cpu_description()
    gen = torch.Generator().manual_seed(54256)
    for shape, dtype, blocksize in _FP4_CODE_CASES:
        w = torch.randn(shape, generator=gen).to(getattr(torch, dtype))
        packed, qs = _q4(w, quant_type="fp4", blocksize=blocksize)
        try:
            reference.check_4bit_quantization(w, packed, qs.absmax, blocksize, "fp4", nested=False)
        except reference.StateMismatch as exc:
            return (
                False,
                f"CPU quantize_4bit(fp4) of a {dtype} {shape[0]}x{shape[1]} weight on this CPU ({where}): {exc}",
            )
    return True, f"CPU quantize_4bit(fp4) stores the nearest code on this CPU ({where})"


def partial_block_traps(blocksize: int = 64, dtype: str = "bfloat16") -> torch.Tensor:  # type: ignore[name-defined]  # noqa: F821
    """A 16-bit weight of one whole block and one half block whose last block holds its absmax (1.3) and
    elements whose nf4 code differs when ``w / absmax`` is rounded to ``dtype`` before the nearest code is
    chosen: a kernel that divides in the weight's dtype stores them as the farther code. Deterministic."""
    import torch

    from vramguard.grad import reference

    dt = getattr(torch, dtype)
    table = torch.tensor(reference.NF4_CODE, dtype=torch.float64)
    absmax = torch.tensor(1.3, dtype=dt)
    # every value of the dtype in (-absmax, absmax): the bit patterns of the positive ones, both signs
    bits = torch.arange(0, int(absmax.view(torch.int16)), dtype=torch.int16)
    pos = bits.view(dt)
    cand = torch.cat([pos, -pos])
    exact = (cand.double() / absmax.double()).unsqueeze(1)
    in_dtype = (cand / absmax).double().unsqueeze(1)
    traps = cand[(exact - table).abs().argmin(1) != (in_dtype - table).abs().argmin(1)]
    half = blocksize // 2
    last = torch.cat([absmax.reshape(1), traps[: half - 1]])
    last = torch.nn.functional.pad(last, (0, half - last.numel()))
    first = torch.linspace(-1, 1, blocksize).to(dt)
    return torch.cat([first, last])


def probe_partial_block_16bit() -> tuple[bool, str]:
    """Whether the CPU ``quantize_4bit`` of a bfloat16 or float16 weight stores every element of the last,
    partial block as its nearest nf4 code (0.47-0.49's CPU path divides that block by its absmax in the
    weight's own dtype, so elements near a midpoint between two codes take the farther one)."""
    from vramguard.grad import reference

    for dtype in ("bfloat16", "float16"):
        w = partial_block_traps(64, dtype)
        packed, qs = _q4(w.reshape(1, -1))
        try:
            reference.check_4bit_quantization(w, packed, qs.absmax, 64, "nf4", nested=False)
        except reference.StateMismatch as exc:
            return False, f"CPU quantize_4bit(nf4) of a {dtype} weight whose last block is partial: {exc}"
    return True, "CPU quantize_4bit(nf4) stores the nearest code in a 16-bit weight's partial last block"


def probe_dynamic_map_cpu() -> tuple[bool, str]:
    """Whether the CPU ``quantize_blockwise`` kernel (the 8-bit dynamic map that stores nested 4-bit
    statistics) leaves the code map it is given unchanged and stores each value as its nearest code.
    0.46-0.49 write ``code[0] = -1`` into the caller's map (bitsandbytes' shared default map, in place):
    the most negative code becomes -1 instead of -0.99297, and every value in (-0.99648, -0.98594) of its
    block's absmax -- nearest to -0.99297 -- is stored as -1 or -0.97891."""
    import bitsandbytes  # noqa: F401  (registers the torch.ops.bitsandbytes kernels)
    import torch

    from vramguard.grad import reference

    code = torch.tensor(reference.DYNAMIC_CODE, dtype=torch.float32)
    given = code.clone()
    lo, hi = reference.dynamic_most_negative_band()
    inside = torch.linspace(lo, hi, 34, dtype=torch.float64)[1:-1].to(torch.float32)
    x = torch.nn.functional.pad(torch.cat([torch.tensor([1.0]), inside]), (0, 256 - 33))
    q, _ = torch.ops.bitsandbytes.quantize_blockwise.default(x, code, 256)
    problems = []
    if not torch.equal(code, given):
        i = int((code != given).nonzero()[0])
        problems.append(
            f"it overwrites code[{i}] of the map it is given ({given[i].item():.5f} -> {code[i].item():.5f})"
        )
    got = given.double()[q.long()[1:33]]
    wrong = (got - reference.DYNAMIC_CODE[0]).abs() > 1e-9
    if wrong.any():
        i = int(wrong.nonzero()[0])
        problems.append(
            f"it stores {inside[i].item():.5f} (of absmax 1) as code {got[i].item():.5f}, the nearest is "
            f"{reference.DYNAMIC_CODE[0]:.5f} ({int(wrong.sum())} of 32 values in the band)"
        )
    if problems:
        return False, "CPU quantize_blockwise: " + "; ".join(problems)
    return True, "CPU quantize_blockwise keeps its code map and stores the nearest dynamic code"


def cpu_description() -> str:
    """``torch.backends.cpu.get_cpu_capability()`` and the CPU model, e.g. ``AVX512, AMD EPYC``."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{torch.backends.cpu.get_cpu_capability()}, {model}"


#: the instruction-set flags that choose between CPU kernels (torch's and bitsandbytes')
ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpu_flags() -> str:
    """The instruction-set flags of this processor that pick CPU kernels, e.g. ``avx2 avx512f amx_tile``
    (from /proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return " ".join(flag for flag in ISA_FLAGS if flag in have)
    except OSError:
        pass
    return ""


def processor() -> str:
    """This machine's processor as the release matrix records it: torch's CPU capability, the model name
    and the kernel-picking ISA flags, e.g. ``AVX2, AMD EPYC 7B13 [avx2]``."""
    return f"{cpu_description()} [{cpu_flags()}]"


def probe_int8_k1_cpu() -> tuple[bool, str]:
    """int8_linear_matmul with K=1 on CPU against the exact int64 product, on several shapes and inputs,
    each twice. Inputs are nonzero and differ per round, so neither a zeroed buffer nor the freed buffer
    of an earlier (correct) result can look right: a kernel that leaves its output unwritten fails."""
    import bitsandbytes.functional as bnbF
    import torch

    gen = torch.Generator().manual_seed(1)
    where = cpu_description()
    bad = []
    trials = 0
    for m, n in ((1, 2), (3, 5), (6, 40), (2, 96), (17, 3)):
        for _ in range(2):
            a = torch.randint(1, 100, (m, 1), generator=gen, dtype=torch.int8)
            b = torch.randint(1, 100, (n, 1), generator=gen, dtype=torch.int8)
            b[torch.randint(0, n, (1,), generator=gen)] *= -1
            got = bnbF.int8_linear_matmul(a, b)
            want = a.long() @ b.long().T
            trials += 1
            if tuple(got.shape) != tuple(want.shape) or not torch.equal(got.long(), want):
                bad.append(f"A[{m},1] B[{n},1]")
    if bad:
        return False, (
            f"int8_linear_matmul with one input feature (K=1) is wrong on this CPU ({where}) in "
            f"{len(bad)}/{trials} trials ({', '.join(sorted(set(bad)))}): the output is uninitialised memory"
        )
    return True, f"int8_linear_matmul with K=1 is exact on this CPU ({where}) in {trials}/{trials} trials"


PROBES: dict[str, Callable[[], tuple[bool, str]]] = {
    "fp4_cpu": probe_fp4_cpu,
    "blocksize_remainder_cpu": probe_blocksize_remainder_cpu,
    "quant_storage_cpu": probe_quant_storage_cpu,
    "matmul_4bit:functional": probe_matmul_4bit_plain,
    "matmul_4bit:functional_t": probe_matmul_4bit_t,
    "matmul_4bit:functional_kn": probe_matmul_4bit_kn,
    "cpu_8bit_training_fp": probe_cpu_8bit_training_path,
    "transformers_4bit": probe_transformers_4bit,
    "defect:odd_numel_4bit": probe_odd_numel_4bit,
    "defect:one_byte_weight": probe_one_byte_weight,
    "defect:one_byte_backward": probe_one_byte_backward,
    "defect:8bit_fp_3d_backward": probe_8bit_fp_3d_backward,
    "defect:int8_k1_cpu": probe_int8_k1_cpu,
    "defect:kn_one_row": probe_kn_one_row,
    "defect:fp4_codes_cpu": probe_fp4_codes_cpu,
    "defect:partial_block_16bit": probe_partial_block_16bit,
    "defect:dynamic_map_cpu": probe_dynamic_map_cpu,
    # last: it may kill the child process (the parent restarts it only if something is left)
    "defect:nested_single_block": probe_nested_single_block,
}


def _child(names: list[str], probes: dict[str, Callable[[], tuple[bool, str]]] | None = None) -> None:
    _quiet()
    for name in names:
        print(f"{_PREFIX}start {json.dumps(name)}", flush=True)
        try:
            ok, detail = (probes or PROBES)[name]()
        except Exception as exc:  # noqa: BLE001 -- a probe that raises is a missing capability
            ok, detail = False, _err(exc)
        print(f"{_PREFIX}done {json.dumps({'name': name, 'ok': ok, 'detail': detail})}", flush=True)


# --- the parent -------------------------------------------------------------------------------------


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited {code}"


class ProbeUndecided(RuntimeError):
    """A probe gave no verdict (it timed out twice): the cases that depend on it cannot be decided here."""


def run_probes(
    names: list[str], timeout: float = PROBE_TIMEOUT_S, module: str = "vramguard.grad.capabilities"
) -> dict[str, Probe]:
    """Run ``names`` in child processes (``python -m module NAME...``); a probe that crashes its child is
    a failed probe naming the signal, and the remaining probes run in a fresh child. A probe still running
    when a child's ``timeout`` runs out is tried once more, first in a fresh child; a second timeout is no
    verdict (``Probe.timed_out``), never a lacking capability."""
    results: dict[str, Probe] = {}
    retried: set[str] = set()
    left = list(names)
    env = dict(os.environ)  # the same PYTHONPATH (a bisect overlay stays first), plus vramguard itself
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), src]))
    while left:
        cmd = [sys.executable, "-m", module, *left]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
            stdout, code = out.stdout, out.returncode
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            code = None
        running = None
        for line in stdout.splitlines():
            if not line.startswith(_PREFIX):
                continue
            kind, _, payload = line[len(_PREFIX) :].partition(" ")
            if kind == "start":
                running = json.loads(payload)
            elif kind == "done":
                d = json.loads(payload)
                results[d["name"]] = Probe(d["name"], bool(d["ok"]), d["detail"])
                running = None
        left = [n for n in left if n not in results]
        if not left:
            break
        culprit = running or left[0]
        if code is None and culprit not in retried:  # out of time, not crashed: once more, first in line
            retried.add(culprit)
            left.remove(culprit)
            left.insert(0, culprit)
            continue
        if code is None:
            why = (
                f"did not finish within {timeout:g} s, twice: no verdict on this machine (is it overloaded?)"
            )
            results[culprit] = Probe(culprit, False, f"the probe {why}", timed_out=True)
        else:
            results[culprit] = Probe(
                culprit, False, f"the probe crashed its process ({_describe_exit(code)})"
            )
        left.remove(culprit)
    return results


@functools.cache
def probe_all() -> dict[str, Probe]:
    """Every probe, once per process (a pytest session)."""
    return run_probes(list(PROBES))


def get(name: str) -> Probe:
    """The outcome of the probe ``name`` on this installation (each run once per process, in a child process);
    :class:`ProbeUndecided` when it gave none."""
    if name == "forward_calls_linear_4bit":
        return forward_calls_linear_4bit()
    probe = probe_all()[name]
    if probe.timed_out:
        raise ProbeUndecided(f"probe {name}: {probe.detail}")
    return probe


@functools.cache
def forward_calls_linear_4bit() -> Probe:
    """Does the installed ``MatMul4Bit.forward`` call ``F.linear`` (the code bitsandbytes PR 1935 wraps)?"""
    from vramguard.grad import patches

    can = patches.get("no-grad-linear:4bit").applies()
    if can:
        return Probe("forward_calls_linear_4bit", True, "MatMul4Bit.forward calls F.linear")
    return Probe(
        "forward_calls_linear_4bit", False, f"MatMul4Bit.forward does not call F.linear ({can.reason})"
    )


@dataclass(frozen=True)
class KnownDefect:
    """A bitsandbytes defect and the releases where it reproduces (checked on 0.46.0, 0.47.0, 0.48.0,
    0.49.2, 0.50.0, 0.50.2). ``probe``: the probe that sees it on this machine (None: measured by a test).
    ``hardware``: it also depends on the CPU, so inside the range the probe on this machine decides
    (outside it the defect is never expected: a release that still has it fails its test until the range
    is extended). ``only``: the releases inside the range that have it, where some in between do not; the
    others must then behave correctly."""

    key: str
    what: str
    first: str
    last: str
    probe: str | None = None
    hardware: bool = False
    only: tuple[str, ...] = ()

    def in_range(self, version: str | None = None) -> bool:
        """Whether ``version`` (default: the installed bitsandbytes) lies in the releases where the defect
        reproduces."""
        from packaging.version import Version

        v = Version(version or bnb_version())
        if self.only:
            return v in {Version(r) for r in self.only}
        return Version(self.first) <= v <= Version(self.last)

    def expected_here(self) -> bool:
        """Is the defect expected to reproduce with the installed release on this machine?"""
        if self.hardware and self.probe is not None:
            return self.in_range() and not get(self.probe)
        return self.in_range()


KNOWN_DEFECTS: dict[str, KnownDefect] = {
    d.key: d
    for d in (
        KnownDefect(
            "nested_single_block",
            "nested statistics (compress_statistics=True) of a weight with one 4-bit block: the CPU "
            "quantize_blockwise of the all-zero absmax - mean kills the process (SIGSEGV)",
            "0.46.0",
            "0.48.0",
            "defect:nested_single_block",
        ),
        KnownDefect(
            "odd_numel_4bit",
            "CPU quantize_4bit of a weight with an odd number of elements raises 'The size of tensor a "
            "must match the size of tensor b'",
            "0.47.0",
            "0.49.2",
            "defect:odd_numel_4bit",
        ),
        KnownDefect(
            "one_byte_weight",
            "a 4-bit weight of 2 elements packs to [1, 1], which dequantize_4bit reads as transposed "
            "(returns W.T), so matmul_4bit in the [K, N] form fails",
            "0.47.0",
            "0.50.2",
            "defect:one_byte_weight",
        ),
        KnownDefect(
            "one_byte_backward",
            "MatMul4Bit.backward with a one-byte packed weight (N*K == 2) fails with 'mat1 and mat2 shapes "
            "cannot be multiplied'",
            "0.50.0",
            "0.50.2",
            "defect:one_byte_backward",
        ),
        KnownDefect(
            "8bit_fp_3d_backward",
            "MatMul8bitFp.backward calls A.t() on a 3-D input when the weight needs a gradient "
            "(has_fp16_weights=True, CPU training)",
            "0.48.0",
            "0.50.2",
            "defect:8bit_fp_3d_backward",
        ),
        KnownDefect(
            "int8_k1_cpu",
            "int8_linear_matmul on CPU with one input feature (K=1) returns uninitialised memory: it runs "
            "torch._int_mm (torch >= 2.6; from 0.50.0 only on AVX-512 CPUs), whose CPU kernel mishandles "
            "the [1, N] operand B.t() with strides (1, 1)",
            "0.46.0",
            "0.50.2",
            "defect:int8_k1_cpu",
            hardware=True,
        ),
        KnownDefect(
            "kn_one_row",
            "matmul_4bit with a weight quantized from [K, N] and a one-row input that needs no gradient "
            "(the gemv_4bit inference path) fails with 'mat1 and mat2 shapes cannot be multiplied' "
            "(0.46.0 and 0.48.0; 0.47.0 computes it)",
            "0.46.0",
            "0.48.0",
            "defect:kn_one_row",
            only=("0.46.0", "0.48.0"),
        ),
        KnownDefect(
            "fp4_codes_cpu",
            "the CPU quantize_4bit(quant_type='fp4') stores elements that lie within ~2e-5 of the midpoint "
            "between two codes as the farther code (about 1 in 8,000 elements; on an AVX-512/AMX Intel Xeon "
            "w/absmax = 0.08595 was stored as 0.0052, not 0.1667)",
            "0.47.0",
            "0.49.2",
            "defect:fp4_codes_cpu",
            hardware=True,
        ),
        KnownDefect(
            "partial_block_16bit",
            "the CPU quantize_4bit of a bfloat16 or float16 weight whose size is not a multiple of the "
            "blocksize divides the last, partial block by its absmax in the weight's dtype, so elements near "
            "a midpoint between two codes are stored as the farther code (bf16: w/absmax = -0.3393 stored as "
            "-0.3949, not -0.2844; fp16: -0.4601 stored as -0.3949, not -0.5251)",
            "0.47.0",
            "0.49.2",
            "defect:partial_block_16bit",
        ),
        KnownDefect(
            "dynamic_map_cpu",
            "the CPU quantize_blockwise kernel (8-bit dynamic map; the nested statistics of 4-bit weights) "
            "writes code[0] = -1 into the shared default map in place, so every value in (-0.99648, "
            "-0.98594) of its block's absmax, nearest to the code -0.99297, is stored as -1 or -0.97891",
            "0.46.0",
            "0.49.2",
            "defect:dynamic_map_cpu",
        ),
        KnownDefect(
            "kn_weight_copy",
            "matmul_4bit with a weight quantized from [K, N] dequantizes and calls F.linear outside the "
            "autograd Function, under grad, so the whole dequantized weight is kept for backward",
            "0.50.0",
            "0.50.2",
        ),
    )
}


def bnb_version() -> str:
    """The installed bitsandbytes version, ``absent`` when it is not installed."""
    import importlib.metadata as md

    try:
        return md.version("bitsandbytes")
    except md.PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    _child(sys.argv[1:] or list(PROBES))
