"""The one renderer of a step report (:class:`~vramguard.step.report.AuditReport`) as rich tables.

A report is drawn as a list of sections; :data:`LAYOUTS` names the three lists in use: ``audit``
(``vramguard audit``, any trainer), ``estimate`` (``vramguard estimate``, a meta-device run) and
``trainer`` (the tables :class:`~vramguard.integrations.transformers.VramGuardCallback` prints at the end of
a user's own run). Every section reads the report only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from vramguard.step.report import AuditReport, LayerRow
from vramguard.step.verdict import META_RUN
from vramguard.units import format_bytes as fb

Section = Callable[[AuditReport, Any], None]


LAYER_WRAPPERS = ("base_model.model.", "model.", "language_model.")
"""The prefixes PEFT's wrapper and transformers' models put before a language model's decoder layers."""


def short_layer_name(name: str) -> str:
    """``base_model.model.model.layers.3`` -> ``layers.3``: a decoder layer's name from ``layers.`` on, the
    wrappers' prefixes (:data:`LAYER_WRAPPERS`) dropped; a layer of another stack keeps its path below them
    (``vision_tower.vision_model.encoder.layers.0``, ``visual.blocks.0``, ``visual.merger``: a vision-language
    model's tower and projector)."""
    at = name.find("layers.")
    if at < 0:
        at = len(name)
    prefix = name[:at]
    while prefix.startswith(LAYER_WRAPPERS):
        prefix = prefix[len(next(w for w in LAYER_WRAPPERS if prefix.startswith(w))) :]
    return prefix + name[at:]


def _table(
    title: str, columns: list[str], left: tuple[str, ...] = ("stack", "layer", "top modules", "phase")
) -> Any:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right")
    return t


# -- headers ------------------------------------------------------------------------------------------------


def _lora(c: dict[str, Any]) -> str:
    return f"LoRA r={c['lora_rank']}, {c['quant_type']}{' +double-quant' if c['double_quant'] else ''}"


def _checkpointing(c: dict[str, Any]) -> str:
    return f"checkpointing {'on' if c['gradient_checkpointing'] else 'off'}"


def _bold_first(head: str, rest: str) -> Any:
    """``head`` in bold, then ``rest``: data (a model's path, a trainer's name) is never read as markup."""
    from rich.text import Text

    return Text.assemble((head, "bold"), rest)


def audit_header(report: AuditReport, console: Any) -> None:
    """The run's shape and what ran it, then the library versions (dim)."""
    recipe_line(report, console)
    c = report.config
    arch = report.architecture
    kind = (
        f" ({arch.get('model_type')}, {arch.get('model_class')}, {arch.get('attn_implementation')} attention)"
        if arch
        else ""
    )
    console.print(
        _bold_first(
            "vramguard audit",
            f" {c['model']}{kind} on {report.device}: {batch_text(c)}, "
            f"{_lora(c)}, compute {c['compute_dtype']}, {_checkpointing(c)}, {len(report.steps)} steps",
        )
    )
    env = report.environment.get("packages", {})
    console.print(", ".join(f"{k} {v}" for k, v in env.items() if v), style="dim", highlight=False)


def recipe_line(report: AuditReport, console: Any) -> None:
    """The recipe the run followed and whose defaults filled the rest (``config["recipe"]``), when known."""
    recipe = report.config.get("recipe")
    if recipe:
        console.print(recipe, highlight=False, soft_wrap=True)


def batch_text(c: dict[str, Any]) -> str:
    """``batch B x seq S`` (``?`` where a Trainer run's padding-free batch named no max_length), the one row of a
    padding-free batch (``row_tokens``), and the micro-batches of a step under gradient accumulation."""
    micro = c.get("gradient_accumulation_steps", 1)
    row = f", padding-free: one row of {c['row_tokens']:,} tokens" if c.get("row_tokens") else ""
    return f"batch {c['batch']} x seq {c.get('seq_len', '?')}{row}" + (
        f", {micro} micro-batches a step" if micro != 1 else ""
    )


def _method(c: dict[str, Any]) -> str:
    method = c.get("extra", {}).get("method", "qlora")
    if method == "full":
        return "full fine-tuning (fp32 weights + AdamW)"
    if method == "lora":
        return f"LoRA r={c['lora_rank']} on a {c['compute_dtype']} base"
    return _lora(c)


def estimate_header(report: AuditReport, console: Any) -> None:
    """The estimated step's shape: model, method, dtype, checkpointing, optimizer, offloading, meta steps."""
    recipe_line(report, console)
    c = report.config
    arch = report.architecture
    step = c.get("extra", {})
    console.print(
        _bold_first(
            "vramguard estimate",
            f" {c['model']} ({arch.get('model_type')}, {arch.get('model_class')}, "
            f"{arch.get('attn_implementation')} attention) on {report.device}: {batch_text(c)}, "
            f"{_method(c)}, compute {c['compute_dtype']}, {_checkpointing(c)}, "
            f"optimizer {step.get('optimizer', 'adamw')}, "
            + ("activations offloaded to the host, " if step.get("offload_activations") else "")
            + f"{len(report.steps)} steps in {report.elapsed_s:.1f} s",
        ),
        highlight=False,
    )


def trainer_header(report: AuditReport, console: Any) -> None:
    """Which trainer ran which model, and the batch."""
    c = report.config
    console.print(
        _bold_first(
            "vramguard",
            f" {c.get('trainer')} run of {report.architecture.get('model_class')} on {report.device}: "
            f"{batch_text({'seq_len': '?', **c})}, {len(report.steps)} steps",
        ),
        highlight=False,
    )


# -- the per-layer table ------------------------------------------------------------------------------------


def _stacked(
    report: AuditReport, title: str, columns: list[str]
) -> tuple[str, list[str], Callable[[LayerRow], list[Any]]]:
    """The layer table's title, columns and leading cells: a vision-language model's layers (rows with a stack)
    are per layer of each stack, under a ``stack`` column; a text model's table is as it was."""
    if not any(row.stack for row in report.layers):
        return title, columns, lambda row: []
    return re.sub(r"per (decoder )?layer", "per layer of each stack", title, count=1), ["stack", *columns], _stack


def _stack(row: LayerRow) -> list[Any]:
    return [row.stack]


def _outside(report: AuditReport) -> str:
    """What the saved bytes outside the layer table's rows are called."""
    return "outside the stacks' layers" if any(row.stack for row in report.layers) else "outside decoder layers"


def _layers(
    title: str, columns: list[str], cells: Callable[[LayerRow], list[str]], outside: bool = False
) -> Section:
    def section(report: AuditReport, console: Any) -> None:
        heading, names, lead = _stacked(report, title, columns)
        t = _table(heading.format(ledger_step=report.config.get("ledger_step")), names)
        for row in report.layers:
            t.add_row(*lead(row), *cells(row))
        if outside:
            blank = [""] * (len(names) - len(columns))  # under the stack column
            t.add_row(*blank, _outside(report), fb(report.totals.outside_layers_bytes), *[""] * (len(columns) - 2))
        console.print(t)

    section.__doc__ = f"The table {title!r}: {', '.join(columns)}."
    return section


def _tops(row: LayerRow) -> str:
    return ", ".join(f"{m} {fb(b)}" for m, b in row.top_modules)


def _copies(row: LayerRow) -> Any:
    from rich.text import Text

    return Text(fb(row.weight_copy_bytes), style="red") if row.weight_copy_bytes else fb(0)


def _analytic(row: LayerRow) -> str:
    return "-" if row.analytic_bytes is None else fb(row.analytic_bytes)


audit_layers = _layers(
    "Saved for backward, per decoder layer (ledger: hooks + ctx walk)",
    ["layer", "saved", "activations", "weight copies", "analytic", "top modules"],
    lambda r: [
        short_layer_name(r.name),
        fb(r.saved_bytes),
        fb(r.activation_bytes),
        _copies(r),
        _analytic(r),
        _tops(r),
    ],
)
estimate_layers = _layers(
    "Saved for backward, per decoder layer (ledger on meta)",
    ["layer", "saved", "weight copies", "analytic", "top modules"],
    lambda r: [short_layer_name(r.name), fb(r.saved_bytes), _copies(r), _analytic(r), _tops(r)],
)


def layer_runs(rows: list[LayerRow], cells: Callable[[LayerRow], list[Any]]) -> list[tuple[str, list[Any]]]:
    """``rows`` with each run of consecutive layers whose ``cells`` (all but the name) are equal in one row:
    ``layers.1-31`` and the cells of one of them (a decoder's identical layers: 28 near-identical rows were
    most of an estimate's output)."""
    runs: list[tuple[list[LayerRow], list[Any]]] = []
    for row in rows:
        key = cells(row)
        if runs and _same_list(runs[-1][0][-1], row) and [str(c) for c in runs[-1][1]] == [str(c) for c in key]:
            runs[-1][0].append(row)
        else:
            runs.append(([row], key))
    return [(_span(group), key) for group, key in runs]


def _same_list(a: LayerRow, b: LayerRow) -> bool:
    """Whether two layers are elements of one list (of one stack): only those share a row (a vision-language
    model's tower blocks never share one with its language model's layers)."""
    same_stack = getattr(a, "stack", None) == getattr(b, "stack", None)
    return same_stack and a.name.rpartition(".")[0] == b.name.rpartition(".")[0]


def _span(group: list[LayerRow]) -> str:
    first, last = short_layer_name(group[0].name), short_layer_name(group[-1].name)
    if len(group) == 1:
        return first
    head, _, number = last.rpartition(".")
    if first.startswith(head + ".") and number.isdigit():
        return f"{first}-{number}"
    return f"{first} to {last} ({len(group)} layers)"


def collapsed_estimate_layers(report: AuditReport, console: Any) -> None:
    """The per-layer table of an estimate with identical consecutive layers in one row (``--verbose``: every
    layer)."""
    title, columns, lead = _stacked(
        report,
        "Saved for backward per layer (on meta; identical layers share a row)",
        ["layers", "saved", "weight copies", "analytic", "top modules"],
    )
    t = _table(title, columns, ("stack", "layers", "top modules"))
    n = len(columns) - 5  # the stack column's cell, where there is one, goes before the layers'
    for name, cells in layer_runs(
        report.layers, lambda r: [*lead(r), fb(r.saved_bytes), _copies(r), _analytic(r), _tops(r)]
    ):
        t.add_row(*cells[:n], name, *cells[n:])
    console.print(t)


trainer_layers = _layers(
    "Saved for backward, per decoder layer (step {ledger_step})",
    ["layer", "saved", "activations", "weight copies", "top modules"],
    lambda r: [short_layer_name(r.name), fb(r.saved_bytes), fb(r.activation_bytes), _copies(r), _tops(r)],
    outside=True,
)


# -- totals -------------------------------------------------------------------------------------------------


def audit_totals(report: AuditReport, console: Any) -> None:
    """Measured against the analytic model: saved activations, weight copies, frozen weights, LoRA training."""
    tot = report.totals
    b = report.budget
    s = _table(
        "Totals: measured vs the analytic model", ["what", "measured", "analytic", "note"], ("what", "note")
    )
    probes = f"hooks {fb(tot.hook_bytes)}, ctx attributes {fb(tot.ctx_bytes)}"
    if b.activation_ratio is None or b.analytic_activation_bytes is None:
        s.add_row(
            "saved activations (all)",
            fb(b.measured_activation_bytes),
            "-",
            f"{b.no_analytic_model}; {probes}",
        )
        s.add_row(f"  {_outside(report)}", fb(tot.outside_layers_bytes), "-", "")
    else:
        s.add_row(
            "saved activations (all)",
            fb(b.measured_activation_bytes),
            fb(b.analytic_activation_bytes),
            f"{b.activation_ratio:.1%} ({b.analytic_model}); {probes}",
        )
        s.add_row(
            "  outside decoder layers",
            fb(tot.outside_layers_bytes),
            fb(b.analytic_outside_layers_bytes or 0),
            f"fp32 logits 4*b*s*V = {fb(b.analytic_logits_bytes or 0)}, final norm, loss",
        )
    s.add_row("  weight copies", fb(tot.weight_copy_bytes), fb(0), "dequantized weights kept for backward")
    s.add_row(
        "frozen weights (4-bit + absmax, others)",
        fb(b.measured_weights_bytes),
        fb(b.analytic_weights_bytes),
        f"N={b.quantized_params:,} quantized, {b.other_params:,} unquantized",
    )
    s.add_row(
        "LoRA weights + grads + Adam",
        fb(b.measured_lora_training_bytes),
        fb(b.analytic_lora_training_bytes),
        f"M={b.lora_params:,} params x 16 B (+ Adam step counters)",
    )
    console.print(s)


def estimate_components(report: AuditReport, console: Any) -> None:
    """What the estimated step holds: saved activations, frozen weights, trainable weights with their
    gradients and optimizer state."""
    b, tot, e = report.budget, report.totals, report.estimate
    assert e is not None
    s = _table("Components", ["what", "bytes", "note"], ("what", "note"))
    s.add_row(
        "saved activations (all)",
        fb(tot.saved_bytes),
        f"{fb(tot.outside_layers_bytes)} {_outside(report)} ("
        + ("embeddings, the tower's patch embedding, " if any(r.stack for r in report.layers) else "")
        + "logits, final norm, loss)",
    )
    s.add_row(
        "frozen weights (4-bit + absmax, others)",
        fb(e.weights_bytes),
        f"N={b.quantized_params:,} quantized, {b.other_params:,} unquantized",
    )
    s.add_row(
        "trainable weights + grads + AdamW",
        fb(b.measured_lora_training_bytes),
        f"M={b.lora_params:,} trainable; textbook 16 B x M = {fb(16 * b.lora_params)}",
    )
    console.print(s)


def estimate_device(report: AuditReport, console: Any) -> None:
    """The total: the allocator peak, then each overhead the meta run leaves out (a GPU's for ``--device cuda``;
    for cpu, the host's tensors and what offloading keeps there)."""
    e = report.estimate
    assert e is not None
    title = (
        "On the device: the allocator peak, then what the meta run leaves out (figures measured on an H100)"
        if e.target == "cuda"
        else "On the host (--device cpu): the step's tensors at their peak; no GPU overhead is added"
    )
    o = _table(title, ["what", "bytes", "basis"], ("what", "basis"))
    o.add_row(
        "allocator peak (max_memory_allocated)" if e.target == "cuda" else "tensors at the peak",
        fb(e.allocator_peak_bytes),
        f"weights {fb(e.weights_bytes)} + trainable params {fb(e.trainable_bytes)} + {e.peak_phase} peak "
        f"{fb(e.step_peak_bytes)}",
    )
    for x in e.overheads:
        o.add_row(f"  + {x.name}", fb(x.bytes), x.basis)
    o.add_row("total", fb(e.total_bytes), "")
    console.print(o)


# -- phases, steps, notes, verdict --------------------------------------------------------------------------


def tracker_basis(report: AuditReport) -> str:
    """What the tracker's peaks count from, said with its phase table: on CUDA every allocated byte; on the CPU
    and meta the storages made during the steps, without the model's own (its timeline picture's peak counts
    those: the two differ by them)."""
    if str(report.device).startswith("cuda"):
        return "tracker: all allocated, the model's weights too"
    return "tracker: the steps' storages, not the model's weights"


def _phases(title: str, reserved: bool = False) -> Section:
    def section(report: AuditReport, console: Any) -> None:
        shown = reserved and any(v.reserved_peak_bytes is not None for v in report.phases.values())
        p = _table(
            title.format(basis=tracker_basis(report)),
            ["phase", "peak", "above phase start", *(["reserved peak"] if shown else [])],
        )
        for name, v in report.phases.items():
            cells = [name, fb(v.peak_bytes), fb(v.peak_above_start)]
            if shown:
                cells.append(fb(v.reserved_peak_bytes or 0))
            p.add_row(*cells)
        console.print(p)

    section.__doc__ = f"The table {title!r}: each phase's peak" + (" (and reserved peak)" if reserved else "")
    return section


audit_phases = _phases("Peak live memory per phase ({basis})", reserved=True)
estimate_phases = _phases("Peak per phase (tracker on meta; above the weights and LoRA parameters)")
trainer_phases = _phases("Peak live memory per phase (max over steps; {basis})")


def step_lines(report: AuditReport, console: Any) -> None:
    """The retained bytes after each step (and the host copies of offloaded activations)."""
    for line in report.step_lines():
        console.print(line, highlight=False)


def notes(report: AuditReport, console: Any) -> None:
    """The verdict's notes, one line each."""
    from rich.text import Text

    for n in report.verdict.notes:
        console.print(Text.assemble(("note:", "yellow"), f" {n}"), highlight=False)


BRIEF_LEFT_OUT = (META_RUN,)
"""Note kinds the default estimate view leaves to ``--verbose``: the same caveat on every estimate (how the
meta run compares with the GPUs it was measured against)."""


def brief_notes(report: AuditReport, console: Any) -> None:
    """The verdict's notes but the kinds of :data:`BRIEF_LEFT_OUT`, one line each."""
    from rich.text import Text

    for f in report.verdict.findings:
        if not f.problem and f.kind not in BRIEF_LEFT_OUT:
            console.print(Text.assemble(("note:", "yellow"), f" {f.message}"), highlight=False)


def verdict_line(report: AuditReport, console: Any) -> None:
    """The verdict, green or red: one greppable line whatever the width (COLUMNS=80 is set under
    pytest-xdist, and by some CI runners)."""
    style = "bold green" if report.verdict.ok else "bold red"
    console.print(report.verdict.line, style=style, highlight=False, soft_wrap=True)


# -- per rank (--world-size) ---------------------------------------------------------------------------------


def distributed_header(report: AuditReport, console: Any) -> None:
    """What sharded the step and how the ranks ran (real processes, or the fake process group on meta)."""
    d = report.distributed
    assert d is not None
    offload = ", parameters offloaded to the host" if d.cpu_offload else ""
    recipe = (
        "ZeRO-3 + QLoRA (model loaded whole, partitioned by deepspeed.initialize)"
        if d.sharding == "zero3"
        else ("FSDP + QLoRA recipe")
    )
    console.print(
        _bold_first(
            d.sharding,
            f" over {d.world_size} ranks{offload} ({d.engine}); {recipe}: packed 4-bit weights stored in the "
            "compute dtype, no fp32 upcast; every rank measured with the ledger and tracker",
        ),
        highlight=False,
    )


def distributed_ranks(report: AuditReport, console: Any) -> None:
    """One table per rank: its sharded, replicated and transient terms, each named, then its peaks."""
    d = report.distributed
    assert d is not None
    for row in d.per_rank:
        same = f" (same shard shapes as rank {row.same_as}: not run again)" if row.same_as is not None else ""
        t = _table(f"Rank {row.rank} of {d.world_size}{same}", ["term", "bytes", "kind"], ("term", "kind"))
        terms = row.terms
        t.add_row("packed 4-bit weights (its shard)", fb(terms.get("packed_4bit_bytes", 0)), "sharded")
        t.add_row(
            "unquantized weights (its shard: embeddings, norms, lm_head)",
            fb(terms.get("unquantized_bytes", 0)),
            "sharded",
        )
        t.add_row(
            "LoRA shard + grads + AdamW state",
            fb(row.lora_training_bytes),
            "sharded (grads: after reduce-scatter)",
        )
        t.add_row(
            "quant_state (absmax, nested statistics, code tables)",
            fb(terms.get("quant_state_bytes", 0)),
            "replicated: neither parameter nor buffer, no engine shards it",
        )
        t.add_row("buffers", fb(terms.get("buffer_bytes", 0)), "replicated")
        if "fp32_master_bytes" in terms:
            _zero3_rows(t, terms, row.transient)
        t.add_row("saved activations (ledger)", fb(row.saved_bytes), "per rank: its own batch")
        x = row.transient
        t.add_row(
            "all-gathered weights backward uses (ledger)",
            fb(row.gathered_weight_bytes),
            "transient, not saved: each unit freed after forward, gathered again for its backward",
        )
        t.add_row(
            "  of which gathered from forward to backward",
            fb(row.gathered_held_bytes),
            "the root unit: not resharded after forward",
        )
        t.add_row(
            "  largest unit all-gathered",
            fb(x.get("all_gathered_unit", 0)),
            f"transient, in the step peak ({x.get('units', 0)} units)",
        )
        t.add_row(
            "  dequantized weight (largest)",
            fb(x.get("dequantized_weight", 0)),
            "transient, in the step peak",
        )
        t.add_row(
            "  reduce-scatter input (largest unit's grads)",
            fb(x.get("reduce_scatter_input", 0)),
            "transient, in the step peak",
        )
        for name, peak in row.phases.items():
            t.add_row(f"{name} peak (tracker)", fb(peak), "above the resident weights")
        kept = (
            f"ZeRO-3 training state {fb(terms['training_resident_bytes'])} (LoRA partitions and persistent "
            "tensors, fp32 master, gradient partitions, reduce bucket)"
            if "training_resident_bytes" in terms
            else f"LoRA shard {fb(row.trainable_bytes)}"
        )
        weights = terms.get("weights_at_start_bytes", row.weights_bytes)  # ZeRO-3: when the tracker started
        t.add_row(
            "allocator peak",
            fb(row.allocator_peak_bytes),
            f"weights {fb(weights)} + {kept} + {row.peak_phase} peak",
        )
        if row.reserved_bytes is not None:
            t.add_row("reserved peak", fb(row.reserved_bytes), "caching allocator")
        if row.total_bytes != row.allocator_peak_bytes:
            t.add_row(
                "total with overheads", fb(row.total_bytes), "CUDA context, cuBLAS, fragmentation (H100)"
            )
        console.print(t)


def _zero3_rows(t: Any, terms: dict[str, int], transient: dict[str, int]) -> None:
    """What DeepSpeed's ZeRO-3 engine keeps besides the partitions (:func:`vramguard.workload.zero3.zero3_terms`)."""
    t.add_row(
        f"whole parameters kept beside their partition ({terms.get('persistent_params', 0)} persistent)",
        fb(terms.get("persistent_bytes", 0)),
        "replicated: below stage3_param_persistence_threshold, never released",
    )
    t.add_row("  LoRA partitions (compute dtype)", fb(terms.get("trainable_bytes", 0)), "partitioned")
    t.add_row("  fp32 master of the LoRA partitions", fb(terms.get("fp32_master_bytes", 0)), "partitioned")
    t.add_row("  gradient partitions (one buffer)", fb(terms.get("grad_partition_bytes", 0)), "partitioned")
    t.add_row(
        "  AdamW state (on the fp32 partitions)", fb(terms.get("optimizer_state_bytes", 0)), "partitioned"
    )
    t.add_row("reduce bucket", fb(terms.get("reduce_bucket_bytes", 0)), "allocated at initialize")
    t.add_row(
        "allocated by deepspeed.initialize (tracker)",
        fb(terms.get("engine_init_bytes", 0)),
        "net: partitions, fp32 master, buffers",
    )
    t.add_row(
        "  prefetch bucket (at most)", fb(transient.get("prefetch_bucket", 0)), "transient, in the step peak"
    )


def distributed_summary(report: AuditReport, console: Any) -> None:
    """Every rank in one table, with a summary row: the highest of each column."""
    d = report.distributed
    assert d is not None
    cols = ["rank", "weights", "LoRA + grads + Adam", "saved", "step peak", "allocator peak", "total"]
    t = _table("Per rank", cols, ("rank",))
    for row in d.per_rank:
        t.add_row(
            str(row.rank),
            fb(row.weights_bytes),
            fb(row.lora_training_bytes),
            fb(row.saved_bytes),
            f"{fb(row.step_peak_bytes)} ({row.peak_phase})",
            fb(row.allocator_peak_bytes),
            fb(row.total_bytes),
        )
    rows = d.per_rank
    t.add_section()
    t.add_row(
        "max",
        fb(max(r.weights_bytes for r in rows)),
        fb(max(r.lora_training_bytes for r in rows)),
        fb(max(r.saved_bytes for r in rows)),
        fb(max(r.step_peak_bytes for r in rows)),
        fb(max(r.allocator_peak_bytes for r in rows)),
        fb(max(r.total_bytes for r in rows)),
    )
    console.print(t)


LAYOUTS: dict[str, tuple[Section, ...]] = {
    "audit": (audit_header, audit_layers, audit_totals, audit_phases, step_lines, notes, verdict_line),
    "estimate": (
        estimate_header,
        estimate_layers,
        estimate_components,
        estimate_phases,
        estimate_device,
        notes,
        verdict_line,
    ),
    "trainer": (trainer_header, trainer_phases, trainer_layers, notes, step_lines, verdict_line),
    "distributed-audit": (
        audit_header,
        distributed_header,
        distributed_ranks,
        distributed_summary,
        notes,
        verdict_line,
    ),
    "distributed-estimate": (
        estimate_header,
        distributed_header,
        distributed_ranks,
        distributed_summary,
        notes,
        verdict_line,
    ),
}
"""The sections of each view of a report, in order."""


ESTIMATE_BRIEF: tuple[Section, ...] = (estimate_header, collapsed_estimate_layers, brief_notes, verdict_line)
"""``vramguard estimate``'s default view, at most a screen: identical layers collapsed, the tables of the
components, the phases and the overheads (the verdict line names each overhead's figure) and the meta run's
standing caveat left to ``--verbose`` (:data:`LAYOUTS`' ``estimate``)."""


def estimate_layout(verbose: bool) -> tuple[Section, ...]:
    """The sections ``vramguard estimate`` prints after its answer: every table with ``verbose``."""
    return LAYOUTS["estimate"] if verbose else ESTIMATE_BRIEF


def answer(report: AuditReport, budget: int | None, at: str = "expected", fit: dict[str, Any] | None = None,
           card: str | None = None) -> str:
    """The line a person reads first: whether the step fits ``budget`` (``card``'s memory, or ``--fit``'s),
    judged ``at`` the expected total or the high end, with both figures, and what to try when it does not fit
    (the first two of ``fit``'s changes that fit, in the order given, each with its ``cost`` where the row has
    one, and the largest batch that fits); without a budget the two figures alone."""
    e = report.estimate
    assert e is not None
    expected, high = e.total_bytes, e.high_total_bytes
    figures = f"{fb(expected)} expected" + (f", {fb(high)} at the high end" if high != expected else "")
    where = f"{fb(budget)} ({card})" if card is not None and budget is not None else fb(budget or 0)
    if budget is None:
        place = "on the device" if e.target == "cuda" else "of the host's memory"
        return f"{fb(expected)} expected {place}" + (f", {fb(high)} at the high end" if high != expected else "")
    judged = high if at == "high" else expected
    if judged <= budget:
        caveat = "; at the high end it does not (--fit-at high judges there)" if high > budget else ""
        return f"fits in {where}: {figures}{caveat}"
    line = f"does not fit in {where}" + (" at the high end" if at == "high" and expected <= budget else "")
    line += f": {figures}"
    tries = [c for c in (fit or {}).get("changes", []) if c["fits"]][:2]
    if tries:
        line += "; try " + " or ".join(
            f"{c['change']} ({fb(c['total_bytes'])}" + (f", costs {c['cost']})" if "cost" in c else ")")
            for c in tries
        )
    if fit and fit.get("dim") == "batch" and fit.get("largest"):
        line += f"; batch {fit['largest']} fits"
    return line


def answer_section(
    budget: int | None, at: str = "expected", fit: dict[str, Any] | None = None, card: str | None = None
) -> Section:
    """:func:`answer` as the first section of a view, in bold."""

    def section(report: AuditReport, console: Any) -> None:
        console.print(answer(report, budget, at, fit, card), style="bold", highlight=False, soft_wrap=True)

    return section


def render(report: AuditReport, console: Any, layout: str | tuple[Section, ...] = "audit") -> None:
    """Print ``report`` on the rich ``console`` as the sections of ``layout`` (a :data:`LAYOUTS` name, or
    the sections themselves)."""
    for section in LAYOUTS[layout] if isinstance(layout, str) else layout:
        section(report, console)


TRAINER_NAMES = {"sft": "trl sft", "trainer": "transformers Trainer"}
"""``--fit``'s ``trainer`` (whose step priced it) as a person names it."""


def render_fit(fit: dict[str, Any], dim: str, batch: int, seq_len: int, console: Any) -> None:
    """``vramguard estimate --fit``: the largest batch (or sequence length) that fits, and each change in the order
    given, with its ``cost`` and ``cost_detail`` in step time where its row has them."""
    what = "batch" if dim == "batch" else "sequence length"
    fixed = f"at seq {seq_len}" if dim == "batch" else f"at batch {batch}"
    if "image" in fit:
        line = _image_fit_line(fit, batch, seq_len)
    elif fit["largest"]:
        line = f"fit: the largest {what} that fits in {fb(fit['size_bytes'])} {fixed} is {fit['largest']}"
    else:
        line = f"fit: not even {what} 1 fits in {fb(fit['size_bytes'])} {fixed}"
    trainer = TRAINER_NAMES.get(fit.get("trainer", ""), fit.get("trainer", ""))
    whose = f"; {trainer}'s own step, searched up to {fit['limit']:,}" if "trainer" in fit else ""
    if fit.get("trainer") == "loop":  # a vision-language batch: its rows' images are real, made on the host
        whose = f"; searched up to {fit['limit']:,}: each row's images are made by the processor on the host"
    console.print(
        f"{line} ({fit['run_count']} meta runs besides the requested shape's; at most {fit['bound']}{whose})",
        highlight=False,
        soft_wrap=True,
    )
    for row in fit["changes"]:
        if "refused" in row:
            console.print(f"  {row['change']}: not priced: {row['refused']}", highlight=False, soft_wrap=True)
            continue
        verdict = "fits" if row["fits"] else "does not fit"
        cost = f"; costs {row['cost']}: {row['cost_detail']}" if "cost" in row else ""
        console.print(
            f"  {row['change']}: {fb(row['total_bytes'])} ({verdict}{cost})",
            highlight=False,
            soft_wrap=True,
        )
    if fit.get("not_priced") and fit["changes"]:
        console.print(
            f"  not tried: {', '.join(fit['not_priced'])} ({trainer}'s step on meta does not run them yet; "
            "--trainer loop prices them on vramguard's loop)",
            highlight=False,
            soft_wrap=True,
        )


def _image_fit_line(fit: dict[str, Any], batch: int, seq_len: int) -> str:
    """``--fit-dim image``'s answer: the largest image, its tokens, and the bound it was searched under (a tiling
    processor's: the run of sizes it gives those tokens)."""
    image = fit["image"]
    fixed = f"at batch {batch} x seq {seq_len}"
    if image["largest"] is None:
        return f"fit: not even the smallest image its processor makes fits in {fb(fit['size_bytes'])} {fixed}"
    bound = {
        "seq-len": f"seq-len {seq_len} holds no larger image: it is the whole row, image tokens included, as TRL's "
        "max_length counts it",
        "max_pixels": "max_pixels holds it: the processor makes no larger image at this aspect ratio (it resizes a "
        "larger one down to at most max_pixels)",
        "tokens": "the processor gives no larger image at this aspect ratio more tokens (probed up to "
        f"{image.get('probed_up_to')} pixels on the longest side)",
    }[image["limited_by"]]
    tokens = f"{image['image_tokens']} image tokens, {image['row_tokens']} tokens of the row with their markers"
    if image.get("follows") == "tokens":
        at_limit = image["same_from"] == image["limit"]
        if image["largest"] == image["same_from"] and at_limit and image["limited_by"] == "tokens":
            same, run = f"any size from {image['same_from']} up", ""
        else:
            same, run = image["largest"], f", as of every image from {image['same_from']} to {image['largest']}"
        return (
            f"fit: the largest image that fits in {fb(fit['size_bytes'])} {fixed} is {same} ({tokens}{run}; "
            f"searched the processor's token counts at this aspect ratio up to that of {image['limit']}"
            + (f", where {bound})" if at_limit else ")")
        )
    at_limit = image["largest"] == image["limit"]
    return (
        f"fit: the largest image that fits in {fb(fit['size_bytes'])} {fixed} is {image['largest']} ({tokens}; "
        f"searched the sizes the processor makes, sides in {image['step']}-pixel steps, up to {image['limit']}"
        + (f", where {bound})" if at_limit else ")")
    )


def render_world_fit(fit: dict[str, Any], batch: int, seq_len: int, console: Any) -> None:
    """``vramguard estimate --fit SIZE --sharding fsdp2`` without ``--world-size``: the smallest world size whose
    every rank fits, and each world size run."""
    size = fb(fit["size_bytes"])
    if fit["smallest_world_size"]:
        line = f"fit: the smallest world size whose every rank fits in {size} at batch {batch} x seq {seq_len} is "
        line += str(fit["smallest_world_size"])
    else:
        line = f"fit: no world size up to {fit['limit']} fits every rank in {size} at batch {batch} x seq {seq_len}"
    runs = ", ".join(f"{n}: {fb(t) if t is not None else 'beyond torch'}" for n, t in fit["runs"])
    console.print(f"{line} (rank 0 of world sizes {runs})", highlight=False, soft_wrap=True)


def verdict_only(report: AuditReport, console: Any) -> None:
    """``--quiet``: the verdict line alone, without colour markup."""
    console.print(report.verdict.line, highlight=False, soft_wrap=True)
