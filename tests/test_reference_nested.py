"""vramguard.grad.reference: the nested-statistics check holds each block scale to its *nearest* code of
the 8-bit dynamic map (written from the format's definition), and the LLM.int8() output floor."""

from __future__ import annotations

import bitsandbytes.functional as bnbF
import pytest
import torch

from vramguard.grad import reference


def test_the_dynamic_map_is_the_one_bitsandbytes_defines() -> None:
    """Written from the definition, it equals the library's create_dynamic_map code for code."""
    lib = bnbF.create_dynamic_map(signed=True).to(torch.float64).sort().values
    assert torch.equal(torch.tensor(reference.DYNAMIC_CODE, dtype=torch.float64), lib)
    lo, hi = reference.dynamic_most_negative_band()
    assert -1 < lo < reference.DYNAMIC_CODE[0] < hi < reference.DYNAMIC_CODE[1]


def _nested(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(seed))
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    return w, packed, reference.used_4bit_absmax(qs)


def test_nested_scales_at_their_nearest_code_pass_and_one_code_off_fails() -> None:
    """Each block scale rebuilt from the nearest dynamic code passes; moving one block to the neighbouring
    code (the error of 0.46-0.49's overwritten map, half the map's largest gap) fails and names the block."""
    w, packed, _ = _nested(0)
    mean, group, pos = reference.nested_statistics(w, 64)
    table = torch.tensor(reference.DYNAMIC_CODE, dtype=torch.float64)
    idx = (pos.unsqueeze(1) - table).abs().argmin(1)
    exact = (table[idx] * group + mean).to(torch.float32).to(torch.float64)
    reference.check_4bit_quantization(w, packed, exact, 64, "nf4", nested=True)
    j = int((pos.abs() < 0.9).nonzero()[0])
    wrong = exact.clone()
    wrong[j] = (table[idx[j] + 1] * group[j] + mean).item()
    with pytest.raises(reference.StateMismatch, match=f"block {j} scale"):
        reference.check_4bit_quantization(w, packed, wrong, 64, "nf4", nested=True)


def test_the_installed_release_passes_or_has_the_probed_defect() -> None:
    """Random nested weights: the installed bitsandbytes stores every scale at its nearest code (within
    the tie slack), unless the dynamic-map defect is probed here and a scale lies in its band."""
    from vramguard.grad import capabilities

    lo, hi = reference.dynamic_most_negative_band()
    for seed in range(20):
        w, packed, absmax = _nested(seed)
        _, _, pos = reference.nested_statistics(w, 64)
        in_band = bool(((pos > lo) & (pos < hi)).any())
        if in_band and not capabilities.get("defect:dynamic_map_cpu"):
            continue
        reference.check_4bit_quantization(w, packed, absmax, 64, "nf4", nested=True)


def test_int8_floor_is_the_size_of_the_partial_results() -> None:
    """Outlier columns that cancel the int8 part: the floor is the sum of their |terms| plus |int8 part|,
    far above |output|; without outliers it is |output| (no partial results to round)."""
    x = torch.tensor([[8.0, -8.0, 0.5, 0.25]])
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    got = reference.int8_partial_magnitude(x, w, threshold=3.0)
    assert got == pytest.approx(16 + 0.75, rel=2e-2)
    calm = torch.tensor([[0.5, -0.5, 0.5, 0.25]])
    y = (reference.int8_activation(calm.double(), 3.0) @ w.T).abs().item()
    assert reference.int8_partial_magnitude(calm, w, threshold=3.0) == pytest.approx(y)


def test_int8_rows_of_fp16_subnormal_size_are_held_to_the_cast_not_to_a_relative_bound() -> None:
    """A row whose absmax is an fp16 subnormal (1.49215e-05: the fp16 cast is 1.49012e-05, 0.14 % off) is
    the cast's rounding, not a defect (found by the nightly profile, W(44,1) fp32); a scale 1 % off still
    fails."""
    import bitsandbytes.functional as bnbF

    w = torch.tensor([[1.49215e-05], [0.5], [-2.0]], dtype=torch.float32)
    cb, scb, _ = bnbF.int8_vectorwise_quant(w.to(torch.float16))
    reference.check_int8_rows(w, cb, scb, "8-bit weight")
    with pytest.raises(reference.StateMismatch, match="row 1 scale"):
        reference.check_int8_rows(w, cb, scb * torch.tensor([1.0, 1.01, 1.0]), "8-bit weight")


def test_a_few_dominant_terms_set_the_floor_by_their_root_sum_square() -> None:
    """The nightly profile's counterexample on 0.50.0 (8-bit, MatMul8bitFp in bf16, one output of 160
    terms, a few of them dominant): rounding each dequantized weight to bf16 moved the output by 0.0058,
    2.1 units of bf16 roundoff of |y| = 0.369. Its terms' root-sum-square (1.24) is the scale of that error;
    the sum of |terms| over sqrt(K) (0.72) underestimated it. The case passes, and its floor is the former."""
    import math

    from vramguard.grad import runner, strategies

    case = strategies.Linear8bitCase(
        (1,), 160, 1, torch.bfloat16, 0.0, (), False, False, "module", True, False, 121
    )
    obs = runner.check(case)
    _, magnitude, k = obs.expected["output"]
    t = runner._inputs(case)
    assert obs.floor["output"] > 1.5 * torch.linalg.vector_norm(magnitude).item() / math.sqrt(k)
    assert obs.floor["output"] == pytest.approx(
        torch.linalg.vector_norm(t["x"].double().reshape(-1) * t["weight"].double().reshape(-1)).item(),
        rel=0.02,
    )


def test_a_rank_one_lora_gradient_is_held_to_the_tail_of_one_dot_product() -> None:
    """The nightly profile's counterexample on 0.48.0 (it fails the same way on 0.50.2): the LoRA A gradient
    of one row is ``scaling * (B^T g) x^T``, so its error is that of r = 2 sums of 26 fp32 terms, with no
    averaging over elements: 1.12 x u32 sqrt(K) after the input/output roundings, a tail of one sum's
    rounding error, not a defect. It passes; the same gradient 1e-5 off still fails."""
    from vramguard.grad import runner, strategies

    case = strategies.LoraCase(
        base="4bit", lead=(1,), in_features=32, out_features=26, dtype=torch.float32, rank=2, alpha=1,
        dropout=0.0, quant_type="nf4", compress_statistics=False, blocksize=32, bias=False,
        input_requires_grad=False, seed=26, use_rslora=True,
    )  # fmt: skip
    obs = runner.run(case)
    runner.assert_matches_reference(case, obs)
    obs.grads["grad_lora_A"] = obs.grads["grad_lora_A"] * (1 + 1e-5)
    with pytest.raises(runner.GradMismatch, match="grad_lora_A"):
        runner.assert_matches_reference(case, obs)
