"""``attn_implementation="flash_attention_2"`` on the meta device, priced by flash-attn 2's own rules.

The ``flash_attn`` package is CUDA-only (no CPU build exists), so it is not installed here and transformers
refuses to build a model with ``flash_attention_2`` without it. The meta run builds the model with sdpa, then
sets its config to ``flash_attention_2``, so transformers' own flash path runs: its mask functions,
``flash_attention_forward`` (q, k, v transposed to ``b x s x h x d``) and ``_flash_attention_forward``
(fp32 q, k, v cast to the target dtype: the autocast dtype, else the quantized model's dtype). Only the two
things that need the package or a device are answered here: whether a batch-1 row without varlen boundaries
holds packed sequences (read from the position ids' values: one sequence per row, as the synthetic rows; a
padding-free batch brings TRL's boundaries, and if they do not reach the flash path the run is refused, not
priced as one long sequence), the flash functions (:func:`flash_attn_func`, which follows
``flash_attn_interface.FlashAttnFunc`` and ``csrc/flash_attn/flash_api.cpp``'s ``mha_fwd`` / ``mha_bwd``, as
of flash-attn 2.8, whose ``rounded(d)`` is :func:`head_dim_rounded`) and the autocast query on a meta
tensor's device.

What ``FlashAttnFunc`` saves for backward: q, k, v (the head dim padded to a multiple of 8), the padded output
(``b x s x h x d``, q's dtype), ``softmax_lse`` (fp32, ``b x h x s``) and ``rng_state`` (2 int64): no
``s x s`` tensor. Its backward allocates dq, dk, dv (like q, k, v), ``softmax_d`` (fp32, ``b x h x
round128(s)``), ``dq_accum`` (fp32, ``b x round128(s) x h x rounded(d)``) and, with fewer k/v heads,
``dk_expanded`` and ``dv_expanded`` (``b x s x h x d``) summed into dk and dv.

The varlen path (:func:`flash_attn_varlen_func`: TRL's padding-free batches, whose collator passes
``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k``, so transformers flattens q, k, v to ``total x h x d``
and calls it) follows ``FlashAttnVarlenFunc`` and ``mha_varlen_fwd`` / ``mha_varlen_bwd``: the same saved
tensors with an unpadded ``h x total`` logsumexp, and in backward ``softmax_d`` (fp32, ``h x (total + 128
x sequences)``) and ``dq_accum`` (fp32, ``(total + 128 x sequences) x h x rounded(d)``): 128 rows more per
sequence in the batch, so the number of sequences, not only the tokens, moves the backward peak. Not run:
split-kv's accumulators (decoding-sized queries only) and deterministic backward (its ``dq_accum`` has one
split per streaming multiprocessor group: refused).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vramguard.errors import UsageError
from vramguard.step.patching import patch_all

FLASH_ATTENTION_2 = "flash_attention_2"


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def head_dim_rounded(d: int) -> int:
    """``head_size_rounded`` of flash-attn 2.8's ``flash_api.cpp`` (the head dim already padded to a multiple
    of 8): to a multiple of 32 up to 128, of 64 above (2.7 and earlier: 32 up to 192, then 256)."""
    return _round(d, 32 if d <= 128 else 64)


VARLEN_ROWS_PER_SEQUENCE = 128
"""``mha_varlen_bwd`` keeps each sequence of ``softmax_d`` and ``dq_accum`` 128 rows (its largest query block)
apart from the next: each sequence in a varlen batch adds these rows."""


def varlen_bytes_per_sequence(heads: int, head_dim: int) -> int:
    """What one more sequence costs the varlen backward: :data:`VARLEN_ROWS_PER_SEQUENCE` rows of the fp32
    ``softmax_d`` (``h x rows``) and ``dq_accum`` (``rows x h x rounded(d)``), the head dim padded to 8."""
    return VARLEN_ROWS_PER_SEQUENCE * heads * 4 * (1 + head_dim_rounded(_round(head_dim, 8)))


def _padded_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as both kernels take them: fp16/bf16 only, the head dim padded to a multiple of 8 (a copy),
    the last dimension contiguous."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise UsageError(f"flash_attention_2 takes fp16/bf16 only; the attention here is {q.dtype}")
    d = q.shape[-1]
    if d % 8:
        pad = [0, 8 - d % 8]
        q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


class FlashAttnFunc(torch.autograd.Function):
    """flash-attn 2's ``FlashAttnFunc`` on meta: the tensors it allocates and saves, by its rules."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``_flash_attn_forward``'s allocations: the head dim padded to a multiple of 8, the padded output,
        an fp32 ``b x h x s`` logsumexp and the rng state, all saved for backward; no ``s x s`` tensor."""
        b, s, h, d = q.shape
        q, k, v = _padded_inputs(q, k, v)
        out_padded = torch.empty(b, s, h, q.shape[-1], dtype=q.dtype, device=q.device)
        softmax_lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
        rng_state = torch.empty(2, dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
        ctx.head_dim = d
        return out_padded[..., :d]

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        """``_flash_attn_backward``'s allocations: dq, dk, dv, ``dout`` padded like q, ``softmax_d`` and the
        fp32 ``dq_accum`` (rows rounded to 128), and for grouped k/v heads the per-query-head dk/dv it sums per
        group."""
        q, k, v, _out, _lse, _rng = ctx.saved_tensors
        b, s, h, d = q.shape
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        og = ctx.head_dim
        dout_padded = torch.nn.functional.pad(dout, [0, 8 - og % 8]) if og % 8 else dout
        softmax_d = torch.empty(b, h, _round(s, 128), dtype=torch.float32, device=q.device)
        dq_accum = torch.empty(
            b, _round(s, 128), h, head_dim_rounded(d), dtype=torch.float32, device=q.device
        )
        if k.shape[2] != h:  # grouped k/v heads: expanded gradients, summed per group
            dk_expanded = torch.empty(b, k.shape[1], h, d, dtype=q.dtype, device=q.device)
            dv_expanded = torch.empty(b, v.shape[1], h, v.shape[-1], dtype=q.dtype, device=q.device)
            del dk_expanded, dv_expanded
        del softmax_d, dq_accum, dout_padded
        return dq[..., :og], dk[..., :og], dv[..., :og]


class FlashAttnVarlenFunc(torch.autograd.Function):
    """flash-attn 2's ``FlashAttnVarlenFunc`` on meta: q, k, v flattened to ``total x h x d`` with the
    sequences' boundaries in ``cu_seqlens`` (``sequences + 1`` int32); only shapes decide a byte."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor
    ) -> torch.Tensor:
        """``_flash_attn_varlen_forward``'s allocations: the head dim padded to a multiple of 8, the padded
        output, the unpadded fp32 ``h x total`` logsumexp and the rng state, saved for backward with the
        boundaries."""
        total, h, d = q.shape
        q, k, v = _padded_inputs(q, k, v)
        out_padded = torch.empty(total, h, v.shape[-1], dtype=q.dtype, device=q.device)
        softmax_lse = torch.empty(h, total, dtype=torch.float32, device=q.device)
        rng_state = torch.empty(2, dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out_padded, softmax_lse, cu_q, cu_k, rng_state)
        ctx.head_dim = d
        return out_padded[..., :d]

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        """``_flash_attn_varlen_backward``'s allocations: dq, dk, dv, ``dout`` padded like q, and
        ``mha_varlen_bwd``'s ``softmax_d`` and ``dq_accum`` (128 rows more per sequence), and for grouped
        k/v heads the per-query-head dk/dv it sums per group."""
        q, k, v, _out, _lse, cu_q, _cu_k, _rng = ctx.saved_tensors
        total, h, d = q.shape
        sequences = cu_q.shape[0] - 1
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        og = ctx.head_dim
        dout_padded = torch.nn.functional.pad(dout, [0, 8 - og % 8]) if og % 8 else dout
        rows = total + VARLEN_ROWS_PER_SEQUENCE * sequences
        softmax_d = torch.empty(h, rows, dtype=torch.float32, device=q.device)
        dq_accum = torch.empty(rows, h, head_dim_rounded(d), dtype=torch.float32, device=q.device)
        if k.shape[1] != h:  # grouped k/v heads: expanded gradients, summed per group
            dk_expanded = torch.empty(k.shape[0], h, d, dtype=q.dtype, device=q.device)
            dv_expanded = torch.empty(v.shape[0], h, v.shape[-1], dtype=q.dtype, device=q.device)
            del dk_expanded, dv_expanded
        del softmax_d, dq_accum, dout_padded
        return dq[..., :og], dk[..., :og], dv[..., :og], None, None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    """flash-attn 2's ``flash_attn_func`` (its signature, which transformers reads), priced on meta."""
    _refuse(dropout_p, deterministic)
    return FlashAttnFunc.apply(q, k, v)


def _refuse(dropout_p: float, deterministic: bool) -> None:
    if dropout_p:
        raise UsageError("flash_attention_2 with attention dropout is not priced")
    if deterministic:
        raise UsageError(
            "flash_attention_2's deterministic backward is not priced (its dq_accum depends on the GPU's "
            "multiprocessor count)"
        )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Any = None,
) -> torch.Tensor:
    """flash-attn 2's varlen entry point (its signature, which transformers reads), priced on meta."""
    _refuse(dropout_p, deterministic)
    if block_table is not None:
        raise UsageError("flash_attention_2 with a paged KV cache is not priced (training has none)")
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k)


@contextlib.contextmanager
def flash_attention_2(
    model: torch.nn.Module, target: str, one_sequence_per_row: bool | None = None
) -> Iterator[None]:
    """Within the block ``model`` runs transformers' ``flash_attention_2`` path, with :func:`flash_attn_func`
    for the package's kernel and ``target``'s autocast for a meta query's device. ``one_sequence_per_row``:
    whether the real batch's rows hold one sequence each (False for a padding-free batch of several: its
    boundaries must reach the varlen kernel, or the run is refused); None: the meta run's answer when asked
    (:data:`vramguard.estimate.meta.ROWS`, the padding-free technique's context). The library's globals and the
    model's configs are patched through the one helper (:func:`vramguard.step.patching.patched`)."""
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.integrations import flash_attention as fa

    original_import = fa_utils.lazy_import_flash_attention
    original_target = fa.get_target_dtype

    def lazy_import_flash_attention(implementation: Any, *args: Any, **kwargs: Any) -> Any:
        if implementation != FLASH_ATTENTION_2:
            return original_import(implementation, *args, **kwargs)
        process = fa_utils._lazy_define_process_function(flash_attn_varlen_func)
        return (flash_attn_func, flash_attn_varlen_func, None, None, None), (process, dict)

    def get_target_dtype(query: torch.Tensor, module: torch.nn.Module) -> Any:
        if query.device.type != "meta" or query.dtype != torch.float32:
            return original_target(query, module)
        if torch.is_autocast_enabled(target):
            return torch.get_autocast_dtype(target)
        if hasattr(module.config, "_is_quantized"):
            return module.config.dtype
        return next(m for m in module.modules() if isinstance(m, torch.nn.Linear)).weight.dtype

    configs = [c for c in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()]
    original_packed = fa_utils._is_packed_sequence

    def _is_packed_sequence(position_ids: Any, batch_size: int) -> Any:
        if position_ids is None or position_ids.device.type != "meta":
            return original_packed(position_ids, batch_size)
        from vramguard.estimate.meta import ROWS, _AnswerScalars

        rows = ROWS.one_sequence if one_sequence_per_row is None else one_sequence_per_row
        if not rows:  # transformers would read the real position ids and go varlen without them
            raise UsageError(
                "flash_attention_2: the padding-free batch's boundaries (cu_seq_lens_q/_k) did not reach "
                "transformers' flash path, which would read them from the position ids on the device: not priced"
            )

        # batch 1 without varlen boundaries reads the position ids (a device sync per layer): the synthetic rows
        # hold one sequence each (a padding-free batch passes TRL's boundaries, so transformers takes the varlen
        # path before asking): the ops run, their test is answered as the device answers it
        with _AnswerScalars(False):
            return bool(original_packed(position_ids, batch_size))

    patches: list[tuple[Any, str, Any]] = [
        (c, "_attn_implementation", FLASH_ATTENTION_2) for c in configs if getattr(c, "_attn_implementation", None)
    ]
    patches += [
        (fa_utils, "_is_packed_sequence", _is_packed_sequence),
        (fa_utils, "lazy_import_flash_attention", lazy_import_flash_attention),
        (fa, "get_target_dtype", get_target_dtype),
    ]
    with contextlib.ExitStack() as stack:
        patch_all(stack, patches)
        yield
