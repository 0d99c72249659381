"""Shared fixtures of tests_memory: the device (CPU by default, CUDA under ``-m gpu``), shapes,
and QLoRA models built once per session per configuration (real libraries, random weights)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from memhelpers import BATCH, RANK, SEQ, need

if TYPE_CHECKING:
    from vramguard.workload.models import QLoRAModel

# torch and the model stack are imported in the fixtures: pytest's controller process loads this conftest
# before it starts the xdist workers and needs neither

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES, scope="module")
def device(request: pytest.FixtureRequest) -> str:
    import torch

    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return request.param


_MODELS: dict[tuple[Any, ...], QLoRAModel] = {}


@pytest.fixture(scope="session")
def qlora() -> Callable[..., QLoRAModel]:
    """``qlora(device, **QLoRAConfig fields)``: a model built once per session per configuration."""

    def get(device: str = "cpu", **kw: Any) -> QLoRAModel:
        from vramguard.workload.models import QLoRAConfig, build_qlora

        need("transformers_4bit", device)
        if kw.get("quant_type") == "fp4":
            need("fp4_cpu", device)
        cfg = QLoRAConfig(
            **{
                "model": "tiny-llama",
                "seq_len": SEQ,
                "batch": BATCH,
                "lora_rank": RANK,
                "device": device,
                **kw,
            }
        )
        key = tuple(sorted((k, str(v)) for k, v in cfg.to_dict().items()))
        if key not in _MODELS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _MODELS[key] = build_qlora(cfg)
        return _MODELS[key]

    return get
