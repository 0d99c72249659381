"""The ``vramguard audit --json`` document, as typed dataclasses (this module is its schema).

``schema_version`` changes whenever a field is removed or changes meaning; new fields may be added
within a version. All sizes are bytes (int); all ratios are floats (measured / analytic). The
analytic numbers and the ratio are ``null`` for an architecture without an analytic model
(``budget.no_analytic_model`` says so): a measurement is never compared with another family's formula.
``budget`` is schema 1's key for the measurement set against the analytic expectation
(:class:`AnalyticComparison`; in Python "budget" is otherwise a user's limit, as in the ``vram_budget`` marker).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vramguard.measure.events import Timeline
from vramguard.units import format_bytes

SCHEMA_VERSION = 1


@dataclass
class LayerRow:
    """One decoder layer (or a vision-language model's layer of any stack): what its forward left alive for
    backward."""

    name: str
    saved_bytes: int
    activation_bytes: int
    weight_copy_bytes: int
    analytic_bytes: int | None  # None: no analytic model for this architecture
    top_modules: list[tuple[str, int]] = field(default_factory=list)
    stack: str | None = None
    """A vision-language model's layer: its stack (``vision tower``, ``projector``, ``language model``,
    :data:`vramguard.workload.vision.STACKS`); None, and absent from the JSON, for a text model's."""


@dataclass
class Totals:
    """Whole-model sums from the ledger (``hook`` + ``ctx`` = ``saved``)."""

    saved_bytes: int
    hook_bytes: int
    ctx_bytes: int
    activation_bytes: int
    weight_copy_bytes: int
    resident_seen_bytes: int
    model_resident_bytes: int
    outside_layers_bytes: int
    gathered_weight_bytes: int = 0
    """Saved all-gathered weights of a sharded model, at their gathered size (0 on one device): not in
    ``saved_bytes`` (:attr:`vramguard.measure.ledger.LedgerReport.gathered_bytes`)."""


@dataclass
class PhasePeak:
    """Peak live bytes of one phase over all steps; ``peak_above_start`` excludes what was live before."""

    peak_bytes: int
    peak_above_start: int
    reserved_peak_bytes: int | None = None


@dataclass
class AnalyticComparison:
    """The analytic model next to the measurement (``None`` where nothing was measured)."""

    quantized_params: int
    lora_params: int
    other_params: int
    analytic_weights_bytes: int
    measured_weights_bytes: int
    analytic_lora_training_bytes: int
    measured_lora_training_bytes: int
    analytic_activation_bytes: int | None
    measured_activation_bytes: int
    analytic_logits_bytes: int | None
    analytic_outside_layers_bytes: int | None
    activation_ratio: float | None  # None (and the analytic_* above): no analytic model, see below
    analytic_model: str | None = None  # the family whose formula was used
    no_analytic_model: str | None = None  # e.g. "no analytic model for olmo2"


@dataclass
class StepRow:
    """One training step of the audit: its loss, the bytes still alive after it (and after its forward) and
    the peak of each phase."""

    step: int
    loss: float | None  # None for an estimate (meta device: no values)
    retained_bytes: int
    retained_after_forward: int
    peak_bytes: dict[str, int]
    # activation offloading (VramGuardCallback; None where none was in force): the most bytes of host copies
    # its saved-tensor hooks held at once in the step, and those still alive after it
    host_peak_bytes: int | None = None
    host_retained_bytes: int | None = None


@dataclass(frozen=True)
class Finding:
    """One thing a verdict says: ``kind`` (a stable name, e.g. ``weight-copies``, ``leak``, ``one-step``: what
    code reads), ``message`` (the wording, for people), ``bytes`` (the figure it is about, where one is) and
    whether it is a ``problem`` (fails the verdict) or a note. The kinds are listed in
    :mod:`vramguard.step.verdict`."""

    kind: str
    message: str
    bytes: int | None = None
    problem: bool = False


RECORDED = "recorded"
"""The kind of a finding read back from a schema-1 document, which stores the wording only."""


@dataclass(eq=False)
class Verdict:
    """The audit's conclusion: the one line printed last and the findings behind it; ``ok`` when none is a
    problem. ``problems`` and ``notes`` are the findings' messages (the JSON document stores those, so two
    verdicts are equal when they say the same: a verdict read back from JSON equals the one written)."""

    line: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No finding is a problem."""
        return not any(f.problem for f in self.findings)

    @property
    def problems(self) -> list[str]:
        """The messages of the problems that failed the verdict."""
        return [f.message for f in self.findings if f.problem]

    @property
    def notes(self) -> list[str]:
        """The messages of the notes worth knowing."""
        return [f.message for f in self.findings if not f.problem]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Verdict) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass with eq

    def of_kind(self, *kinds: str) -> list[Finding]:
        """The findings of these kinds."""
        return [f for f in self.findings if f.kind in kinds]

    def to_dict(self) -> dict[str, Any]:
        """The schema-1 block: ``ok``, ``line``, ``problems`` and ``notes`` (the messages)."""
        return {"ok": self.ok, "line": self.line, "problems": self.problems, "notes": self.notes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        """Inverse of :meth:`to_dict`; the findings come back with kind :data:`RECORDED`."""
        unknown = set(data) - {"ok", "line", "problems", "notes"}
        if unknown:
            raise TypeError(f"unknown fields in the verdict: {sorted(unknown)}")
        verdict = cls(
            line=data["line"],
            findings=[Finding(RECORDED, m, problem=True) for m in data.get("problems", [])]
            + [Finding(RECORDED, m) for m in data.get("notes", [])],
        )
        if "ok" in data and bool(data["ok"]) != verdict.ok:
            # ok is derived from the problems now: a document where they disagree is not read as either
            raise ValueError(f"verdict says ok={data['ok']!r} but lists {len(verdict.problems)} problem(s)")
        return verdict


@dataclass
class Overhead:
    """Device memory a report's peaks do not count, with the figure used and where it comes from.
    ``low_bytes`` / ``high_bytes``: the measured range where the figure is an expected value (the
    fragmentation allowance), else None."""

    name: str
    bytes: int
    basis: str
    low_bytes: int | None = None
    high_bytes: int | None = None


@dataclass
class DeviceEstimate:
    """``vramguard estimate``: the target's peak for one step, from a meta-device run.

    ``allocator_peak_bytes`` = frozen weights + trainable parameters + the highest phase peak (what
    the step creates: activations, gradients, optimizer state, batch). ``total_bytes`` adds the
    :class:`Overhead` figures, which are assumptions, not measurements: for ``target`` cuda a GPU's (the
    fragmentation allowance at its expected share, with its measured range in the overhead's ``low_bytes`` /
    ``high_bytes``), for cpu only what offloading keeps on the host.
    """

    weights_bytes: int
    trainable_bytes: int
    step_peak_bytes: int
    peak_phase: str
    allocator_peak_bytes: int
    overhead_bytes: int
    total_bytes: int
    overheads: list[Overhead] = field(default_factory=list)
    forced_decisions: dict[str, int] = field(default_factory=dict)
    fit: dict[str, Any] | None = None  # ``--fit``: the search's answer, runs and cheaper changes
    # the kernels the meta run took (``--target``), and so what the total adds: "cuda", the overheads measured on
    # an H100; "cpu", none of a GPU's (the host's tensors). Documents written before the field load as "cuda": their
    # totals had the H100's overheads, whatever their target
    target: str = "cuda"

    @property
    def high_total_bytes(self) -> int:
        """The total with each overhead at its high bound (the fragmentation allowance's largest measured share)."""
        return self.total_bytes + sum(o.high_bytes - o.bytes for o in self.overheads if o.high_bytes is not None)


@dataclass
class RankRow:
    """One rank of a sharded step (``audit --world-size N``, measured; ``estimate --world-size N``, on meta).

    ``weights_bytes``: this rank's frozen resident bytes (its shards of the packed 4-bit and unquantized
    weights, plus the replicated quantization state and buffers); ``trainable_bytes``: its LoRA shards;
    ``saved_bytes``: the activations its forward kept for backward (ledger; its own batch);
    ``gathered_weight_bytes``: the all-gathered (unsharded) weights its backward computes with, each unit's
    at its gathered size, not in ``saved_bytes`` (transient: FSDP frees a unit's after forward and gathers it
    again before its backward), of which ``gathered_held_bytes`` stayed gathered from forward to backward
    (the root unit, not resharded after forward); ``step_peak_bytes``: the highest phase peak
    (tracker: activations, all-gathered units, dequantized weights, gradients, reduce-scatter buffers,
    optimizer state); ``allocator_peak_bytes`` = weights + trainable + step peak; ``reserved_bytes``: the
    caching allocator's reserved peak (CUDA only, else None); ``total_bytes``: the allocator peak plus the
    named overheads (none on CPU). ``terms``: :class:`vramguard.workload.sharding.RankTerms` (sharded and
    replicated resident bytes) and ``transient``: the named transient buffers the step peak contains
    (:func:`vramguard.workload.sharding.transient_terms`). ``same_as``: an estimate ran this rank's shard
    shapes once, as rank ``same_as``. Under DeepSpeed ZeRO-3 ``terms`` also has the engine's own
    (:func:`vramguard.workload.zero3.zero3_terms`) and the allocator peak is what was resident when the tracker
    started plus the step peak (:func:`vramguard.audit.zero3.measure_zero3_rank`)."""

    rank: int
    weights_bytes: int
    trainable_bytes: int
    lora_training_bytes: int
    saved_bytes: int
    step_peak_bytes: int
    peak_phase: str
    allocator_peak_bytes: int
    reserved_bytes: int | None
    total_bytes: int
    phases: dict[str, int] = field(default_factory=dict)
    terms: dict[str, int] = field(default_factory=dict)
    transient: dict[str, int] = field(default_factory=dict)
    same_as: int | None = None
    gathered_weight_bytes: int = 0
    gathered_held_bytes: int = 0


@dataclass
class DistributedSection:
    """The per-rank view of a sharded step: ``world_size`` ranks sharded by ``sharding`` (``fsdp2``,
    ``fsdp1``, ``zero3``), ``engine`` saying what ran (real processes and backend, or the fake process group on meta),
    and one :class:`RankRow` per rank."""

    world_size: int
    sharding: str
    cpu_offload: bool
    engine: str
    per_rank: list[RankRow] = field(default_factory=list)
    # ``estimate --fit`` with ``--sharding``: the search's answer (smallest world size, or largest batch/seq)
    fit: dict[str, Any] | None = None


@dataclass
class AuditReport:
    """Everything ``vramguard audit`` measured, in one self-describing document."""

    schema_version: int
    vramguard_version: str
    environment: dict[str, Any]
    config: dict[str, Any]
    device: str
    layers: list[LayerRow]
    totals: Totals
    phases: dict[str, PhasePeak]
    budget: AnalyticComparison
    steps: list[StepRow]
    leak_bytes: int
    verdict: Verdict
    records: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0
    # model_type, model_class, attn_implementation (what ran), analytic_model (family or None)
    architecture: dict[str, Any] = field(default_factory=dict)
    # set by ``vramguard estimate`` (device "meta"), None for a measured audit
    estimate: DeviceEstimate | None = None
    # the memory through the steps by category (--snapshot, --html; CPU and meta runs), None when not recorded
    timeline: Timeline | None = None
    # ``--world-size N``: every rank's figures (the rest of the document is rank 0's); None for one device
    distributed: DistributedSection | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as the JSON document ``--json`` writes (plain lists and dicts; :meth:`from_dict` reads
        it back)."""
        d = asdict(self)
        d["verdict"] = self.verdict.to_dict()
        for row in d["layers"]:
            row["top_modules"] = [list(t) for t in row["top_modules"]]
            if row["stack"] is None:  # a text model's layer: the document it always was
                del row["stack"]
        return d

    def step_lines(self) -> list[str]:
        """The plain-text lines about the steps that every view prints: the bytes retained after each step
        and their growth, and, with activation offloading, the host copies' peak and what outlived each step."""
        fb = format_bytes
        note = "" if self.device.startswith("cuda") else " (CPU: bytes above the model's weights)"
        lines = [
            f"retained after each step{note}: "
            + ", ".join(fb(st.retained_bytes) for st in self.steps)
            + f"; growth {fb(self.leak_bytes, signed=True)}"
        ]
        host = [st for st in self.steps if st.host_peak_bytes is not None]
        if host:
            lines.append(
                "host copies of offloaded activations, peak / alive after each step: "
                + ", ".join(
                    f"{fb(st.host_peak_bytes or 0)} / {fb(st.host_retained_bytes or 0)}" for st in host
                )
            )
        return lines

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditReport:
        """Inverse of :meth:`to_dict`; raises ``KeyError``/``TypeError`` on a document of another shape."""
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"unsupported audit schema_version {data.get('schema_version')!r}")
        d = dict(data)
        d["layers"] = [
            LayerRow(**{**row, "top_modules": [tuple(t) for t in row["top_modules"]]}) for row in d["layers"]
        ]
        d["totals"] = Totals(**d["totals"])
        d["phases"] = {k: PhasePeak(**v) for k, v in d["phases"].items()}
        d["budget"] = AnalyticComparison(**d["budget"])
        d["steps"] = [StepRow(**s) for s in d["steps"]]
        d["verdict"] = Verdict.from_dict(d["verdict"])
        if d.get("estimate") is not None:
            e = dict(d["estimate"])
            e["overheads"] = [Overhead(**o) for o in e.get("overheads", [])]
            d["estimate"] = DeviceEstimate(**e)
        if d.get("timeline") is not None:
            d["timeline"] = Timeline.from_dict(d["timeline"])
        if d.get("distributed") is not None:
            dist = dict(d["distributed"])
            dist["per_rank"] = [RankRow(**row) for row in dist.get("per_rank", [])]
            d["distributed"] = DistributedSection(**dist)
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise KeyError(f"unknown fields in audit document: {sorted(unknown)}")
        return cls(**d)


def with_routing_note(report: Any, kind: str, message: str, figure: int | None = None) -> Any:
    """``report`` with its ``routing:`` note (the build's) replaced by ``message``, in the same place (added
    last where there was none); the verdict's line is unchanged (a note fails nothing)."""
    import dataclasses

    new = Finding(kind, message, figure)
    findings = list(report.verdict.findings)
    at = next((i for i, f in enumerate(findings) if f.message.startswith("routing:")), None)
    if at is None:
        findings.append(new)
    else:
        findings[at] = new
    return dataclasses.replace(report, verdict=dataclasses.replace(report.verdict, findings=findings))
