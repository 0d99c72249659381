"""Probe for ``vramguard bisect``: does a 4-bit (fp4 by default) matmul train correctly on CPU?

Exit 0 when forward and input gradient of ``bnb.matmul_4bit`` on CPU match a float64 reference built
from the dequantized weight; exit 1 when they differ or the release cannot do it on CPU (raises, or the
process dies). Prints the imported bitsandbytes version and path so the log proves which one ran.
Usage: python tests/probes/bnb_fp4_cpu_grad.py [fp4|nf4]
"""

from __future__ import annotations

import sys

import torch


def main(quant_type: str) -> int:
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    print(f"bitsandbytes {bnb.__version__} from {bnb.__file__}", flush=True)
    torch.manual_seed(0)
    weight = torch.randn(32, 64, dtype=torch.float32)
    try:
        packed, state = F.quantize_4bit(weight, quant_type=quant_type)
        dequant = F.dequantize_4bit(packed, state).to(torch.float64)
        x = torch.randn(4, 64, dtype=torch.float32, requires_grad=True)
        y = bnb.matmul_4bit(x, packed.t(), quant_state=state)
        grad_out = torch.randn_like(y)
        y.backward(grad_out)
    except Exception as exc:  # the release has no CPU path for this: that is the "bad" we look for
        print(
            f"bitsandbytes {bnb.__version__}: 4-bit {quant_type} on CPU failed: {type(exc).__name__}: {exc}"
        )
        return 1
    x64 = x.detach().to(torch.float64)
    ref_y = x64 @ dequant.t()
    ref_grad = grad_out.to(torch.float64) @ dequant
    err_y = ((y.detach().to(torch.float64) - ref_y).norm() / ref_y.norm()).item()
    err_g = ((x.grad.to(torch.float64) - ref_grad).norm() / ref_grad.norm()).item()
    quant_err = ((dequant - weight.to(torch.float64)).norm() / weight.norm()).item()
    errors = f"forward {err_y:.2e}, input grad {err_g:.2e}, quantization {quant_err:.2e}"
    print(f"bitsandbytes {bnb.__version__}: rel. error: {errors}")
    ok = err_y < 1e-3 and err_g < 1e-3 and quant_err < 0.5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "fp4"))
