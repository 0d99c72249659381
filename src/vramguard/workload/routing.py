"""Mixture-of-experts routing forced to a chosen assignment, through the model's own expert code.

With transformers' ``eager`` experts (a loop over the experts hit, each expert's tensors sized by the tokens
routed to it) routing decides bytes. :func:`forced_routing` replaces the router's ``top_k_index`` where the
experts module receives it (a forward pre-hook on every experts module): the router's own ops run and keep
what they keep, then every expert loop runs with the chosen assignment. The same hook runs on a real device
(the audit) and on meta, where :mod:`vramguard.estimate.meta` carries the assignment's values beside its
meta tensors so the loop's data-dependent steps (``nonzero``, ``.item()``) are answered with them.

The assignments are made from per-expert token counts (:func:`expert_counts`, :func:`assignment`), before the
step: the tensors are no part of what the step allocates, as the router's own indices would be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vramguard.workload.families import experts_of

ROUTINGS: tuple[str, ...] = ("same", "balanced", "skewed")
"""The assignments :func:`expert_counts` makes:

* ``same``: all tokens to the same ``top_k`` experts (0 .. top_k-1), each with every token;
* ``balanced``: the tokens x top_k choices spread as evenly as possible (counts differ by at most one);
* ``skewed``: every expert hit, the highest-numbered ones with one token each, the rest packed into the
  lowest-numbered experts (each taking at most every token).

The eager loop runs the experts hit in ascending order, so autograd's backward visits them in descending
order, freeing each one's saved tensors; from the second expert visited on, it accumulates full-size
gradients (of the expert stacks when LoRA adapts them, of the layer's input) out of place. ``skewed``'s first
experts visited hold one token each and free almost nothing before that: the highest backward peak found;
``same``'s first free every token's: the lowest found (a search over routings on the tiny presets,
``docs/scripts/routing_search.py``, not a proof: docs/audit.md)."""


Routing = str | tuple[int, ...]
"""A forced routing: a name of :data:`ROUTINGS`, or the tokens routed to each expert (the same in every layer;
``tokens x top_k`` in all, at most ``tokens`` each), as a search over routings gives them
(``docs/scripts/routing_search.py``)."""


def counts_of(kind: Routing, tokens: int, top_k: int, experts: int) -> list[int]:
    """The tokens routed to each expert under ``kind``: :func:`expert_counts` for a name, the counts themselves
    (checked to route ``tokens`` tokens to ``top_k`` of ``experts`` experts) for a tuple."""
    if isinstance(kind, str):
        return expert_counts(kind, tokens, top_k, experts)
    counts = [int(c) for c in kind]
    if len(counts) != experts or sum(counts) != tokens * top_k or max(counts) > tokens or min(counts) < 0:
        raise ValueError(f"counts {counts} do not route {tokens} tokens to {top_k} of {experts} experts")
    return counts


def expert_counts(kind: str, tokens: int, top_k: int, experts: int) -> list[int]:
    """Tokens routed to each expert under ``kind`` (:data:`ROUTINGS`): ``tokens x top_k`` in all, at most
    ``tokens`` each (a token picks ``top_k`` different experts)."""
    if kind not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {kind!r}")
    if not 1 <= top_k <= experts or tokens < 1:
        raise ValueError(f"cannot route {tokens} tokens to {top_k} of {experts} experts")
    slots = tokens * top_k
    if kind == "same":
        return [tokens if e < top_k else 0 for e in range(experts)]
    if kind == "balanced":
        return [slots // experts + (1 if e < slots % experts else 0) for e in range(experts)]
    counts = [1 if e < slots else 0 for e in range(experts)]  # every expert hit (as far as there are choices)
    left = slots - sum(counts)
    for e in range(experts):  # packed from the lowest-numbered expert up
        more = min(tokens - counts[e], left)
        counts[e] += more
        left -= more
    return counts


def assignment(counts: list[int], tokens: int, top_k: int) -> torch.Tensor:
    """A ``(tokens, top_k)`` int64 ``top_k_index`` that routes ``counts[e]`` tokens to expert ``e``, each token to
    ``top_k`` different experts: the choices listed expert by expert, choice ``i`` going to token ``i % tokens``
    as its ``i // tokens``-th pick (an expert's run of at most ``tokens`` consecutive choices never meets a
    token twice)."""
    if sum(counts) != tokens * top_k or max(counts) > tokens or min(counts) < 0:
        raise ValueError(f"counts {counts} do not route {tokens} tokens to {top_k} experts each")
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return experts.view(top_k, tokens).t().contiguous()


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules of a mixture of experts: those transformers' ``use_experts_implementation`` made
    (it sets ``has_gate`` on the instance; PEFT's wrappers around them only forward attribute reads)."""
    return [m for m in model.modules() if "has_gate" in vars(m) and hasattr(m, "num_experts")]


def experts_implementation(model: torch.nn.Module) -> str | None:
    """The experts implementation the model runs (``eager``, ``grouped_mm``, ...), None for a dense model."""
    if not experts_modules(model):
        return None
    config = getattr(experts_modules(model)[0], "config", None)
    return getattr(config, "_experts_implementation", None) or "eager"


def experts_top_k(model: torch.nn.Module) -> int:
    """How many experts each token of ``model`` is routed to (1 for a dense model)."""
    experts = experts_of(getattr(model, "config", None))
    return experts.top_k if experts is not None else 1


def eager_top_k(model: torch.nn.Module) -> int | None:
    """:func:`experts_top_k` of a mixture of experts whose experts loop over the experts hit (``eager``: routing
    decides the step's peak, and the audit and the estimates bound it by forced routings); None otherwise."""
    return experts_top_k(model) if experts_implementation(model) == "eager" else None


@contextlib.contextmanager
def forced_routing(
    model: torch.nn.Module,
    kind: Routing,
    tokens: int,
    place: Callable[[torch.Tensor], torch.Tensor] | None = None,
    inside: Callable[[bool], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Within the block every experts module of ``model`` receives the ``kind`` assignment
    (:data:`ROUTINGS`, or per-expert counts: :data:`Routing`) of ``tokens`` tokens instead of the router's
    ``top_k_index``.

    ``place`` puts the host assignment where the model runs (default: the device of the first parameter);
    ``inside(True/False)`` is told when an experts module's forward begins and ends (the meta run's value
    carrier uses it). Yields ``{"forced": calls forced, "counts": tokens per expert}``; a call with another
    number of tokens than ``tokens`` is an error (the assignment was made for the batch)."""
    modules = experts_modules(model)
    if not modules:
        raise ValueError("the model has no experts modules to route")
    device = next(model.parameters()).device
    made: dict[tuple[int, int], torch.Tensor] = {}
    taken: dict[str, Any] = {"forced": 0, "counts": {}}
    for m in modules:
        key = (int(m.num_experts), _top_k_of(m, model))
        if key not in made:
            counts = counts_of(kind, tokens, key[1], key[0])
            host = assignment(counts, tokens, key[1])
            made[key] = place(host) if place is not None else host.to(device)
            taken["counts"][key[0]] = counts

    def pre(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = list(args), dict(kwargs)
        if len(args) >= 2:
            original = args[1]
        else:
            name = next(k for k in ("top_k_index", "router_indices") if k in kwargs)
            original = kwargs[name]
        forced = made[(int(module.num_experts), int(original.shape[-1]))]
        if tuple(original.shape) != tuple(forced.shape):
            raise ValueError(
                f"routing forced for {tuple(forced.shape)}, the router chose {tuple(original.shape)}"
            )
        if len(args) >= 2:
            args[1] = forced
        else:
            kwargs[name] = forced
        taken["forced"] += 1
        if inside is not None:
            inside(True)
        return tuple(args), kwargs

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        if inside is not None:
            inside(False)

    handles = []
    try:
        for m in modules:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post))
        yield taken
    finally:
        for h in handles:
            h.remove()


def _top_k_of(module: torch.nn.Module, model: torch.nn.Module) -> int:
    experts = experts_of(getattr(module, "config", None) or getattr(model, "config", None))
    if experts is None:
        raise TypeError("the experts' config names no mixture of experts")
    return experts.top_k


def describe(kind: Routing, top_k: int) -> str:
    """What the ``kind`` routing is, in words."""
    if not isinstance(kind, str):
        return f"tokens per expert {', '.join(map(str, kind))}"
    return {
        "same": f"all tokens to the same top {top_k} experts",
        "balanced": "balanced routing",
        "skewed": "every expert hit, the highest-numbered with one token each",
    }[kind]


def step_peak(report: Any) -> int:
    """The step's peak of a report: the highest phase peak (the estimate's ``step_peak_bytes``)."""
    return max(p.peak_bytes for p in report.phases.values())


def figures(report: Any) -> tuple[int, int]:
    """What :func:`bounds_line` holds of a run: its step peak and its saved bytes."""
    return step_peak(report), report.totals.saved_bytes


META_RUNS = "a meta run of this step"
"""How :func:`bounds_line` says the forced routings ran, by default."""


def bounds_line(
    implementation: str,
    top_k: int,
    bounds: dict[str, tuple[int, int]],
    measured: tuple[int, int] | None,
    forced_by: str = META_RUNS,
) -> str:
    """The ``routing:`` line of an eager mixture of experts: ``bounds`` maps each forced routing
    (:data:`ROUTINGS`) to its (step peak, saved bytes); ``measured`` is the audit's figures for the routing its
    router drew (None for an estimate, whose figure is the high); ``forced_by`` says how each forced routing ran
    (:data:`META_RUNS`, or the Trainer's own runs)."""
    from vramguard.units import format_bytes as fb

    kinds = sorted(bounds, key=lambda k: (bounds[k][0], ROUTINGS.index(k)))
    low, high = kinds[0], kinds[-1]
    if len(set(bounds.values())) == 1 and (measured is None or measured == bounds[high]):
        peak, saved_bytes = bounds[high]
        return (
            f"routing: with the {implementation} experts (a loop over the experts hit, each one's tensors sized by "
            f"its tokens) routing can move the step's peak; here it does not: "
            f"{describe('same', top_k)}, {describe('balanced', top_k)} and {describe('skewed', top_k)}: all peak "
            f"at {fb(peak)} with {fb(saved_bytes)} "
            f"saved (each {forced_by}, the router's choice replaced)"
            + ("; so does the routing this run drew" if measured is not None else "")
        )
    saved = sorted({s for _, s in bounds.values()} | ({measured[1]} if measured else set()))
    saved_text = (
        f"not the saved bytes ({fb(saved[0])})"
        if len(saved) == 1
        else f"and the saved bytes ({fb(saved[0])} to {fb(saved[-1])})"
    )
    low_text = f"the low {fb(bounds[low][0])} ({describe(low, top_k)})"
    high_text = f"the high {fb(bounds[high][0])} ({describe(high, top_k)})"
    if measured is None:
        where = f"this estimate is {high_text}; {low_text}"
    else:
        m = measured[0]
        if bounds[low][0] <= m <= bounds[high][0]:
            place = f"between {low_text} and {high_text}"
        else:
            side = "above" if m > bounds[high][0] else "below"
            place = f"{side} every forced routing, not bounded: {low_text}, {high_text}"
        where = f"the routing this run drew peaked at {fb(m)}, {place}"
    others = "".join(f"; {describe(k, top_k)} {fb(bounds[k][0])}" for k in kinds[1:-1])
    return (
        f"routing: with the {implementation} experts (a loop over the experts hit, each one's tensors sized by its "
        f"tokens) routing decides the step's peak, {saved_text}: {where}{others}. Backward visits the experts "
        "hit from the highest-numbered down, freeing each one's saved tensors, and accumulates full-size "
        "gradients from the second on: the fewer tokens the first ones hold, the higher the peak (each forced "
        f"routing {forced_by}, the router's choice replaced; low and high are the lowest and highest "
        "of the three forced routings, the extremes a search over routings of the tiny presets found, not proven "
        "bounds)"
    )


def forced_line(kind: Routing, top_k: int, counts: dict[int, list[int]]) -> str:
    """The ``routing:`` line of a run whose routing was forced."""
    per = "; ".join(f"{n} experts: {', '.join(map(str, c))} tokens" for n, c in counts.items())
    return f"routing: forced to {describe(kind, top_k)} ({per}), the router's choice replaced in every layer"
