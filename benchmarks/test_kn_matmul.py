"""Benchmark of the deprecated [K, N] ``matmul_4bit`` call form: what one forward keeps for backward.

A stack of ``layers.N``, each calling ``bnb.matmul_4bit(x, W, quant_state)`` with a weight quantized
from a [K, N] tensor (K != N). From bitsandbytes 0.50.0 that form dequantizes and calls ``F.linear``
outside the autograd Function, under grad, so the whole dequantized weight is kept per layer (a
``weight-copy`` in the saved-tensor ledger); 0.49.x computed it inside ``MatMul4Bit.forward`` and kept
nothing weight-sized. Swept across releases with ``vramguard sweep`` (docs/benchmarks.md, docs/measurements/bnb-sweep-cpu/).
Only the forward is measured: backward of this form fails on some releases (a separate defect).
"""

from __future__ import annotations

import time
import warnings

import bitsandbytes as bnb
import pytest
import torch

from vramguard.history.bench import _saved_per_layer
from vramguard.measure.ledger import SavedTensorLedger
from vramguard.measure.tracker import MemoryTracker

K, N, LAYERS, TOKENS = 256, 384, 4, 64


class KNLayer(torch.nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        layer = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(k, n), requires_grad=False, quant_type="nf4")  # [K, N]
        # quantized; held by this layer itself, so the ledger counts a copy of it as this layer's
        self.weight = layer.to("cpu").weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bnb.matmul_4bit(x, self.weight, quant_state=self.weight.quant_state)


class KNStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(KNLayer(*((K, N) if i % 2 == 0 else (N, K))) for i in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.benchmark
def test_matmul_4bit_kn_form_cpu(benchmark) -> None:
    model = KNStack()
    x = torch.randn(TOKENS, K, dtype=torch.bfloat16, requires_grad=True)
    payload: dict = {}

    def target() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ledger = SavedTensorLedger(model)
            with MemoryTracker("cpu") as tracker:
                start = tracker.current()
                t0 = time.perf_counter()
                with tracker.phase("forward"), ledger:
                    y = model(x)
                elapsed = time.perf_counter() - t0
                after = tracker.current()
        per_layer = _saved_per_layer(ledger)
        payload.update(
            schema=1,
            device="cpu",
            source="storage-tracker",
            baseline="above-model",
            params={"layers": LAYERS, "k": K, "n": N, "tokens": TOKENS, "form": "kn"},
            metrics={
                "peak_allocated": tracker.result.phases["forward"].peak_bytes,
                "peak_reserved": None,
                "retained_after_forward": after - start,
                "saved_bytes": ledger.report.saved_bytes,
                "saved_per_layer_max": per_layer["max_bytes"],
                "step_time": elapsed,
            },
            phases={
                "forward": {
                    "peak_allocated": tracker.result.phases["forward"].peak_bytes,
                    "peak_reserved": None,
                }
            },
            saved_per_layer=per_layer,
            weight_copy_bytes=ledger.report.weight_copy_bytes,
            output_shape=list(y.shape),
        )

    benchmark.pedantic(target, rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info["vramguard"] = payload
    # Only the memory is this benchmark's to check: some releases (0.46-0.47 at least) give another output
    # width for this deprecated form (recorded in ``output_shape``; correctness is tests_grad's and capabilities').
    assert payload["output_shape"][0] == TOKENS
    # the step was measured; saved bytes may be 0 (0.49.x and older keep nothing weight-sized here)
    assert payload["metrics"]["peak_allocated"] > 0
