"""The trainer's autocast on meta is the target's: accelerate wraps the model's forward in an autocast on its
own device (the host's CPU here, the GPU in the user's run), and the meta step runs it as the target's
(``--target cuda``: CUDA's autocast state and policy), so TRL's SFTTrainer with ``bf16`` prices what the
user's CUDA run computes, FlashAttention-2 included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vramguard.cli.app import main

pytest.importorskip("trl")

B, S, HEADS, KV_HEADS, HEAD_DIM = 2, 64, 4, 2, 32  # tiny-llama


def _sft_records(tmp_path: Path, *flags: str) -> list[dict[str, Any]]:
    """trl sft's step (flags alone: TRL's defaults, bf16 over an fp32 compute dtype) on meta for CUDA, without
    checkpointing (so the attention's saved tensors are the forward's), as the JSON report's records."""
    out = tmp_path / "e.json"
    argv = ["estimate", "--model", "tiny-llama", "--seq-len", str(S), "--batch", str(B), "--steps", "1"]
    assert main([*argv, "--no-gradient-checkpointing", *flags, "--quiet", "--json", str(out)]) in (0, 1)
    return json.loads(out.read_text())["records"]


def _attention(records: list[dict[str, Any]], node: str) -> set[tuple[str, tuple[int, ...]]]:
    return {
        (r["dtype"], tuple(r["shape"]))
        for r in records
        if r["module"].endswith("layers.1.self_attn") and r["node"] == node
    }


def test_trl_sfts_bf16_step_runs_cudas_autocast_on_meta(tmp_path: Path) -> None:
    """Under CUDA's bf16 autocast sdpa's inputs are bf16, so this grouped-query model's attention runs flash
    and keeps no s x s tensor; without the target's autocast (the host CPU's autocast casts no meta tensor)
    the fp32 attention on CUDA is the math composite, which keeps the fp32 b x a x s x s probabilities."""
    records = _sft_records(tmp_path)
    assert not any(r["shape"][-2:] == [S, S] for r in records), "the s x s probabilities were saved"
    flash = _attention(records, "ScaledDotProductFlashAttentionForCpuBackward0")  # meta's stand-in for CUDA's
    assert ("bfloat16", (B, HEADS, S, HEAD_DIM)) in flash and ("float32", (B, HEADS, S)) in flash


def test_trl_sft_prices_flash_attention_2_with_the_bf16_q_k_v_transformers_casts_to(tmp_path: Path) -> None:
    """``--attn-implementation flash_attention_2`` with flags alone (refused before: fp32 attention). q, k and
    v reach transformers' flash path in fp32 (bitsandbytes' 4-bit layer returns its fp32 input's dtype); it
    casts them to CUDA's autocast dtype (``get_target_dtype``), and flash-attn 2 saves bf16 q, k, v and output,
    the fp32 logsumexp and its rng state."""
    records = _sft_records(tmp_path, "--attn-implementation", "flash_attention_2")
    saved = _attention(records, "FlashAttnFuncBackward")
    assert saved == {
        ("bfloat16", (B, S, HEADS, HEAD_DIM)),  # q and the output
        ("bfloat16", (B, S, KV_HEADS, HEAD_DIM)),  # k and v, at their own heads
        ("float32", (B, HEADS, S)),  # softmax_lse
        ("int64", (2,)),  # rng_state
    }
