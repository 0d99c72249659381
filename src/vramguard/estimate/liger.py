"""``use_liger_kernel`` on the meta device, priced by liger-kernel's own code; its Triton kernels are not run.

What transformers' ``Trainer`` does with ``use_liger_kernel=True`` (``transformers.integrations.liger.
apply_liger_kernel``, called at the start of ``train()``): Liger's ``_apply_liger_kernel_to_instance`` on the
unwrapped PEFT model, with ``liger_kernel_config``'s keywords (none: Liger's defaults for the architecture; for
Llama rope, rms_norm, swiglu and fused_linear_cross_entropy). :func:`liger_kernel` calls that same function on
the meta model, so the step runs Liger's own Python: its module forwards (``lce_forward``, ``LigerRMSNorm``,
``LigerSwiGLUMLP``, ``liger_rotary_pos_emb`` through its backend dispatcher), its autograd Functions, their
allocations (``torch.empty`` / ``zeros_like`` buffers, the fused cross-entropy's chunk of logits) and what they
keep (``ctx.save_for_backward``: the fused cross-entropy keeps ``grad_input``, batch x seq x hidden, not the
logits). Four things are answered here, nothing else is changed:

* the Triton launches (``kernel[grid](...)``, :class:`triton.runtime.jit.KernelInterface`) on meta tensors are
  skipped: every kernel of Llama's path writes into buffers its wrapper allocated before the launch (rope: q
  and k in place; rms_norm: ``Y`` and ``RSTD``, in backward ``dX`` = ``dY`` in place and the per-program
  ``_dW``; swiglu: ``c``, in backward ``a`` and ``b`` in place; the cross-entropy kernel: the logits chunk,
  overwritten by its gradient, and ``loss_1d``; ``element_mul_kernel``: in place), so a skipped launch changes
  no allocation (checked by reading liger-kernel 0.8.5; not validated on a GPU here);
* ``target_mask.sum().item()`` in ``fused_linear_cross_entropy_forward`` (the non-ignored token count, a
  device sync on a GPU) is answered with the batch's count: ``LigerForCausalLMLoss``'s label shift, repeated
  on the batch's real labels (:func:`non_ignored`); it decides no size, the kernel divides by it;
* ``torch.equal(grad_output, 1.0)`` in its backward is answered True (the loss is the step's last op:
  ``loss.backward()`` gives it 1.0, so the in-place rescale is skipped, as on the device);
* ``_can_use_mm_out`` (CUDA reuses one ``chunk x vocab`` logits buffer across chunks, ``torch.mm(out=)``)
  is asked of the target device: Liger's own function on fake tensors of the meta ones that report
  ``target`` as their device.

Left as the meta run has it: ``rms_norm``'s backward makes one fp32 ``_dW`` row per streaming multiprocessor
when the norm's weight is trained (``--method full``): one row on meta (132 x hidden x 4 B on an H100); the
autocast decorators of the fused cross-entropy were bound at import to the host's device type (they change
no byte: its backward only rescales in place).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from vramguard.errors import UsageError
from vramguard.step.patching import patched
from vramguard.units import format_bytes

EXTRA = "liger"
"""The extra that installs liger-kernel and Triton (``pip install -c constraints.txt -e ".[liger]"``)."""

CROSS_ENTROPY_KERNEL = "liger_cross_entropy_kernel"
"""The Triton kernel the fused linear cross-entropy launches once per chunk of logits."""

IGNORE_INDEX = -100
"""transformers' and Liger's ignored label."""


def missing() -> str | None:
    """Why ``use_liger_kernel`` cannot be priced here (one line), or None when liger-kernel and Triton are
    installed. Looks for the packages without importing them."""
    absent = [name for name in ("liger_kernel", "triton") if importlib.util.find_spec(name) is None]
    if absent:
        return (
            f"use_liger_kernel is priced by liger-kernel's own code and {' and '.join(absent)} "
            f'{"is" if len(absent) == 1 else "are"} not installed: pip install -c constraints.txt -e ".[{EXTRA}]" '
            "(it is neither simulated nor imitated)"
        )
    return None


def _imported(module: str) -> Any:
    """``module`` of the liger extra (liger-kernel, Triton); where it is not installed, the one-line refusal."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(missing() or f"{module} does not import: {exc}") from None


def check(target: str, device: str = "meta") -> None:
    """UsageError (one line) where ``use_liger_kernel`` cannot be priced: a target other than CUDA (Liger's
    Triton kernels run on a GPU), liger-kernel or Triton not installed (:func:`missing`), a run on real tensors
    (its launches would run)."""
    if target != "cuda":
        raise UsageError(
            "use_liger_kernel runs Liger's Triton kernels on CUDA only: estimate it with --device cuda"
        )
    problem = missing()
    if problem is not None:
        raise UsageError(problem)
    if device != "meta":
        raise UsageError(
            "use_liger_kernel is priced on the meta device only (its Triton kernels are not run)"
        )


def version() -> str:
    """The installed liger-kernel's version."""
    from importlib.metadata import version as dist_version

    return dist_version("liger-kernel")


def non_ignored(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """The tokens ``LigerForCausalLMLoss`` scores in a batch with ``labels``: its own shift (the labels padded
    with ``ignore_index`` on the right, then from the second on), counted where not ``ignore_index``: the value
    of ``fused_linear_cross_entropy_forward``'s ``target_mask.sum().item()``."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return int((shifted != ignore_index).sum())


class _Answers(TorchDispatchMode):
    """Answers a meta tensor's ``.item()`` with ``scalar`` and ``torch.equal`` of meta tensors with ``equal``;
    counts them in ``answered``."""

    def __init__(self, scalar: Any = None, equal: bool | None = None) -> None:
        super().__init__()
        self.scalar = scalar
        self.equal = equal
        self.answered: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        metas = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "meta"]
        if metas and func is torch.ops.aten._local_scalar_dense.default and self.scalar is not None:
            self.answered["item"] = self.answered.get("item", 0) + 1
            return self.scalar
        if metas and func is torch.ops.aten.equal.default and self.equal is not None:
            self.answered["equal"] = self.answered.get("equal", 0) + 1
            return self.equal
        return func(*args, **kwargs)


@contextlib.contextmanager
def triton_launches_skipped() -> Iterator[list[Launch]]:
    """Within the block a Triton launch (``kernel[grid](*args)``, every ``JITFunction``, ``Autotuner`` and
    ``Heuristics``) whose tensors are all on meta runs nothing; the launch is listed (:class:`Launch`) in the
    list yielded. Launches on a real device run. The launcher is restored after the block, also after an error."""
    KernelInterface = _imported("triton.runtime.jit").KernelInterface
    original = KernelInterface.__dict__["__getitem__"]
    skipped: list[Launch] = []

    def __getitem__(self: Any, grid: Any) -> Any:
        launch = original(self, grid)

        def run(*args: Any, **kwargs: Any) -> Any:
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            if not tensors or any(t.device.type != "meta" for t in tensors):
                return launch(*args, **kwargs)
            shapes = {k: (tuple(v.shape), v.dtype) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            skipped.append(
                Launch(_kernel_name(self), tuple(grid) if isinstance(grid, tuple) else grid, shapes)
            )
            return None

        return run

    with patched(KernelInterface, "__getitem__", __getitem__):
        yield skipped


@dataclass(frozen=True)
class Launch:
    """A skipped Triton launch: the kernel's name, its grid and its keyword tensors' shapes and dtypes."""

    kernel: str
    grid: Any
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]


def _kernel_name(kernel: Any) -> str:
    while hasattr(kernel, "fn"):  # an Autotuner / Heuristics wraps the JITFunction
        kernel = kernel.fn
    return str(getattr(kernel, "__name__", type(kernel).__name__))


@contextlib.contextmanager
def _module_state(prefixes: tuple[str, ...]) -> Iterator[None]:
    """Every attribute Liger's patching replaces on a module (``modeling_llama.apply_rotary_pos_emb = ...``, its
    classes ``LlamaRMSNorm`` / ``LlamaMLP``, ``nn.functional.cross_entropy``) is put back after the block: the
    patch is for this model's step, not for the models built after it in the process."""
    names = [n for n in list(sys.modules) if n.startswith(prefixes)]
    saved = {n: dict(vars(sys.modules[n])) for n in names if sys.modules.get(n) is not None}
    functional = dict(vars(torch.nn.functional))
    try:
        yield
    finally:
        for name, before in saved.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            now = vars(module)
            for key, value in before.items():
                if now.get(key, _ABSENT) is not value:
                    now[key] = value
        now = vars(torch.nn.functional)
        for key, value in functional.items():
            if now.get(key, _ABSENT) is not value:
                now[key] = value


_ABSENT = object()


@contextlib.contextmanager
def liger_kernel(
    model: torch.nn.Module, target: str, labels: torch.Tensor, kernel_config: dict[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Within the block ``model`` (a PEFT model on meta) runs with Liger applied as transformers' Trainer
    applies it (``apply_liger_kernel(model, liger_kernel_config)``), its Triton launches skipped and its
    device questions answered as ``target`` (see the module docstring); ``labels``: the batch's real labels
    (host), whose non-ignored count answers the fused cross-entropy's ``.item()``. Yields what was run:
    ``version``, ``kernels`` (launches skipped, by kernel), ``answered`` (the questions answered, by kind),
    ``item_answers`` (the values given to ``.item()``), ``mm_out`` (``_can_use_mm_out``'s answers) and
    ``logits_chunks`` (the shape and dtype of the logits chunk each cross-entropy launch was given: Liger's own
    chunk size); ``kernels`` and ``logits_chunks`` are filled in when the block exits."""
    check(target)
    flce = _imported("liger_kernel.ops.fused_linear_cross_entropy")
    from transformers.integrations.liger import apply_liger_kernel

    ran: dict[str, Any] = {
        "version": version(),
        "kernels": {},
        "answered": {},
        "item_answers": [],
        "mm_out": [],
        "logits_chunks": [],
    }
    count = non_ignored(labels)
    original_forward = flce.fused_linear_cross_entropy_forward
    original_backward = flce.fused_linear_cross_entropy_backward
    original_mm_out = flce._can_use_mm_out

    def tally(answers: _Answers) -> None:
        for key, n in answers.answered.items():
            ran["answered"][key] = ran["answered"].get(key, 0) + n
        ran["item_answers"] += [answers.scalar] * answers.answered.get("item", 0)

    def fused_linear_cross_entropy_forward(
        _input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if _input.device.type != "meta":
            return original_forward(_input, weight, *args, **kwargs)
        target_ = kwargs.get("target", args[0] if args else None)
        if target_ is not None and target_.numel() != labels.numel():
            raise UsageError(
                f"Liger's fused cross-entropy got {target_.numel():,} targets, the batch has {labels.numel():,} "
                "labels: its .item() cannot be answered from the batch"
            )
        answers = _Answers(scalar=count)
        try:
            with answers:
                return original_forward(_input, weight, *args, **kwargs)
        finally:
            tally(answers)

    def fused_linear_cross_entropy_backward(grad_output: torch.Tensor, *args: Any) -> Any:
        answers = _Answers(equal=True)  # loss.backward(): the loss's gradient is 1.0
        try:
            with answers:
                return original_backward(grad_output, *args)
        finally:
            tally(answers)

    def _can_use_mm_out(_input: torch.Tensor, weight: torch.Tensor) -> bool:
        if _input.device.type != "meta":
            return bool(original_mm_out(_input, weight))
        answer = bool(original_mm_out(*_as_device((_input, weight), target)))
        ran["mm_out"].append(answer)
        return answer

    with _module_state(("transformers.", "liger_kernel.")), triton_launches_skipped() as skipped:
        flce.fused_linear_cross_entropy_forward = fused_linear_cross_entropy_forward
        flce.fused_linear_cross_entropy_backward = fused_linear_cross_entropy_backward
        flce._can_use_mm_out = _can_use_mm_out
        apply_liger_kernel(model, dict(kernel_config or {}))
        try:
            yield ran
        finally:
            for launch in skipped:
                ran["kernels"][launch.kernel] = ran["kernels"].get(launch.kernel, 0) + 1
                logits = launch.tensors.get("X_ptr") if launch.kernel == CROSS_ENTROPY_KERNEL else None
                if logits is not None:
                    ran["logits_chunks"].append(logits)


def _as_device(tensors: tuple[torch.Tensor, ...], target: str) -> tuple[torch.Tensor, ...]:
    """Fake tensors of ``tensors`` (meta) that report ``target`` as their device (torch's ``FakeTensor``:
    shape, dtype and requires-grad kept, no storage)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    device = torch.device(target, 0) if target == "cuda" else torch.device(target)
    with _disable_current_modes(), torch.no_grad():
        mode = FakeTensorMode(allow_non_fake_inputs=False)
        return tuple(FakeTensor(mode, t.detach(), device) for t in tensors)


def liger_line(ran: dict[str, Any]) -> str:
    """The estimate's one line on Liger: what ran (liger-kernel's version, the kernels whose launches were
    skipped, the fused cross-entropy's chunk of logits) and what was not done (no kernel run, no GPU)."""
    kernels = ", ".join(sorted(ran["kernels"]))
    launches = sum(ran["kernels"].values())
    chunk = ""
    if ran["logits_chunks"]:
        (rows, vocab), dtype = ran["logits_chunks"][0]
        size = rows * vocab * torch.empty((), dtype=dtype).element_size()
        reused = "one buffer reused (torch.mm out=)" if any(ran["mm_out"]) else "one per chunk"
        chunk = (
            f"; its fused linear cross-entropy computes {rows} x {vocab:,} {str(dtype).removeprefix('torch.')} "
            f"logits at a time ({format_bytes(size)}, {reused}) and keeps grad_input (batch x seq x hidden), not "
            "the logits"
        )
    return (
        f"liger: use_liger_kernel priced on meta from liger-kernel {ran['version']}'s own code, applied as "
        f"transformers' Trainer applies it{chunk}; its Triton kernels were not run ({launches} launches of "
        f"{kernels} skipped) and this is not validated on a GPU here; TRL's SFTTrainer applies Liger without "
        "the fused cross-entropy (its own chunked LM head, not priced)"
    )
