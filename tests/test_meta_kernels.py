"""The meta step's own Meta kernels (vramguard.estimate.meta_kernels): in place over the step, torch's after it.

``.item()`` of a meta scalar (a trainer's logging) and ``_grouped_mm`` of fp32 experts are answered by Meta kernels
registered for the step instead of dispatch modes that every op of the step passed through; these tests hold
that each is answered inside and that torch's own kernel is the op's again afterwards, however the block ends.
"""

from __future__ import annotations

import pytest
import torch

from vramguard.estimate.meta import forced_decisions
from vramguard.estimate.meta_kernels import ITEMS_ANSWERED, meta_kernels


def _meta_kernel_of(op: str) -> str:
    """The dispatcher's line for ``op``'s active Meta kernel (where it was registered)."""
    lines = torch._C._dispatch_dump(f"aten::{op}").splitlines()
    return next(line for line in lines if line.startswith("Meta:"))


def _grouped_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A grouped matmul's tokens (16 x 16), 4 experts' weights (4 x 16 x 32) and offsets, on meta."""
    a = torch.empty(16, 16, dtype=dtype, device="meta")
    b = torch.empty(4, 16, 32, dtype=dtype, device="meta")
    return a, b, torch.empty(4, dtype=torch.int32, device="meta")


def test_item_of_a_meta_scalar_is_answered_inside_and_raises_outside_as_torch_does() -> None:
    torch_own = _meta_kernel_of("_local_scalar_dense")
    scalar = torch.empty((), device="meta")
    with meta_kernels(ITEMS_ANSWERED):
        assert scalar.item() == 1
        assert bool(torch.empty((), dtype=torch.bool, device="meta")) is True
        assert _meta_kernel_of("_local_scalar_dense") != torch_own
    assert _meta_kernel_of("_local_scalar_dense") == torch_own
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        scalar.item()


def test_torch_kernel_is_back_when_the_block_raises() -> None:
    torch_own = _meta_kernel_of("_local_scalar_dense")
    with pytest.raises(KeyError), meta_kernels(ITEMS_ANSWERED):
        raise KeyError("the step failed")
    assert _meta_kernel_of("_local_scalar_dense") == torch_own
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        torch.empty((), device="meta").item()


def test_fp32_grouped_mm_is_answered_in_the_step_and_torch_refuses_it_after() -> None:
    torch_own = _meta_kernel_of("_grouped_mm")
    a, b, offs = _grouped_inputs(torch.float32)
    with forced_decisions("cpu") as taken:
        out = torch._grouped_mm(a, b, offs=offs)
        bf16 = torch._grouped_mm(*_grouped_inputs(torch.bfloat16)[:2], offs=offs)  # torch's own meta kernel
        assert _meta_kernel_of("_grouped_mm") != torch_own  # a kernel, not a mode every op passes through
    assert (out.shape, out.dtype, bf16.shape, bf16.dtype) == ((16, 32), torch.float32, (16, 32), torch.bfloat16)
    assert taken["grouped_mm"] == 1  # the fp32 call, not the bf16 one
    assert _meta_kernel_of("_grouped_mm") == torch_own
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(a, b, offs=offs)


def test_a_tensor_has_a_value_only_while_the_tensor_given_it_lives() -> None:
    """The routed values' dictionary (``_Valued``) answers "has it a value?" from the ids of the tensors given one
    before asking its weak dictionary: a tensor given a value has it, another has not, and one made after the
    first is freed, at the same id, has none either."""
    import gc

    from vramguard.estimate.meta import _Valued

    values = _Valued()
    given, other = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    values[given] = torch.arange(3)
    assert given in values and other not in values and 1 not in values
    old_id = id(given)
    del given
    gc.collect()
    for _ in range(1000):  # a new tensor at the freed one's address, where the allocator gives it back
        reused = torch.empty(3, device="meta")
        if id(reused) == old_id:
            assert old_id in values.given and reused not in values
            break
    assert len(values) == 0
    values.setdefault(other, torch.zeros(3))
    values.update({reused: torch.ones(3)})
    assert other in values and reused in values


def test_nested_blocks_for_one_op_give_back_the_outer_kernel_then_torchs() -> None:
    """Nested use (review): an inner block for the same op answers inside it, the outer block's kernel answers
    again once the inner one ends (even by an exception), and torch's own after the outer one; a CPU scalar's
    ``.item()`` is its value throughout (the Meta key only)."""
    torch_own = _meta_kernel_of("_local_scalar_dense")
    scalar, host = torch.empty((), device="meta"), torch.tensor(2.5)
    with meta_kernels(ITEMS_ANSWERED):
        with pytest.raises(KeyError), meta_kernels({"_local_scalar_dense": lambda s: 7}):
            assert scalar.item() == 7 and host.item() == 2.5
            raise KeyError("the inner step failed")
        assert scalar.item() == 1 and host.item() == 2.5
    assert _meta_kernel_of("_local_scalar_dense") == torch_own
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        scalar.item()


def test_a_kernel_the_shape_cache_does_not_know_is_refused() -> None:
    """The shape cache leaves the ops in ``STEP_KERNELS`` to their kernel (their kernels count what they answer);
    a step kernel for any other op would be answered from the cache unseen, so ``meta_kernels`` refuses it."""
    from vramguard.estimate.meta_kernels import STEP_KERNELS

    with pytest.raises(ValueError, match="not in STEP_KERNELS: mm"):
        with meta_kernels({"mm": lambda *args: None}):
            pass
    assert {"_local_scalar_dense", "_grouped_mm"} == STEP_KERNELS
