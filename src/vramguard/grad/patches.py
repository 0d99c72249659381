"""Named, reversible patches that change a library the way a contributor would.

Why: a memory fix (e.g. bitsandbytes PR 1935, "wrap F.linear in torch.no_grad() in the 4-bit/8-bit
forward") is only acceptable if it changes no numbers, and a memory measurement is only meaningful if
the patch really took effect. Both questions need the *same* patch object::

    from vramguard.grad import patches
    p = patches.get("no-grad-linear:8bit-fp")
    ok = p.applies()            # truthy, or falsy with .reason ("code it targets is gone")
    with p.apply():             # raises PatchNotApplicable instead of silently doing nothing
        ...

Sources of patches: the built-ins below, the ``vramguard.patches`` entry-point group (each entry
point loads a :class:`Patch` or a zero-argument callable returning one), and ``module:function``
strings (:func:`load_patch`) -- from ``VRAMGUARD_PATCHES`` (comma separated) or ``--vram-patch`` in
``tests_grad``. The gradient suite runs every property for every patch in :func:`available`.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.metadata
import inspect
import os
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vramguard.errors import UsageError

ENTRY_POINT_GROUP = "vramguard.patches"
ENV_VAR = "VRAMGUARD_PATCHES"


class PatchNotApplicable(RuntimeError):
    """The code a patch targets is not in the installed library version."""


class Applicability(NamedTuple):
    """Whether a patch applies; falsy with a human ``reason`` when it does not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Patch:
    """A reversible change. ``enter`` returns a context manager that applies it for its duration.

    ``check`` returns ``None`` when the patch applies, else the reason it does not.
    ``claims_memory_only``: the patch promises bit-identical outputs and gradients (the suite holds it
    to that); otherwise it only has to stay within tolerance of the reference.
    """

    name: str
    description: str
    enter: Callable[[], contextlib.AbstractContextManager[Any]]
    check: Callable[[], str | None] = field(default=lambda: None)
    claims_memory_only: bool = True

    def applies(self) -> Applicability:
        """Whether the patch can be applied here, with the reason when not (an exception in its check is a
        reason, not a crash)."""
        try:
            reason = self.check()
        except Exception as exc:  # an import error etc. is a reason, not a crash
            reason = f"{type(exc).__name__}: {exc}"
        return Applicability(reason is None, reason or "")

    @contextlib.contextmanager
    def apply(self) -> Iterator[None]:
        """Apply the patch for the duration of the ``with`` block; raises PatchNotApplicable when
        :meth:`applies` says no."""
        can = self.applies()
        if not can:
            raise PatchNotApplicable(f"patch {self.name!r} does not apply: {can.reason}")
        with self.enter():
            yield


# --- source patches: rewrite one function, swap its code object, restore on exit ----------------


def _resolve(target: str) -> Any:
    """``"pkg.module:Qual.name"`` -> the function object (unwrapping staticmethod/classmethod)."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if not inspect.isfunction(obj):
        raise TypeError(f"{target} is not a Python function")
    return obj


def _calls(node: ast.AST, names: frozenset[str]) -> bool:
    """Does ``node`` contain a call to a function or attribute whose last name is in ``names``?"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            last = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if last in names:
                return True
    return False


class _WrapInNoGrad(ast.NodeTransformer):
    """Wrap every statement that calls one of ``names`` in ``with torch.no_grad():``."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.wrapped = 0

    def _wrap_body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in body:
            simple = isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return))
            if simple and _calls(stmt, self.names):
                no_grad = ast.parse("__import__('torch').no_grad()", mode="eval").body
                out.append(ast.With(items=[ast.withitem(context_expr=no_grad)], body=[stmt]))
                self.wrapped += 1
            else:
                out.append(self.visit(stmt))
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                setattr(node, name, self._wrap_body(body))
        for handler in getattr(node, "handlers", []) or []:
            handler.body = self._wrap_body(handler.body)
        return node


def _rewritten_code(fn: Any, names: frozenset[str]) -> tuple[Any, int]:
    """Compile ``fn``'s source with the statements calling ``names`` wrapped in no_grad."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    fdef = tree.body[0]
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TypeError(f"{fn.__qualname__}: source is not a function definition")
    fdef.decorator_list = []
    transformer = _WrapInNoGrad(names)
    fdef.body = transformer._wrap_body(fdef.body)
    ast.fix_missing_locations(tree)
    namespace: dict[str, Any] = {}
    exec(compile(tree, f"<vramguard patch of {fn.__qualname__}>", "exec"), fn.__globals__, namespace)
    new_code = namespace[fdef.name].__code__
    if new_code.co_freevars != fn.__code__.co_freevars:
        raise TypeError(f"{fn.__qualname__}: closures are not supported by source patches")
    return new_code, transformer.wrapped


def no_grad_around(target: str, calls: tuple[str, ...], name: str, description: str) -> Patch:
    """A patch wrapping every statement of ``target`` that calls one of ``calls`` in ``torch.no_grad()``.

    The function's ``__code__`` is swapped, so every reference to it (re-exports, bound methods,
    autograd Functions) sees the patch; the original code object is restored on exit.
    """
    names = frozenset(calls)

    def check() -> str | None:
        fn = _resolve(target)
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        if not _calls(tree, names):
            return (
                f"{target} no longer calls {' / '.join(calls)} in the installed version "
                "(the code this patch targets is gone)"
            )
        return None

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        fn = _resolve(target)
        original = fn.__code__
        new_code, wrapped = _rewritten_code(fn, names)
        if wrapped == 0:
            raise PatchNotApplicable(f"patch {name!r}: nothing to wrap in {target}")
        fn.__code__ = new_code
        try:
            yield
        finally:
            fn.__code__ = original

    return Patch(name=name, description=description, enter=enter, check=check, claims_memory_only=True)


_BNB = "bitsandbytes.autograd._functions"
_PR1935 = "bitsandbytes PR 1935: torch.no_grad() around the dequantize + F.linear call in"


def _builtin() -> list[Patch]:
    return [
        no_grad_around(
            f"{_BNB}:MatMul4Bit.forward", ("linear",), "no-grad-linear:4bit", f"{_PR1935} MatMul4Bit.forward"
        ),
        no_grad_around(
            f"{_BNB}:MatMul8bitLt.forward",
            ("linear",),
            "no-grad-linear:8bit-lt",
            f"{_PR1935} MatMul8bitLt.forward",
        ),
        no_grad_around(
            f"{_BNB}:MatMul8bitFp.forward",
            ("linear",),
            "no-grad-linear:8bit-fp",
            f"{_PR1935} MatMul8bitFp.forward",
        ),
    ]


# --- registry ------------------------------------------------------------------------------------

_REGISTRY: dict[str, Patch] = {}
_LOADED = False


def register(patch: Patch, *, replace: bool = False) -> Patch:
    """Add ``patch`` to the registry (``replace`` to overwrite a patch of the same name)."""
    if not isinstance(patch, Patch):
        raise UsageError(f"not a vramguard Patch: {patch!r}")
    if patch.name in _REGISTRY and not replace and _REGISTRY[patch.name] is not patch:
        raise UsageError(f"a patch named {patch.name!r} is already registered")
    _REGISTRY[patch.name] = patch
    return patch


def unregister(name: str) -> None:
    """Remove a patch (no error when absent): tests that register temporary patches clean up."""
    _REGISTRY.pop(name, None)


def _coerce(obj: Any, origin: str) -> Patch:
    if isinstance(obj, Patch):
        return obj
    if callable(obj):
        made = obj()
        if isinstance(made, Patch):
            return made
        raise UsageError(f"{origin} returned {type(made).__name__}, not a vramguard Patch")
    raise UsageError(f"{origin} is neither a Patch nor a callable returning one")


def load_patch(spec: str) -> Patch:
    """A user patch from ``"module:attribute"`` (a Patch, or a zero-argument callable returning one)."""
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"not a patch spec: {spec!r} (use 'package.module:function')")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot load patch {spec!r}: {exc}") from None
    return _coerce(obj, spec)


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for patch in _builtin():
        _REGISTRY.setdefault(patch.name, patch)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        register(_coerce(ep.load(), f"entry point {ep.name!r}"), replace=True)
    for spec in filter(None, (s.strip() for s in os.environ.get(ENV_VAR, "").split(","))):
        register(load_patch(spec), replace=True)


def names() -> list[str]:
    """Names of all registered patches, applicable or not, in registration order."""
    _load_all()
    return list(_REGISTRY)


def get(name: str) -> Patch:
    """The registered patch called ``name``; UsageError listing the known names otherwise."""
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(f"unknown patch {name!r}; known: {', '.join(_REGISTRY) or '(none)'}") from None


def available() -> list[Patch]:
    """The registered patches that apply to the installed library versions."""
    return [p for p in (get(n) for n in names()) if p.applies()]
