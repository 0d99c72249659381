"""Constants and small helpers of tests_memory (imported by the test modules)."""

from __future__ import annotations

import torch

# T = BATCH * SEQ = 80 tokens: no activation shape coincides with a weight shape of the presets
# (h=128, kv*d=64, i=352, V=512, r=8), so the ledger's weight-copy classification is unambiguous.
SEQ = 40
BATCH = 2
RANK = 8
BAND = 0.05  # per-layer band around the analytic formula (kernel variants: padded logsumexp, masks)


def mask_bytes(device: str, act_bytes: int) -> int:
    """Dropout mask element size: CPU multiplies by a mask in the input's dtype, CUDA keeps bool."""
    return 1 if torch.device(device).type == "cuda" else act_bytes


def release(model: torch.nn.Module) -> None:
    """Drop gradients a measured step left on the parameters."""
    for p in model.parameters():
        p.grad = None


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "bitsandbytes", "peft", "transformers", "trl"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


V = versions()
