"""``vramguard estimate --fit SIZE``: the largest batch (or sequence) whose estimate fits in SIZE.

A search over meta runs (:func:`vramguard.estimate.run.run_estimate`), each an exact step of the
libraries' code, that never takes more than ``ceil(log2(limit)) + 2`` runs for values in [1, limit]
(:func:`run_bound`) and usually takes four. The answer is one of limit + 1 values (0: not even 1
fits). Every probe is an interpolation guess, clamped so that whichever way it turns out, what is left
can still be bisected within the bound: with R runs left, a probe may leave at most 2^(R-1)
candidates. Memory grows with the batch (and the sequence) almost linearly, so the first two probes
bisect (a meta run at batch 2^19 costs what one at batch 1 does: shapes only) and keep the slack; the
line through them puts the third probe on the answer and the fourth, one above it, proves it. Where
the line does not hold (the loss keeps a batch-1 special case, eager attention grows with seq²), the
guesses come from the measured values either side of the answer and the clamp turns them into bisection
as the slack runs out. A value whose tensors torch cannot describe (over 2^63 bytes) does not fit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vramguard.estimate.run import TooLarge
from vramguard.estimate.techniques import registered
from vramguard.step.report import AuditReport
from vramguard.step.technique import Place
from vramguard.workload.models import QLoRAConfig

DIMS = ("batch", "seq")
FIT_LIMIT = 1 << 20
"""The largest batch or sequence length searched."""


@dataclass(frozen=True)
class Dim:
    """A dimension :func:`search` takes other than batch and seq: its ``name`` (``Fit.dim``) and how a value of it
    is set in a config (:meth:`apply`; e.g. :class:`vramguard.estimate.fit_image.ImageDim`)."""

    name: str

    def apply(self, config: QLoRAConfig, value: int) -> QLoRAConfig:
        """``config`` with this dimension at ``value``."""
        raise NotImplementedError


@dataclass
class Fit:
    """The answer of a search: ``largest`` (0: not even 1 fits) and every run it took (total None:
    beyond what torch can describe)."""

    size_bytes: int
    dim: str
    largest: int
    bound: int = 0  # the most runs the search may take (run_bound)
    runs: list[tuple[int, int | None]] = field(default_factory=list)  # (value, total bytes), in run order
    changes: list[dict[str, Any]] = field(default_factory=list)  # what would make the requested shape fit

    @property
    def run_count(self) -> int:
        """How many meta runs the search took (the totals it was given as ``known`` are not runs)."""
        return len(self.runs)

    def to_dict(self) -> dict[str, Any]:
        """The answer as ``--json`` records it under ``estimate.fit``: every field, each run as a [value,
        total bytes] pair (null: beyond what torch can describe), and :attr:`run_count`."""
        d = dataclasses.asdict(self)
        d["runs"] = [list(r) for r in self.runs]
        d["run_count"] = self.run_count
        return d


Estimator = Callable[[QLoRAConfig], int]
"""A config's figure held against the memory: its step's total as ``--fit`` judges it (:data:`FIT_AT`: the
expected total or the high end; a sharded step's highest rank's, :func:`rank_total`); :class:`TooLarge` where
torch cannot describe the step."""


def _total(report: AuditReport) -> int:
    assert report.estimate is not None
    return report.estimate.total_bytes


def run_bound(limit: int) -> int:
    """The most meta runs :func:`search` takes over [1, ``limit``]: ``ceil(log2(limit)) + 2``."""
    return math.ceil(math.log2(max(limit, 1))) + 2


def search(
    config: QLoRAConfig,
    size: int,
    estimate: Estimator,
    dim: str | Dim = "batch",
    limit: int = FIT_LIMIT,
    known: dict[int, int] | None = None,
) -> Fit:
    """The largest value of ``dim`` (batch or seq, or a :class:`Dim`) in [1, ``limit``] whose estimated total fits
    ``size``, in at most :func:`run_bound` runs (memory is taken to grow with the value). ``known``: totals
    already estimated (the requested shape's), used as measured, not counted as runs. ``estimate``: a config's
    figure held against ``size`` (:data:`Estimator`)."""
    if not isinstance(dim, Dim) and dim not in DIMS:
        raise ValueError(f"dim must be one of {DIMS}, got {dim!r}")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    key = "batch" if dim == "batch" else "seq_len"
    fit = Fit(size_bytes=size, dim=dim.name if isinstance(dim, Dim) else dim, largest=0, bound=run_bound(limit))
    measured: dict[int, int | None] = {}  # None: beyond what torch can describe

    def fits(value: int) -> bool:
        changed = dim.apply(config, value) if isinstance(dim, Dim) else dataclasses.replace(config, **{key: value})
        try:
            got: int | None = estimate(changed)
        except TooLarge:
            got = None
        measured[value] = got
        fit.runs.append((value, got))
        return got is not None and got <= size

    lo, hi = 0, limit + 1  # the answer is in [lo, hi - 1]: lo fits (0: nothing needs to), hi does not
    for value, known_total in (known or {}).items():
        if 1 <= value <= limit:
            measured[value] = known_total
            lo, hi = (max(lo, value), hi) if known_total <= size else (lo, min(hi, value))
    while hi - lo > 1:
        left = fit.bound - fit.run_count  # >= 1 here: the clamp keeps hi - lo <= 2 ** left
        half = 1 << (left - 1)
        # a probe v leaves hi - v candidates if it fits, v - lo if not: both at most 2^(left-1)
        low, high = max(lo + 1, hi - half), min(hi - 1, lo + half)
        predicted = _predict(measured, lo, hi, size)
        if predicted is None:
            v = (lo + hi) // 2
        else:
            # one above the prediction first: when it does not fit, only [lo, predicted] is left, and
            # the prediction itself is the next probe (two runs, where probing it first leaves
            # everything above it open when it fits)
            v = predicted + 1 if predicted + 1 < hi else predicted
        v = min(max(v, low), high)
        if fits(v):
            lo = v
        else:
            hi = v
    fit.largest = lo
    return fit


def _predict(measured: dict[int, int | None], lo: int, hi: int, size: int) -> int | None:
    """The largest value in [lo, hi - 1] whose total the measured values put at or below ``size``, or
    None with fewer than two: the curve through the (at most three) measured values nearest to the
    answer, ``lo`` and ``hi`` first. Three make a parabola: memory is a constant (weights) + linear
    (activations) + quadratic (attention along the sequence) term, which a line through values
    far from the answer misses by a factor."""
    points = [(v, Fraction(t)) for v, t in measured.items() if t is not None]
    if len(points) < 2:
        return None

    def distance(p: tuple[int, Fraction]) -> tuple[int, int]:
        return (0 if p[0] in (lo, hi) else 1, max(lo - p[0], p[0] - hi))

    through = sorted(points, key=distance)[:3]

    def curve(v: int) -> Fraction:  # Lagrange through ``through``
        total = Fraction(0)
        for i, (xi, yi) in enumerate(through):
            term = yi
            for j, (xj, _) in enumerate(through):
                if i != j:
                    term *= Fraction(v - xj, xi - xj)
            total += term
        return total

    a, b = lo, hi - 1
    if curve(b) <= size:
        return b
    if a < 1 or curve(a) > size:
        a = 0  # the curve crosses size at or below lo (0: the curve says nothing fits)
    while b - a > 1:  # curve(a) <= size < curve(b) (a = 0 taken as fitting): bisect on the curve, no runs
        mid = (a + b) // 2
        a, b = (mid, b) if curve(mid) <= size else (a, mid)
    return a


Change = tuple[str, QLoRAConfig]
"""One change ``--fit`` may offer: its flags as the user would give them, and the changed config."""

PAIR_POOL = 3
"""Where no single change fits, the combinations tried: every pair of the ``PAIR_POOL`` single changes with the
smallest totals (at most 3 more meta runs)."""


def micro_batches(config: QLoRAConfig, largest_batch: int) -> Change | None:
    """The same rows a step in micro-batches of the largest batch that divides them and is no larger than
    ``largest_batch`` (the search's answer, below the requested batch; 0, where no batch was found to fit or none
    was searched: micro-batches of 1), by gradient accumulation; None for a batch of 1 or where the largest batch
    is not below the requested one."""
    if config.batch <= 1 or largest_batch >= config.batch:
        return None
    rows_a_step = config.batch * config.gradient_accumulation_steps
    micro = max(d for d in range(1, max(largest_batch, 1) + 1) if rows_a_step % d == 0)
    return (
        f"--batch {micro} --gradient-accumulation-steps {rows_a_step // micro}",
        dataclasses.replace(config, batch=micro, gradient_accumulation_steps=rows_a_step // micro),
    )


def single_changes(config: QLoRAConfig, largest_batch: int, place: Place, peak_phase: str) -> list[Change]:
    """Every single change ``--fit`` tries for ``config`` (see :func:`cheaper_changes`), in a fixed order:
    micro-batches, checkpointing, half the LoRA rank, PEFT's default targets instead of all-linear, the
    optimizers, then each registered technique's alternative (:attr:`~vramguard.step.technique.Technique.cheaper`:
    offloading, Liger, bf16 autocast, FlashAttention-2, padding-free, where the place has them and its trainer
    prices them)."""
    half = max(1, config.lora_rank // 2)
    options: list[Change] = []
    micro = micro_batches(config, largest_batch)
    if micro is not None:
        options.append(micro)
    if not config.gradient_checkpointing:
        options.append(("--gradient-checkpointing", dataclasses.replace(config, gradient_checkpointing=True)))
    if config.lora_rank > 1:
        options.append((f"--lora-rank {half}", dataclasses.replace(config, lora_rank=half)))
    options += fewer_targets(config)
    if config.optimizer == "adamw" and place.target == "cuda" and peak_phase == "optimizer":
        options.append(("--optimizer adamw-fused", dataclasses.replace(config, optimizer="adamw-fused")))
    if config.optimizer in ("adamw", "adamw-fused"):
        options.append(("--optimizer adamw-8bit", dataclasses.replace(config, optimizer="adamw-8bit")))
    options += [o for o in (t.cheaper(config, place) for t in registered()) if o is not None]
    return options


def fewer_targets(config: QLoRAConfig) -> list[Change]:
    """LoRA on fewer modules than all-linear: a vision-language model's language model only (``--lora-scope
    language-model``: no LoRA in the tower and projector), another model's PEFT default targets where PEFT has them
    for its model type (``--target-modules peft-default``; where it has none, the run would be refused)."""
    if config.method == "full" or config.target_modules != "all-linear" or config.target_parameters:
        return []
    from vramguard.workload.vision import is_vision_spec

    if is_vision_spec(config.spec):
        if config.lora_scope != "all":
            return []
        return [("--lora-scope language-model", dataclasses.replace(config, lora_scope="language-model"))]
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    if config.spec.transformers_config().model_type not in PEFT_DEFAULTS:
        return []
    return [("--target-modules peft-default", dataclasses.replace(config, target_modules="peft-default"))]


def checkpointing_and_rank(config: QLoRAConfig) -> list[Change]:
    """Checkpointing with half the LoRA rank, tried with the single changes (where both apply)."""
    if config.gradient_checkpointing or config.lora_rank <= 1:
        return []
    half = max(1, config.lora_rank // 2)
    changed = dataclasses.replace(config, gradient_checkpointing=True, lora_rank=half)
    return [(f"--gradient-checkpointing --lora-rank {half}", changed)]


def _differences(config: QLoRAConfig, changed: QLoRAConfig) -> dict[str, Any]:
    """The fields ``changed`` sets to other values than ``config``."""
    return {
        f.name: getattr(changed, f.name)
        for f in dataclasses.fields(config)
        if getattr(changed, f.name) != getattr(config, f.name)
    }


def pairs(
    config: QLoRAConfig, rows: list[dict[str, Any]], options: list[Change], tried: list[Change]
) -> list[Change]:
    """Each pair of the :data:`PAIR_POOL` single changes (``options``) with the smallest totals (``rows``,
    measured), both applied: a pair whose changes set one field to two values, or whose config a change already
    ``tried`` has, is left out."""
    measured = {row["change"]: row["total_bytes"] for row in rows if "refused" not in row}
    pool = sorted(options, key=lambda o: measured[o[0]])[:PAIR_POOL]
    seen = [_differences(config, changed) for _, changed in tried]
    found: list[Change] = []
    for i, (flag_a, a) in enumerate(pool):
        for flag_b, b in pool[i + 1:]:
            da, db = _differences(config, a), _differences(config, b)
            both = {**da, **db}
            if any(da[k] != db[k] for k in da.keys() & db.keys()) or both in seen:
                continue
            found.append((f"{flag_a} {flag_b}", dataclasses.replace(config, **both)))
    return found


def cheaper_changes(
    config: QLoRAConfig,
    size: int,
    estimate: Estimator,
    largest_batch: int = 0,
    place: Place = Place(),
    peak_phase: str = "",
) -> list[dict[str, Any]]:
    """For a shape that does not fit: the estimate of each change vramguard can run (:func:`single_changes`), and
    where none fits, of pairs of the most promising (:func:`pairs`); what fits first, then the fewest flags
    changed, then the smallest total (:func:`by_cost` orders them by their cost in step time for reading).

    At most one meta run per change tried (no more than 13: each option and technique offered once, and
    checkpointing with half the rank) plus
    :data:`PAIR_POOL` pairs (3): ``estimate`` (:data:`Estimator`) is called once per change, and a caller that
    measured a config already (the search's) can answer it from a cache (:func:`remembered`).
    ``largest_batch``: the largest batch that fits (a ``--fit`` search's answer; 0: none or not searched): the
    same rows a step in micro-batches no larger, by gradient accumulation (:func:`micro_batches`); its own meta run
    prices the gradients that holds, so it may still not fit. ``place``: the target, the card and the trainer
    (:class:`~vramguard.step.technique.Place`): each registered technique offers its own alternative where they
    have it (bf16 and FlashAttention-2 on a card of compute capability 8.0 or newer; offloading on CUDA only, where
    it saves device memory; offloading and Liger on vramguard's loop, the only step that prices them yet).
    ``peak_phase``: the requested shape's; where it is the optimizer step, on CUDA, the fused AdamW is offered
    (torch's default there, ``foreach``, holds a temporary as large as the trainable parameters in that step
    only). The changes' runs go to worker processes (:func:`_rows`)."""
    singles = single_changes(config, largest_batch, place, peak_phase)
    tried = singles + checkpointing_and_rank(config)
    rows = _rows(tried, estimate, size)
    priced = [o for o, r in zip(singles, rows) if "refused" not in r]
    if priced and not any(r["fits"] for r in rows):
        rows += _rows(pairs(config, rows, priced, tried), estimate, size)
    # cheapest: what fits, then the fewest flags changed (a single change before a combination); refused last
    rows.sort(key=lambda r: (not r["fits"], "refused" in r, r["change"].count("--"), r["total_bytes"] or 0))
    return rows


def _rows(changes: list[Change], estimate: Estimator, size: int) -> list[dict[str, Any]]:
    """Each change's row: its total and whether it fits, or (``refused``: the one line) why its step cannot be
    priced (a change the user's run would refuse, or beyond what torch can describe): named, never the whole
    answer. The changes' meta runs are independent: they run in worker processes, on every core
    (:func:`vramguard.estimate.workers.map_in_workers`)."""
    from vramguard.errors import UsageError
    from vramguard.estimate.workers import Refused, map_in_workers

    totals = map_in_workers(estimate, [changed for _, changed in changes], refusals=(UsageError,))
    rows: list[dict[str, Any]] = []
    for (change, _), total in zip(changes, totals, strict=True):
        if isinstance(total, Refused):
            rows.append({"change": change, "total_bytes": None, "fits": False, "refused": total.message})
        else:
            rows.append({"change": change, "total_bytes": total, "fits": total <= size})
    return rows


def remembered(estimate: Estimator) -> Estimator:
    """``estimate`` that runs each config once: a config measured before (the search's probe at a batch a change
    asks for again) is answered from what it gave (a :class:`TooLarge` is not kept)."""
    seen: dict[tuple[Any, ...], int] = {}

    def once(config: QLoRAConfig) -> int:
        key = tuple(getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model")
        if key not in seen:
            seen[key] = estimate(config)
        return seen[key]

    return once


def high_end(report: AuditReport) -> int:
    """A report's total at the high end (each overhead at its largest measured share: ``--fit-at high``)."""
    from vramguard.estimate.run import high_total

    assert report.estimate is not None
    return high_total(report.estimate)


FIT_AT = {"expected": _total, "high": high_end}
"""``--fit-at``: the figure of a report held against the memory, by name."""


@dataclass(frozen=True)
class Cost:
    """What a change costs in step time: ``rank`` (0 none, higher slower), ``word`` (a few words for the
    answer line) and ``detail``."""

    rank: int
    word: str
    detail: str


COSTS: dict[str, Cost] = {}
"""The step-time cost of each option a change sets, by the option's name (:func:`cost_of`)."""


def register_cost(flag: str, cost: Cost) -> None:
    """Say what setting ``flag`` costs in step time."""
    COSTS[flag] = cost


register_cost("--lora-rank", Cost(0, "no time", "a smaller adapter, with less capacity"))
register_cost(
    "--bf16", Cost(0, "none (faster)", "bf16 matmuls on the tensor cores; activations kept in half the bytes")
)
register_cost(
    "--attn-implementation",
    Cost(0, "none (faster)", "FlashAttention-2's fused kernel: no s x s scores kept, less memory traffic"),
)
register_cost("--padding-free", Cost(0, "none", "no pad tokens: the rows flattened into one, fewer tokens computed"))
register_cost("--packing", Cost(0, "none", "TRL's bfd packing, padding-free: no pad tokens, fewer rows a step"))
register_cost("--use-liger-kernel", Cost(0, "none", "Liger's fused Triton kernels and chunked cross-entropy"))
register_cost("--optimizer", Cost(0, "no time", "the optimizer's state kept in another form"))
register_cost(
    "--target-modules",
    Cost(0, "no time", "adapters on PEFT's default modules for the architecture only, with less capacity"),
)
register_cost(
    "--lora-scope",
    Cost(0, "no time", "adapters on the language model only, none in the vision tower and projector: less capacity there"),
)
register_cost(
    "--gradient-accumulation-steps",
    Cost(1, "smaller matmuls", "the same rows in smaller micro-batches: the GPU less busy per kernel"),
)
register_cost(
    "--gradient-checkpointing",
    Cost(2, "recompute", "each decoder layer's forward runs again in backward"),
)
register_cost(
    "--offload-activations",
    Cost(3, "PCIe traffic", "every saved tensor copied to the host in forward and back in backward"),
)


def cost_of(change: str) -> Cost:
    """The cost of a change (``"--gradient-checkpointing --lora-rank 8"``): its costliest option's; an option
    with no registered cost counts as unknown, after every known one."""
    flags = [word for word in change.split() if word.startswith("--")]
    costs = [COSTS.get(f, Cost(99, "unknown cost", "not said")) for f in flags if f != "--batch"]
    top = max(costs, key=lambda c: c.rank, default=Cost(99, "unknown cost", "not said"))
    details = list(dict.fromkeys(c.detail for c in costs if c.rank == top.rank))  # every option at that cost
    return Cost(top.rank, top.word, "; ".join(details)) if len(details) > 1 else top


def by_cost(changes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``--fit``'s changes (its document's rows) as a person should read them: what fits first, the cheapest in
    step time, then the fewest options changed, then the fewest bytes."""
    def key(row: dict[str, Any]) -> tuple[bool, int, int, int]:
        changed = row["change"].count("--")
        return (not row["fits"], "refused" in row, cost_of(row["change"]).rank, changed, row["total_bytes"] or 0)

    return sorted(changes, key=key)


def rank_total(report: AuditReport) -> int:
    """A sharded step's figure against a device's memory: the highest total of its ranks."""
    assert report.distributed is not None
    return max(row.total_bytes for row in report.distributed.per_rank)


WORLD_LIMIT = 1024
"""The largest world size ``--fit`` without ``--world-size`` searches."""


@dataclass
class WorldFit:
    """The smallest world size whose every rank fits ``size_bytes`` (0: none up to ``limit``), and every run
    it took as (world size, highest rank's total; None: beyond what torch can describe), in run order."""

    size_bytes: int
    smallest: int
    limit: int
    runs: list[tuple[int, int | None]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The answer as ``--json`` records it under ``distributed.fit``."""
        return {
            "size_bytes": self.size_bytes,
            "smallest_world_size": self.smallest,
            "limit": self.limit,
            "runs": [list(r) for r in self.runs],
            "run_count": len(self.runs),
        }


def smallest_world(size: int, total_at: Callable[[int], int], limit: int = WORLD_LIMIT) -> WorldFit:
    """The smallest world size in [1, ``limit``] at which ``total_at(n)`` (the highest rank's total with ``n``
    ranks) fits ``size``: doubling until one fits, then bisecting between the last that did not and it, at
    most ``2 * ceil(log2(limit)) + 1`` runs. A rank's memory is taken not to grow with the world size (its
    shards shrink; what every rank holds whole, the quant_state, the activations of its own batch, does not
    change), so a world size that fits stays fitting above it."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    fit = WorldFit(size_bytes=size, smallest=0, limit=limit)

    def fits(n: int) -> bool:
        try:
            got: int | None = total_at(n)
        except TooLarge:
            got = None
        fit.runs.append((n, got))
        return got is not None and got <= size

    lo, n = 0, 1  # lo: the largest world size seen not to fit (0: none yet)
    while not fits(n):
        lo = n
        if n >= limit:
            return fit
        n = min(2 * n, limit)
    hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    fit.smallest = hi
    return fit
