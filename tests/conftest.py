"""Shared fixtures of the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_qlora():  # type: ignore[no-untyped-def]
    """The ``tiny-llama`` preset as a real QLoRA model (4-bit base, LoRA r=8 on all linear
    projections, bf16 compute, no gradient checkpointing) for seq 64, batch 2; built once.

    Tests must not train it (no optimizer step) so that every user sees the same model.
    """
    from vramguard.workload.models import QLoRAConfig, build_qlora

    return build_qlora(QLoRAConfig(model="tiny-llama", seq_len=64, batch=2, lora_rank=8))
