"""Constants and small helpers of tests_memory (imported by the test modules)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from vramguard.grad import capabilities

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: pytest's controller process loads the conftest that imports this
# module before it starts the xdist workers, and does not need torch (about 2.5 CPU s at each start)

# T = BATCH * SEQ = 80 tokens: no activation shape coincides with a weight shape of the presets
# (h=128, kv*d=64, i=352, V=512, r=8), so the ledger's weight-copy classification is unambiguous.
SEQ = 40
BATCH = 2
RANK = 8
BAND = 0.05  # per-layer band around the analytic formula (kernel variants: padded logsumexp, masks)


def mask_bytes(device: str, act_bytes: int) -> int:
    """Dropout mask element size: CPU multiplies by a mask in the input's dtype, CUDA keeps bool."""
    import torch

    return 1 if torch.device(device).type == "cuda" else act_bytes


def drop_cublas_workspaces(device: str) -> None:
    """:func:`vramguard.measure.meters.drop_cublas_workspaces` (imported here, where it is called: it imports
    torch)."""
    from vramguard.measure.meters import drop_cublas_workspaces as drop

    drop(device)


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
    import torch

    if torch.device(device).type != "cpu":
        return
    cap = capabilities.get(name)
    if not cap:
        pytest.skip(f"bitsandbytes {V['bitsandbytes']} lacks {name}: {cap.detail}")


def defect_expected(key: str) -> bool:
    """Strict-xfail condition: the known defect reproduces with the installed release (and CPU)."""
    return capabilities.KNOWN_DEFECTS[key].expected_here()


#: transformers releases that give an unpadded batch without ``attention_mask`` an explicit causal mask:
#: the model passes its default ``position_ids`` to ``create_causal_mask``, whose packed-sequence
#: detection (``find_packed_sequence_indices``) returns a mask even when nothing is packed, which turns
#: off sdpa's ``is_causal`` skip. sdpa then runs with ``attn_mask``: no GQA in the kernel, so every layer
#: keeps k and v repeated to all heads, and the CPU kernel keeps a float copy of the (b, 1, s, s) mask.
#: Checked on 4.56.2 and 4.57.6 (present) and 5.0.0 (``find_packed_sequence_indices`` returns None when
#: nothing is packed); the reproducer is test_decoder_layer.py::test_unpadded_batch_runs_sdpa_causal.
EXPLICIT_CAUSAL_MASK = ("4.56.0", "4.57.6")


def explicit_causal_mask() -> bool:
    """Does the installed transformers lie in :data:`EXPLICIT_CAUSAL_MASK` (the defect is expected)?"""
    from packaging.version import Version

    first, last = EXPLICIT_CAUSAL_MASK
    return V["transformers"] != "absent" and Version(first) <= Version(V["transformers"]) <= Version(last)


def checkpoint_wraps_module_hooks() -> bool:
    """Does transformers' ``GradientCheckpointingLayer`` checkpoint ``__call__`` (module hooks inside the
    checkpoint, as up to at least 5.0.0) rather than ``forward`` (hooks outside, as in 5.23)?

    Inside: the checkpoint keeps the layer's input before the layer's forward pre-hook runs, so the
    ledger attributes it to the enclosing decoder stack, not to the layer (same bytes, one level up).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" in vars(GradientCheckpointingLayer)
