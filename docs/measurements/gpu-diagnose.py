"""Why two GPU results differ from the CPU ones (issue 15, run on the lent H100):

1. sdpa: which attention kernel torch picks for a tiny Llama (GQA) in bf16 and fp32, with the arguments
   transformers passes, and why the fused kernels are refused (torch warns with the reason when a backend
   is forced).
2. What a QLoRA step leaves allocated on CUDA besides the optimizer state (step 1), with and without
   cuBLAS's workspaces, and the allocation stacks of what remains.
usage: python docs/measurements/gpu-diagnose.py
"""

from __future__ import annotations

import gc
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vramguard.measure.tracker import MemoryTracker
from vramguard.workload.models import QLoRAConfig, build_qlora
from vramguard.workload.training import make_optimizer, train_step

calls: list[dict] = []
_sdpa = F.scaled_dot_product_attention


def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
    if len(calls) < 2:
        info = dict(
            q=tuple(q.shape),
            k=tuple(k.shape),
            dtype=str(q.dtype),
            mask=None if attn_mask is None else (tuple(attn_mask.shape), str(attn_mask.dtype)),
            dropout_p=dropout_p,
            is_causal=is_causal,
            enable_gqa=enable_gqa,
            kw=list(kw),
            contiguous=[t.is_contiguous() for t in (q, k, v)],
        )
        try:
            info["choice"] = int(
                torch._fused_sdp_choice(
                    q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
                )
            )
        except Exception as e:  # noqa: BLE001
            info["choice"] = repr(e)
        for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            with warnings.catch_warnings(record=True) as w, sdpa_kernel([b]):
                warnings.simplefilter("always")
                try:
                    _sdpa(
                        q.detach(),
                        k.detach(),
                        v.detach(),
                        attn_mask=attn_mask,
                        dropout_p=dropout_p,
                        is_causal=is_causal,
                        scale=scale,
                        enable_gqa=enable_gqa,
                    )
                    info[b.name] = "ok"
                except Exception as e:  # noqa: BLE001
                    info[b.name] = f"refused: {str(e)[:150]} | " + " | ".join(str(x.message)[:200] for x in w)
        calls.append(info)
    return _sdpa(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        **kw,
    )


print(
    "sdp flags: flash",
    torch.backends.cuda.flash_sdp_enabled(),
    "mem_eff",
    torch.backends.cuda.mem_efficient_sdp_enabled(),
    "cudnn",
    torch.backends.cuda.cudnn_sdp_enabled(),
    "math",
    torch.backends.cuda.math_sdp_enabled(),
    "deterministic",
    torch.are_deterministic_algorithms_enabled(),
)
F.scaled_dot_product_attention = spy
import transformers.integrations.sdpa_attention as sa  # noqa: E402

sa.torch.nn.functional.scaled_dot_product_attention = spy
for model, dtype in (("tiny-llama-hf", "bf16"), ("tiny-llama-hf", "fp32"), ("llama-1b-shape", "bf16")):
    calls.clear()
    q = build_qlora(QLoRAConfig(model=model, compute_dtype=dtype, device="cuda", seq_len=128))
    b = q.batch(0)
    print(model, dtype, "batch keys", {k: (tuple(v.shape), str(v.dtype)) for k, v in b.items()})
    q.model(**b).loss.backward()
    for c in calls:
        print("  ", c)
    del q, b
    gc.collect()
    torch.cuda.empty_cache()

F.scaled_dot_product_attention = _sdpa
sa.torch.nn.functional.scaled_dot_product_attention = _sdpa
for dtype in ("fp32", "bf16"):
    q = build_qlora(QLoRAConfig(model="tiny-llama", compute_dtype=dtype, device="cuda"))
    opt = make_optimizer(q)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    with MemoryTracker("cuda") as tracker:
        for step in range(2):
            train_step(q, opt, tracker, step)
            gc.collect()
            a = tracker.current()
            torch._C._cuda_clearCublasWorkspaces()
            print(
                dtype, f"step {step}: retained {a} B, after clearing cuBLAS workspaces {tracker.current()} B"
            )
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    opt_bytes = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.is_cuda
    )
    print(dtype, "optimizer state on cuda", opt_bytes)
    blocks = [b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    blocks.sort(key=lambda b: -b["size"])
    for b in blocks[:6]:
        frames = [
            f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}"
            for f in b.get("frames", [])
            if "python" not in f["filename"] or True
        ][:14]
        print("   block", b["size"], frames)
    del q, opt
    gc.collect()
