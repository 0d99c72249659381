"""Who holds the device tensors TRL's activation offloading leaves after a step (issue 13): after an SFTTrainer
run with ``activation_offloading=True`` (tiny Llama, CUDA), every CUDA tensor the garbage collector can reach
that is neither a parameter, a buffer nor optimizer state, with the chain of objects that refer to it.
usage: python docs/measurements/gpu-trl-holder.py
"""

from __future__ import annotations

import dataclasses
import gc
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from test_integrations import CONFIG, _sft

from vramguard.integrations.transformers import VramGuardCallback
from vramguard.workload.models import build_qlora

tmp = pathlib.Path(tempfile.mkdtemp())
config = dataclasses.replace(CONFIG, device="cuda")


def describe(obj: object) -> str:
    if isinstance(obj, dict):
        owners = [
            type(o).__name__ for o in gc.get_referrers(obj) if hasattr(o, "__dict__") and o.__dict__ is obj
        ]
        keys = list(obj.keys())[:6]
        return f"dict(keys {keys}) of {owners or '?'}"
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__}[{len(obj)}]"
    return type(obj).__qualname__


def chain(t: object, depth: int = 4) -> list[str]:
    out, level, seen = [], [t], {id(t)}
    for _ in range(depth):
        nxt = []
        for o in level:
            for r in gc.get_referrers(o):
                if id(r) in seen or r is level or isinstance(r, type(sys._getframe())):
                    continue
                seen.add(id(r))
                nxt.append(r)
        if not nxt:
            break
        out.append(" | ".join(describe(r) for r in nxt[:5]))
        level = nxt[:5]
    return out


for offload in (False, True):
    cb = VramGuardCallback(table=False)
    trainer = _sft(build_qlora(config), cb, tmp, steps=2, use_cpu=False, activation_offloading=offload)
    trainer.train()
    gc.collect()
    torch.cuda.synchronize()
    model = trainer.model
    known = {p.untyped_storage().data_ptr() for p in model.parameters()}
    known |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    for state in trainer.optimizer.state.values():
        known |= {v.untyped_storage().data_ptr() for v in state.values() if isinstance(v, torch.Tensor)}
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            for v in vars(qs).values():
                if isinstance(v, torch.Tensor):
                    known.add(v.untyped_storage().data_ptr())
            nested = getattr(qs, "state2", None)
            if nested is not None:
                known |= {
                    v.untyped_storage().data_ptr()
                    for v in vars(nested).values()
                    if isinstance(v, torch.Tensor)
                }
    print(f"== activation_offloading={offload}: retained {[s.retained_bytes for s in cb.report.steps]}")
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.is_cuda and o.untyped_storage().data_ptr() not in known:
            print(f"  {tuple(o.shape)} {o.dtype} {o.untyped_storage().nbytes()} B grad_fn={o.grad_fn}")
            for line in chain(o):
                print("     <-", line)
    ctx = trainer.maybe_activation_offload_context
    for attr in ("tracker", "fwd_stash", "bwd_tensor_stash", "bwd_ev_stash", "storage_to_tensor_id"):
        if hasattr(ctx, attr):
            print(f"  offload context .{attr}: {len(getattr(ctx, attr))} entries")
    print(f"  offload context .curr_autograd_node: {getattr(ctx, 'curr_autograd_node', None)}")
    if offload:  # what each of the context's references keeps on the device
        for what in ("tracker", "curr_autograd_node"):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            if what == "tracker":
                kept = [
                    (tuple(v[0].shape), v[0].dtype, v[0].untyped_storage().nbytes())
                    for v in ctx.tracker.values()
                ]
                print(f"  tracker holds: {kept}")
                ctx.tracker.clear()
            else:
                ctx.curr_autograd_node = None
            gc.collect()
            torch.cuda.synchronize()
            print(
                f"  dropping the context's .{what} frees {before - torch.cuda.memory_allocated()} B on the device"
            )
    del cb, trainer, model
    gc.collect()
