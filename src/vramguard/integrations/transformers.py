"""``VramGuardCallback``: vramguard's measurements inside a user's own ``Trainer`` / ``SFTTrainer`` run.

>>> trainer = SFTTrainer(model=model, args=args, train_dataset=ds, callbacks=[VramGuardCallback(report_path="m.json")])
>>> trainer.train()

Per optimizer step it records the peak live bytes of three phases, with the same tracker and the same
phase boundaries as ``vramguard audit``'s loop:

* ``forward``: from the model's first forward call of the step (a forward pre-hook on the model the
  trainer calls) until backward starts, loss included;
* ``backward``: from the first backward node of the model's outputs (an autograd pre-hook on their
  ``grad_fn``) until the autograd engine finishes (a callback queued on the engine);
* ``optimizer``: from ``on_pre_optimizer_step`` to ``on_step_end`` (step, scheduler, ``zero_grad``).

Live bytes come from the CUDA caching allocator on a GPU and from the storage tracker elsewhere
(:mod:`vramguard.measure.tracker`), or on CPU with ``cpu_source="allocator"`` from the CPU allocator's own
events (:class:`~vramguard.measure.tracker.CpuAllocatorSource`, a few percent of a step instead of tens). After each step the bytes still live are the step's ``retained`` bytes;
retained memory that grows after the first step is a leak. One chosen step (``ledger_step``, 1-based)
also runs the saved-tensor ledger over its first forward, which gives the per-decoder-layer table.

The result is the ``vramguard audit --json`` document (:class:`vramguard.step.report.AuditReport`), written
atomically to ``report_path`` at the end of training, and ``vramguard/*`` metrics added to the logs
the trainer hands to ``on_log`` (callbacks that run after this one, e.g. TensorBoard or W&B when this
callback is inserted first, see them).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import TrainerCallback

from vramguard.atomic import write_bytes_atomic, write_text_atomic
from vramguard.errors import UsageError
from vramguard.measure.decoder import decoder_layer
from vramguard.measure.events import (
    GRADIENTS,
    OPTIMIZER,
    AllocationLog,
    dump_snapshot,
    model_storages,
    optimizer_state,
    timeline,
)
from vramguard.measure.ledger import LedgerReport, SavedTensorLedger, iter_graph
from vramguard.measure.offload import HostMeter, hooks_in_force
from vramguard.measure.tracker import (
    CpuAllocatorSource,
    CudaAllocatorSource,
    FrameStats,
    MemoryTracker,
    StorageTracker,
    source_for,
)
from vramguard.model.analytic import weights_expectation
from vramguard.step import verdict as checks
from vramguard.step.assemble import Measured, assemble, layer_rows
from vramguard.step.report import AuditReport, Finding, RankRow, StepRow
from vramguard.units import format_bytes, parse_size

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")
CPU_SOURCES: tuple[str, ...] = ("storage", "allocator")

NO_ANALYTIC_MODEL = (
    "the analytic activation model is not applied to a Trainer run (its loss, dtypes and collator are the "
    "trainer's: TRL's chunked log-prob loss and bf16 adapter inputs are not modelled)"
)


@dataclass
class _Step:
    step: int
    start: int
    loss: float | None = None
    after_forward: int | None = None
    retained: int = 0
    peaks: dict[str, int] = field(default_factory=dict)
    above: dict[str, int] = field(default_factory=dict)
    host_start: int | None = None  # set when activation offloading was in force in this step
    host_peak: int | None = None
    host_retained: int | None = None


class VramGuardCallback(TrainerCallback):
    """Per-phase peaks, retained bytes, a leak verdict and the per-layer ledger of one step.

    ``max_peak`` / ``max_saved_per_layer`` (size strings such as ``"20 GiB"``) stop training at the end
    of the first step that exceeds them, with one line on stderr; ``report.verdict`` says why.
    ``measure_every=N`` measures step 1, the ledger step and every N-th step after step 1 (1, 1+N,
    1+2N, ...); the other steps run with the storage tracker paused (on CPU it sees every op, which costs
    time) and are reported nowhere: no peaks, no retained bytes, no log metrics, no limit check.
    ``cpu_source`` picks what counts live bytes on CPU: ``"storage"`` (default), the storage tracker
    ``vramguard audit`` runs (the same numbers; it runs Python on every op: a measured small-llama step costs
    +20-35 % wall), or ``"allocator"``, the c10 CPU allocator's own events counted in C++ by torch's
    profiler (:class:`vramguard.measure.tracker.CpuAllocatorSource`: a few percent; it also sees kernels'
    scratch buffers). The allocator source cannot be read inside the autograd engine, so with it the
    backward phase opens and closes around torch's backward entry (wrapped while training), the ledger
    step's per-node backward attribution is not taken, and ``torch.profiler`` cannot run beside it.
    ``snapshot_path`` (CPU with the storage tracker): every allocation and free of the measured steps is logged
    (phase, autograd node; categories: the model's weights and trainable parameters, what the ledger step keeps
    for backward, gradients, optimizer state, temporaries) and written at the end of training as a PyTorch
    memory snapshot (``torch.cuda._memory_viz.trace_plot`` renders it; its replay gives the tracker's peak); the
    report then has a ``timeline``. Saved activations are named on the ledger step only.
    Bad arguments raise :class:`vramguard.errors.UsageError` here; a model without decoder layers or a
    ``ledger_step`` past ``max_steps`` raise it in ``on_train_begin``, before the first step.
    """

    def __init__(
        self,
        ledger_step: int = 1,
        max_peak: str | int | None = None,
        max_saved_per_layer: str | int | None = None,
        report_path: str | Path | None = None,
        table: bool = True,
        leak_tolerance: str | int | None = None,
        measure_every: int = 1,
        cpu_source: str = "storage",
        snapshot_path: str | Path | None = None,
    ) -> None:
        if isinstance(ledger_step, bool) or not isinstance(ledger_step, int) or ledger_step < 1:
            raise UsageError(
                f"ledger_step must be a step number >= 1 (1 is the first step), got {ledger_step!r}"
            )
        self.ledger_step = ledger_step
        if isinstance(measure_every, bool) or not isinstance(measure_every, int) or measure_every < 1:
            raise UsageError(f"measure_every must be a whole number of steps >= 1, got {measure_every!r}")
        self.measure_every = measure_every
        if cpu_source not in CPU_SOURCES:
            raise UsageError(f"cpu_source must be one of {', '.join(CPU_SOURCES)}, got {cpu_source!r}")
        self.cpu_source = cpu_source
        self.skipped_steps = 0
        self.max_peak = None if max_peak is None else parse_size(max_peak)
        self.max_saved_per_layer = None if max_saved_per_layer is None else parse_size(max_saved_per_layer)
        self.leak_tolerance = None if leak_tolerance is None else parse_size(leak_tolerance)
        self.report_path = None if report_path is None else Path(report_path)
        if self.report_path is not None and self.report_path.is_dir():
            raise UsageError(f"report_path {self.report_path} is a directory")
        self.snapshot_path = None if snapshot_path is None else Path(snapshot_path)
        if self.snapshot_path is not None and self.snapshot_path.is_dir():
            raise UsageError(f"snapshot_path {self.snapshot_path} is a directory")
        if self.snapshot_path is not None and cpu_source == "allocator":
            raise UsageError(
                "snapshot_path needs cpu_source='storage': the allocator source names no storages"
            )
        self.table = table
        self.steps: list[_Step] = []
        self.ledger: LedgerReport | None = None
        self.report: AuditReport | None = None
        self.stopped: str | None = None
        self.backward_nodes: dict[str, FrameStats] = {}
        self._attached = False
        self._reset()

    def _reset(self) -> None:
        self._tracker: MemoryTracker | None = None
        self._model: torch.nn.Module | None = None
        self._optimizer: Any = None
        self._paused = False
        self._handles: list[Any] = []
        self._phase: tuple[str, Any] | None = None  # (name, open phase context)
        self._step_cm: Any = None
        self._current: _Step | None = None
        self._calls: dict[str, FrameStats] = {}
        self._ledger: SavedTensorLedger | None = None
        self._ledger_handle: Any = None
        self._host: HostMeter | None = None
        self._host_cm: Any = None
        self._host_handle: Any = None
        self._node_frames: list[Any] = []
        self._t0 = 0.0
        self._trainer_name = "Trainer"
        self._config: dict[str, Any] = {}
        self._max_length: Any = None  # the arguments' max_length (SFTConfig), for a padding-free batch's seq_len
        self._events: AllocationLog | None = None

    # -- trainer events ---------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Attach to the trainer's model for this ``train()``: check that it has decoder layers and that
        ``ledger_step`` is reachable (:class:`UsageError` otherwise), start the tracker on ``args.device`` and
        install the model's forward hooks and the optimizer-step hook."""
        if model is None:
            raise UsageError("VramGuardCallback: the trainer passed no model to on_train_begin")
        layers = {decoder_layer(n) for n, _ in model.named_modules()} - {None}
        if not layers:
            raise UsageError(
                f"VramGuardCallback: {type(model).__name__} has no decoder layers (no module named '...layers.N'), "
                "so there is no per-layer ledger to take"
            )
        if state.max_steps and self.ledger_step > state.max_steps:
            raise UsageError(
                f"VramGuardCallback: ledger_step={self.ledger_step} is past the end of training "
                f"(max_steps={state.max_steps})"
            )
        if self._attached:  # an earlier train() that raised: on_train_end never came
            self._detach()
        self._remove_handles()  # hooks a forward that raised left registered (see _forward_post)
        if self._ledger is not None:  # a ledger aborted in a forward that raised
            self._ledger.__exit__(RuntimeError, None, None)
        self.steps, self.ledger, self.report, self.stopped = [], None, None, None
        self.backward_nodes = {}
        self.skipped_steps = 0
        self._reset()
        self._t0 = time.perf_counter()
        self._model = model
        self._optimizer = kwargs.get("optimizer")
        device = args.device
        self._trainer_name = _trainer_name(args)
        self._max_length = getattr(args, "max_length", None)  # SFTConfig's; TrainingArguments has none
        self._config = {
            "trainer": self._trainer_name,
            "model": getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__,
            "batch": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "gradient_checkpointing": bool(args.gradient_checkpointing),
            # Trainer's autocast: its bf16 copies of unquantized weights saved for backward are a note, not a problem
            "mixed_precision": "bf16"
            if getattr(args, "bf16", False)
            else "fp16"
            if getattr(args, "fp16", False)
            else "no",
            "max_steps": state.max_steps,
            "ledger_step": self.ledger_step,
            "measure_every": self.measure_every,
            "cpu_source": self.cpu_source,
            "device": str(device),
            # True once saved-tensor hooks (activation offloading, or any other pair) are seen in force at a forward
            "activation_offloading": False,
        }
        allocator = self.cpu_source == "allocator" and torch.device(device).type == "cpu"
        source = CpuAllocatorSource() if allocator else self._source_for(device)
        if self.snapshot_path is not None:
            if not isinstance(source, StorageTracker):
                raise UsageError(
                    f"VramGuardCallback: snapshot_path records the storage tracker's allocations (CPU), not {device}"
                )
            self._events = AllocationLog()
            self._events.add_preexisting(model_storages(model))
        self._tracker = MemoryTracker(device, source=source, events=self._events)
        try:
            self._tracker.__enter__()
        except RuntimeError as e:  # the allocator source finds a profiler running already
            raise UsageError(f"VramGuardCallback: cpu_source='allocator': {e}") from e
        self._attached = True
        if allocator:  # not readable inside the autograd engine: backward's phase is opened around it
            self._handles.append(_AroundBackward(self._backward_begin, self._backward_end))
        # the trainer hands callbacks the optimizer it had when built (None when it creates its own later):
        # the optimizer that steps is taken from a global step hook
        self._handles.append(register_optimizer_step_post_hook(self._saw_optimizer))
        self._handles.append(model.register_forward_pre_hook(self._forward_pre, with_kwargs=True))
        # always_call: it also runs when the model's forward raises, to take vramguard's hooks out then
        self._handles.append(model.register_forward_hook(self._forward_post, always_call=True))

    def _source_for(self, device: Any) -> Any:
        """What counts live bytes on ``device`` (the storage tracker off CUDA): a meta run's callback
        (:mod:`vramguard.integrations.trainer_step`) counts every device's storages instead."""
        return source_for(device)

    def measures(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is measured: step 1, the ledger step, every ``measure_every``-th."""
        return step == self.ledger_step or (step - 1) % self.measure_every == 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Open the step's frame and note the bytes live at its start; on a step :meth:`measures` skips, pause
        the storage tracker instead (the CUDA allocator's statistics need no pause)."""
        if self._tracker is None:
            return
        if not self.measures(state.global_step + 1):
            if isinstance(self._tracker.source, StorageTracker):
                self._tracker.source.pause()
                self._paused = True
            self.skipped_steps += 1
            return
        self._step_cm = self._tracker.phase("step")
        self._step_cm.__enter__()
        self._current = _Step(step=state.global_step + 1, start=self._tracker.current())
        if self._host is not None:
            self._host.reset_peak()
            self._current.host_start = self._host.current()
        self._calls = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the phase still open (backward) and open the ``optimizer`` phase, which runs until
        :meth:`on_step_end`."""
        if self._current is not None:
            if self._events is not None and self._model is not None:
                grads = (p.grad for p in self._model.parameters() if p.requires_grad and p.grad is not None)
                self._events.label_tensors(grads, GRADIENTS)
            self._open("optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the step: record each phase's peak and the bytes still live (``retained``), resume a paused
        tracker, and at the first step over ``max_peak`` or ``max_saved_per_layer`` stop training with one
        line on stderr."""
        self._resume()
        if self._tracker is None or self._current is None:
            return
        self._close()
        self._step_cm.__exit__(None, None, None)
        if self._events is not None and self._optimizer is not None:
            self._events.label_tensors(optimizer_state(self._optimizer), OPTIMIZER)
        s = self._current
        if isinstance(self._tracker.source, CudaAllocatorSource):
            self._tracker.source.settle()  # blocks freed after a copy stream's work are not retained
        s.retained = self._tracker.current()
        if self._host is not None and s.host_start is not None:
            s.host_peak, s.host_retained = self._host.peak(), self._host.current()
        for name, stats in self._calls.items():
            s.peaks[name] = stats.peak_bytes
            s.above[name] = stats.peak_above_start
        self.steps.append(s)
        self._current = None
        problem = self._limit_problem(s)
        if problem is not None and self.stopped is None:
            self.stopped = problem
            print(f"vramguard: stopping training: {problem}", file=sys.stderr)
            control.should_training_stop = True

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """On the trainer's loss log of a measured step, add ``vramguard/peak_<phase>_bytes``,
        ``vramguard/retained_bytes`` and ``vramguard/leak_bytes`` to ``logs`` (and to the log history's entry
        for that step), where the callbacks after this one see them."""
        if logs is None or not self.steps or "loss" not in logs:
            return
        s = self.steps[-1]
        if s.step != state.global_step:  # this step was not measured: nothing to log for it
            return
        metrics: dict[str, float] = {f"vramguard/peak_{k}_bytes": float(v) for k, v in s.peaks.items()}
        metrics["vramguard/retained_bytes"] = float(s.retained)
        metrics["vramguard/leak_bytes"] = float(self._leak())
        if s.host_peak is not None and s.host_retained is not None:
            metrics["vramguard/host_peak_bytes"] = float(s.host_peak)
            metrics["vramguard/host_retained_bytes"] = float(s.host_retained)
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Remove the hooks and close what is still open, assemble :attr:`report` (the audit's document), and
        on the main process write it atomically to ``report_path`` and print its tables when ``table`` is
        set."""
        if self._tracker is None or not self._attached:
            return
        self._detach()
        self.report = self._assemble()
        ranks = _rank_and_world()
        if (
            ranks is not None
        ):  # every rank's report, and the merged one on rank 0 (a collective: all ranks call)
            self.report = self._merge_ranks(*ranks)
        if self.report_path is not None and getattr(state, "is_world_process_zero", True):
            write_text_atomic(self.report_path, json.dumps(self.report.to_dict(), indent=2) + "\n")
        if (
            self._events is not None
            and self.snapshot_path is not None
            and getattr(state, "is_world_process_zero", True)
        ):
            write_bytes_atomic(self.snapshot_path, dump_snapshot(self._events.snapshot()))
        if self.table and getattr(state, "is_world_process_zero", True):
            from vramguard.view.console import stdout_console
            from vramguard.view.report import render

            render(self.report, stdout_console(), "trainer")
            if self.report.distributed is not None:
                from vramguard.view.report import distributed_ranks, distributed_summary

                render(self.report, stdout_console(), (distributed_ranks, distributed_summary))

    def _merge_ranks(self, rank: int, world: int) -> AuditReport:
        """In a distributed run (``torch.distributed`` initialised, more than one rank): write this rank's report
        to ``report_path`` with ``.rankR`` before its suffix, gather every rank's report and row on rank 0 and
        return, there, rank 0's report with a ``distributed`` section (every rank's row, the verdict failing when
        any rank's does); the other ranks return their own report."""
        import dataclasses

        import torch.distributed as dist

        from vramguard.step.rank import merged, rank_row
        from vramguard.workload.sharding import ShardingConfig, transient_terms

        assert self.report is not None and self._model is not None
        if self.report_path is not None:
            write_text_atomic(
                rank_path(self.report_path, rank), json.dumps(self.report.to_dict(), indent=2) + "\n"
            )
        model = self._model
        row = None
        if self.report.phases:  # no step measured: nothing to merge, but the gather below is still joined
            transient = transient_terms(model, _compute_dtype(model))
            row = dataclasses.asdict(
                rank_row(self.report, model, self.ledger or LedgerReport(), rank, transient)
            )
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object((self.report.to_dict(), row), gathered, dst=0)
        if rank != 0 or gathered is None or any(r is None for _, r in gathered):
            return self.report
        reports = [AuditReport.from_dict(doc) for doc, _ in gathered]
        rows = [RankRow(**r) for _, r in gathered]
        sharding = ShardingConfig(world_size=world, sharding=_engine_of(model))
        return merged(reports, rows, sharding, f"{world} processes, torch.distributed {dist.get_backend()}")

    def _resume(self) -> None:
        if self._paused and self._tracker is not None and isinstance(self._tracker.source, StorageTracker):
            self._tracker.source.resume()
        self._paused = False

    def _detach(self, in_forward: bool = False) -> None:
        """Close every frame and everything that measures. ``in_forward``: from the model's forward hook of a
        forward that raised, where torch iterates over the model's hooks: none of the callback's handles is
        removed then and the ledger is aborted (its hook on the model goes at the next ``train()``)."""
        self._resume()
        try:  # frames still open (training stopped mid-step): closed before the tracker goes
            while self._node_frames and self._tracker is not None:
                self._tracker.close_frame(self._node_frames.pop())
            self._close()
            if self._step_cm is not None and self._current is not None:
                self._step_cm.__exit__(None, None, None)
        finally:
            self._step_cm = self._current = None
            if not in_forward:
                self._remove_handles()
            self._release(in_forward)

    def _remove_handles(self) -> None:
        for h in (*self._handles, self._ledger_handle, self._host_handle):
            if h is not None:
                h.remove()
        self._handles.clear()
        self._ledger_handle = self._host_handle = None

    def _release(self, in_forward: bool = False) -> None:
        """Close what measures: the ledger and the host meter's saved-tensor hooks (in the order they were
        pushed), the host meter, the tracker. Hook handles are not touched."""
        if self._ledger is not None and in_forward:
            self._ledger.abort()  # the hook on the model's forward goes at the next train()'s begin
        elif self._ledger is not None:  # a ledger still open (training stopped mid-forward)
            self._ledger.__exit__(RuntimeError, None, None)  # no report from a forward that did not finish
            self._ledger = None
        if self._host_cm is not None:  # the host meter's hooks, pushed before the ledger's
            self._host_cm.__exit__(None, None, None)
            self._host_cm = None
        if self._host is not None:
            self._host.stop()
        if self._tracker is not None and self._attached:
            self._tracker.__exit__(None, None, None)
        self._attached = False

    def _saw_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer = optimizer

    # -- phases ------------------------------------------------------------------------------

    def _open(self, name: str) -> None:
        assert self._tracker is not None
        self._close()
        cm = self._tracker.phase(name)
        call = cm.__enter__()
        self._phase = (name, cm)
        agg = self._calls.setdefault(name, FrameStats(name))
        self._pending = (call, agg)

    def _close(self) -> None:
        if self._phase is None:
            return
        name, cm = self._phase
        self._phase = None
        cm.__exit__(None, None, None)
        call, agg = self._pending
        agg.merge(call)
        if name == "forward" and self._current is not None and self._current.after_forward is None:
            assert self._tracker is not None
            self._current.after_forward = self._tracker.current()

    def _forward_pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self._current is None or not torch.is_grad_enabled() or not module.training:
            return
        again = self._phase is not None and self._phase[0] == "forward"  # a second forward of the micro-step
        if not again:
            self._open("forward")
            ids = kwargs.get("input_ids")
            if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not {"seq_len", "row_tokens"} & set(self._config):
                self._config.update(row_shape(ids, self._config["batch"], self._max_length))
        hooks = hooks_in_force()  # activation offloading: count what it keeps on the host
        if hooks is not None and self._host_cm is None:
            if self._host is None:
                self._host = HostMeter()
                self._host.start()
            if self._current.host_start is None:
                self._current.host_start = self._host.current()
            self._host_cm = self._host.wrapping(hooks)
            self._host_cm.__enter__()
            self._config["activation_offloading"] = True
        if (
            not again
            and self._current.step == self.ledger_step
            and self.ledger is None
            and self._ledger is None
        ):
            self._ledger = SavedTensorLedger(module)
            self._ledger.__enter__()
            # registered after the ledger's own hooks, so it runs after the ledger has taken the outputs as roots
            self._ledger_handle = module.register_forward_hook(self._ledger_exit)
        if self._host_cm is not None and self._host_handle is None:  # after the ledger's exit: LIFO pops
            self._host_handle = module.register_forward_hook(self._host_exit)

    def _host_exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        cm, self._host_cm = self._host_cm, None
        self._host_handle = _removed(self._host_handle)
        if cm is not None:
            cm.__exit__(None, None, None)

    def _ledger_exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        ledger, self._ledger = self._ledger, None
        self._ledger_handle = _removed(self._ledger_handle)
        if ledger is not None:
            ledger.add_roots(output)
            ledger.__exit__(None, None, None)
            self.ledger = ledger.report
            if self._events is not None:
                self._events.label_saved(ledger.report.records)
            self._attribute_backward(ledger, _tensors(output))

    def _attribute_backward(self, ledger: SavedTensorLedger, roots: list[torch.Tensor]) -> None:
        """On the ledger step, a frame per autograd node of the graph (pre/post hooks), named by the module
        whose forward created it (the ledger's map) or ``<outside>``: where backward's peak was reached."""
        tracker = self._tracker
        if tracker is None or isinstance(tracker.source, CpuAllocatorSource):  # not readable inside backward
            return
        self.backward_nodes = {}
        self._node_frames = []
        for node in iter_graph(roots):
            name = f"{ledger.module_of_node(node) or '<root>'} {node.name()}"
            agg = self.backward_nodes.setdefault(name, FrameStats(name))

            def pre(*_: Any, agg: FrameStats = agg) -> None:
                if self._phase is not None and self._phase[0] == "backward":
                    self._node_frames.append(tracker.open_frame(FrameStats(agg.name), agg))

            def post(*_: Any, agg: FrameStats = agg) -> None:
                if self._node_frames and self._node_frames[-1].aggregate is agg:
                    tracker.close_frame(self._node_frames.pop())

            node.register_prehook(pre)
            node.register_hook(post)

    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if output is None and sys.exc_info()[0] is not None and self._attached:
            # the model's forward raised (torch runs always_call hooks from its except block): the Trainer
            # calls no callback now, so the saved-tensor hooks this callback pushed (ledger, host meter) come
            # off here, before the caller's own ``with save_on_cpu()`` exits and pops what is on top, and the
            # tracker stops. Handles stay registered (torch is iterating over them) until the next train().
            self.stopped = (
                self.stopped or f"step {self._current.step if self._current else '?'}'s forward raised"
            )
            self._detach(in_forward=True)
            return
        if self._phase is None or self._phase[0] != "forward" or self._current is None:
            return
        loss = getattr(output, "loss", None) if not isinstance(output, torch.Tensor) else None
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and self._current.loss is None:
            self._current.loss = float(loss.detach().float().item())
        nodes = {t.grad_fn for t in _tensors(output) if t.grad_fn is not None}
        if not nodes:
            return
        fired = [False]

        def pre(*_: Any) -> None:
            if fired[0]:
                return
            fired[0] = True
            self._backward_begin()

        for node in nodes:
            node.register_prehook(pre)

    def _backward_begin(self) -> None:
        if self._phase is None or self._phase[0] != "forward":
            return
        self._open("backward")
        if torch._C._current_graph_task_id() != -1:  # a hook on the outputs' grad_fn: inside the engine
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        if self._phase is not None and self._phase[0] == "backward":
            if isinstance(self._tracker.source if self._tracker else None, CudaAllocatorSource):
                torch.cuda.synchronize()
            while self._node_frames and self._tracker is not None:  # a node whose post hook did not run
                self._tracker.close_frame(self._node_frames.pop())
            self._close()

    def backward_peak(self) -> tuple[str, FrameStats] | None:
        """On the ledger step: the autograd node (``module node``) running when backward peaked, and its
        stats (``peak_above_start``: what it allocated on top of what was live when it started)."""
        if not self.backward_nodes:
            return None
        best = max(self.backward_nodes.values(), key=lambda f: (f.peak_bytes, f.peak_above_start))
        return best.name, best

    # -- verdict and report ------------------------------------------------------------------

    def _leak(self) -> int:
        return checks.leak_bytes([s.retained for s in self.steps])

    def _tolerance(self) -> int:
        if self.leak_tolerance is not None:
            return self.leak_tolerance
        cuda = isinstance(self._tracker.source if self._tracker else None, CudaAllocatorSource)
        return checks.leak_tolerance("cuda" if cuda else "cpu")

    def _limit_problem(self, s: _Step) -> str | None:
        if self.max_peak is not None:
            worst = max(s.peaks.items(), key=lambda kv: kv[1], default=None)
            if worst is not None and worst[1] > self.max_peak:
                return (
                    f"step {s.step} peaked at {format_bytes(worst[1])} in {worst[0]}, above max_peak "
                    f"{format_bytes(self.max_peak)}"
                )
        if self.max_saved_per_layer is not None and self.ledger is not None and s.step == self.ledger_step:
            for row in layer_rows(self.ledger, family=_vision_family(self._model)):
                if row.saved_bytes > self.max_saved_per_layer:
                    return (
                        f"{row.name} saved {format_bytes(row.saved_bytes)} for backward in step {s.step}, above "
                        f"max_saved_per_layer {format_bytes(self.max_saved_per_layer)}"
                    )
        return None

    def _assemble(self) -> AuditReport:
        assert self._model is not None and self._tracker is not None
        model = self._model
        steps = [
            StepRow(
                step=s.step,
                loss=s.loss,  # type: ignore[arg-type]  # None (JSON null): the model returned no loss (TRL's fused head)
                retained_bytes=s.retained,
                retained_after_forward=(s.after_forward or s.start) - s.start,
                peak_bytes=dict(s.peaks),
                host_peak_bytes=s.host_peak,
                host_retained_bytes=s.host_retained,
            )
            for s in self.steps
        ]
        config = getattr(model, "config", None)
        return assemble(
            Measured(
                model=model,
                ledger=self.ledger or LedgerReport(),
                tracker=self._tracker,
                phases=PHASES,
                steps=steps,
                expected=weights_expectation(model, reason=NO_ANALYTIC_MODEL),
                optimizer=self._optimizer,
                trainable=(p for p in model.parameters() if p.requires_grad),
                config=dict(self._config),
                architecture={
                    "model_type": getattr(config, "model_type", None),
                    "model_class": _base_class(model),
                    "attn_implementation": getattr(config, "_attn_implementation", None),
                    "analytic_model": None,
                },
                environment_device=self._config["device"],
                elapsed_s=time.perf_counter() - self._t0,
                leak_tolerance=self._tolerance(),
                findings_first=[
                    Finding(checks.STOPPED, self.stopped, problem=True) if self.stopped else None
                ],
                findings=self._findings(steps),
                ok_detail=f" ({self._trainer_name})",
                autocast=str(self._config.get("mixed_precision", "no")),
                timeline=timeline(self._events) if self._events is not None else None,
                family=_vision_family(model),
            )
        )

    def _findings(self, steps: list[StepRow]) -> list[Finding | None]:
        """What only a Trainer run can find: host copies outliving a step, steps or phases not measured, the
        ledger not taken, sampled steps, offloading in force and where backward peaked."""
        found: list[Finding | None] = []
        kept = [(s.step, s.host_retained) for s in self.steps if s.host_retained]
        if kept:
            step, nbytes = kept[0]
            found.append(
                Finding(
                    checks.HOST_COPIES_KEPT,
                    f"activation offloading left {format_bytes(nbytes)} of host copies alive after step {step} "
                    "(nothing saved for backward should outlive its step)",
                    nbytes,
                    problem=True,
                )
            )
        missing = [p for p in PHASES if p not in self._tracker.result.phases] if self._tracker else []
        if not steps:
            found.append(Finding(checks.NOTHING_MEASURED, "no training step was measured", problem=True))
        elif missing:
            found.append(
                Finding(
                    checks.PHASES_MISSING,
                    f"phases not seen: {', '.join(missing)} (nothing measured is not a pass)",
                    problem=True,
                )
            )
        if self.ledger is None:
            found.append(
                Finding(
                    checks.NO_LEDGER,
                    f"the ledger of step {self.ledger_step} was not taken (training ended before it)",
                    problem=True,
                )
            )
        found.append(checks.one_step(steps))
        if self.skipped_steps:
            found.append(
                Finding(
                    checks.STEPS_SAMPLED,
                    f"measured {len(steps)} of {len(steps) + self.skipped_steps} steps (measure_every="
                    f"{self.measure_every}, plus the ledger step); the others were not measured and report nothing"
                    + (
                        " (storages they made and left alive, e.g. a few scalars, are not counted in later steps' "
                        "retained bytes or absolute peaks; peaks above each phase's start are exact)"
                        if self._tracker is not None and isinstance(self._tracker.source, StorageTracker)
                        else ""
                    ),
                )
            )
        host = [s.host_peak for s in self.steps if s.host_peak is not None]
        if host:
            on_cpu = not isinstance(self._tracker.source if self._tracker else None, CudaAllocatorSource)
            found.append(
                Finding(
                    checks.OFFLOADING,
                    f"activation offloading was in force: its host copies peaked at {format_bytes(max(host))} in a "
                    "step"
                    + (
                        " (on CPU the host is the device: those bytes are in the phase peaks as well)"
                        if on_cpu
                        else " (host memory, not in the device's peaks)"
                    ),
                    max(host),
                )
            )
        if self.ledger is not None:
            found.append(checks.vision_stacks(_vision_family(self._model), self.ledger))
        where = self.backward_peak()
        if where is not None:
            name, stats = where
            found.append(
                Finding(
                    checks.BACKWARD_PEAK,
                    f"step {self.ledger_step}'s backward peaked at {format_bytes(stats.peak_bytes)} while autograd "
                    f"ran {name} (+{format_bytes(stats.peak_above_start)} above what was live when it started)",
                    stats.peak_bytes,
                )
            )
        return found


def _vision_family(model: Any) -> Any:
    """The :class:`vramguard.workload.vision.VisionFamily` of a vision-language model (its config has a
    ``vision_config`` and a ``model_type`` vramguard knows), else None: its ledger is then split by stack."""
    from vramguard.workload.vision import VISION_FAMILIES

    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return None
    return VISION_FAMILIES.get(getattr(config, "model_type", None))


class _AroundBackward:
    """Calls ``begin()`` before and ``end()`` after every backward started outside the autograd engine (its
    entry ``torch.autograd._engine_run_backward`` is wrapped, as ``torch.compiler`` does for tracing), until
    :meth:`remove`. Backwards inside the engine (reentrant checkpointing) pass through."""

    def __init__(self, begin: Callable[[], None], end: Callable[[], None]) -> None:
        from torch.autograd import graph

        self._original = original = graph._engine_run_backward

        @functools.wraps(original)
        def run_backward(*args: Any, **kwargs: Any) -> Any:
            if torch._C._current_graph_task_id() != -1:
                return original(*args, **kwargs)
            begin()
            try:
                return original(*args, **kwargs)
            finally:
                end()

        self._wrapper = run_backward
        graph._engine_run_backward = torch.autograd._engine_run_backward = run_backward  # type: ignore[attr-defined]

    def remove(self) -> None:
        """Put torch's own entry back (unless someone wrapped it again since)."""
        from torch.autograd import graph

        for module in (graph, torch.autograd):
            if getattr(module, "_engine_run_backward", None) is self._wrapper:
                module._engine_run_backward = self._original  # type: ignore[attr-defined]


def row_shape(ids: torch.Tensor, batch: int, max_length: Any) -> dict[str, int]:
    """The report's ``seq_len`` from a step's first ``input_ids``: their width. A padding-free batch (TRL's
    collator flattens the ``batch`` rows into one: one row where more were asked for) keeps the configured
    ``max_length`` as ``seq_len`` (none when the arguments set none) and its one row's width as
    ``row_tokens``."""
    rows, width = (int(n) for n in ids.shape)
    if rows == 1 and batch > 1:
        return {**({"seq_len": max_length} if isinstance(max_length, int) else {}), "row_tokens": width}
    return {"seq_len": width}


def _removed(handle: Any) -> None:
    """Remove a hook handle (if any); None, for the attribute that held it."""
    if handle is not None:
        handle.remove()


def _trainer_name(args: Any) -> str:
    name = type(args).__name__
    return {"SFTConfig": "SFTTrainer", "TrainingArguments": "Trainer"}.get(
        name, name.replace("Config", "Trainer")
    )


def _base_class(model: torch.nn.Module) -> str:
    base = getattr(model, "get_base_model", None)
    return type(base() if callable(base) else model).__name__


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


def rank_path(path: Path, rank: int) -> Path:
    """Where rank ``rank`` of a distributed run writes its own report: ``report.json`` -> ``report.rank1.json``."""
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _rank_and_world() -> tuple[int, int] | None:
    """(rank, world size) when this process is one of several ranks of an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


def _engine_of(model: torch.nn.Module) -> str:
    """What shards ``model`` across the ranks: ``fsdp2`` (``fully_shard``), ``fsdp1``
    (``FullyShardedDataParallel``), else ``ddp`` (every rank holds all of it: the trainer hands callbacks the
    model inside ``DistributedDataParallel``)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    modules = list(model.modules())
    if any(isinstance(m, FSDPModule) for m in modules):
        return "fsdp2"
    if any(isinstance(m, FullyShardedDataParallel) for m in modules):
        return "fsdp1"
    return "ddp"


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The compute dtype of the model's 4-bit layers (what bitsandbytes dequantizes to), else its first
    floating parameter's dtype."""
    for m in model.modules():
        dtype = getattr(m, "compute_dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
