"""Probe for ``vramguard bisect``: does ``MatMul4Bit`` keep its input activation for backward?

bitsandbytes' "QLoRA memory bug": from Feb 2023 until 0.43.2, ``MatMul4Bit.forward`` stored its input A in
``ctx.tensors = (A, B)`` although its backward never reads it (the 4-bit weight is frozen, so there is no
grad_B): one activation per 4-bit layer. This probe runs one ``bnb.matmul_4bit`` with an input that needs
grad and looks at the autograd node it made: exit 1 when the node holds the input (in ``ctx.tensors`` or
saved for backward), 0 when it does not, 125 (skip) when this build has no 4-bit matmul on the device or
the product made no ``MatMul4Bit`` node. CUDA when available, else CPU (CPU 4-bit arrived in 0.46).
Prints the imported bitsandbytes version and path so the log proves which build ran.
Usage: python tests/probes/bnb_matmul4bit_keeps_input.py
"""

from __future__ import annotations

import sys

import torch

SKIP = 125


def kept_input_bytes(device: str) -> int | None:
    """Bytes of the input the ``MatMul4Bit`` node keeps (0: none); None when no such node was made."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    torch.manual_seed(0)
    weight = torch.randn(96, 128, dtype=torch.bfloat16, device=device)
    packed, state = F.quantize_4bit(weight, quant_type="nf4")
    x = torch.randn(80, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
    h = x * 2  # an activation of the step, as a layer's input is in a model
    y = bnb.matmul_4bit(h, packed.t(), quant_state=state)
    todo, seen = [y.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if "MatMul4Bit" in type(node).__name__:
            held = [t for t in getattr(node, "tensors", ()) if isinstance(t, torch.Tensor)]
            held += list(node.saved_tensors)
            same = [t for t in held if t.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()]
            return sum(t.untyped_storage().nbytes() for t in same[:1])
        todo.extend(fn for fn, _ in node.next_functions)
    return None


def main() -> int:
    import bitsandbytes as bnb

    print(f"bitsandbytes {bnb.__version__} from {bnb.__file__}", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kept = kept_input_bytes(device)
    except Exception as exc:  # noqa: BLE001 - no 4-bit matmul on this device in this build: cannot tell
        print(f"no 4-bit matmul on {device}: {type(exc).__name__}: {exc}")
        return SKIP
    if kept is None:
        print("the product made no MatMul4Bit node: cannot tell")
        return SKIP
    print(f"MatMul4Bit on {device} keeps {kept} B of its input for backward")
    return 1 if kept else 0


if __name__ == "__main__":
    sys.exit(main())
