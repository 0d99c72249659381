"""The vision tower's choices on tiny Mistral 3 (56x56, seq 640, batch 1), as tests/test_vision_tower.py
runs them on LLaVA and Qwen3-VL: for each, the CPU audit's step (audit_vision_step: real QLoRA steps)
against the meta estimate with the CPU's kernels (estimate_vision_step), compared on what
test_vision_tower.py compares (every figure of the step but its seconds and losses), and the saved bytes
of each stack. Run from the repository root, in a venv with torchvision:
    PYTHONPATH=src python docs/measurements/2026-11-29-mistral3/choices.py
"""

import sys
from pathlib import Path

from vramguard.estimate.vision import audit_vision_step, estimate_vision_step
from vramguard.workload.models import QLoRAConfig

MODEL = Path(__file__).resolve().parents[3] / "fixtures" / "configs" / "vlm" / "tiny-mistral3.json"
CHOICES = {
    "default": {},
    "unquantized": {"vision_tower": "unquantized"},
    "lm-only": {"lora_scope": "language-model"},
    "lm+projector": {"lora_scope": "language-model+projector"},
    "checkpointed": {"gradient_checkpointing": True},
    "tower-not-checkpointed": {"gradient_checkpointing": True, "tower_checkpointing": False},
    "projector-trained": {"train_projector": True, "lora_scope": "language-model"},
}


def figures(step: object) -> dict:
    d = step.to_dict()  # type: ignore[attr-defined]
    del d["seconds"]
    for s in d["steps"]:
        del s["loss"]
    return d


failed = False
for name, choice in CHOICES.items():
    config = QLoRAConfig(model=str(MODEL), seq_len=640, batch=1, **choice)  # type: ignore[arg-type]
    audit = audit_vision_step(config, (56, 56))
    same = figures(estimate_vision_step(config, (56, 56), target="cpu")) == figures(audit)
    stacks = ", ".join(f"{k} {v:,} B" for k, v in audit.by_stack.items())
    print(f"{name}: estimate == audit: {same}; saved: {stacks}")
    failed |= not same
sys.exit(1 if failed else 0)
