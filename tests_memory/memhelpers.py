"""Constants and small helpers of tests_memory (imported by the test modules)."""

from __future__ import annotations

import pytest
import torch

from vramguard.grad import capabilities

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


def need(name: str, device: str = "cpu") -> None:
    """Skip, naming the missing capability (probed, vramguard.grad.capabilities), when the installed
    bitsandbytes cannot run what the test needs on CPU. CUDA paths are not probed here."""
    if torch.device(device).type != "cpu":
        return
    cap = capabilities.get(name)
    if not cap:
        pytest.skip(f"bitsandbytes {V['bitsandbytes']} lacks {name}: {cap.detail}")


def defect_expected(key: str) -> bool:
    """Strict-xfail condition: the known defect reproduces with the installed release (and CPU)."""
    return capabilities.KNOWN_DEFECTS[key].expected_here()
