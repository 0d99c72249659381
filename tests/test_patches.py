"""The patch registry: built-ins, patches whose target is gone, user patches (spec, env, entry points),
and exact apply/restore of source patches."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vramguard.errors import UsageError
from vramguard.grad import patches

TARGET_SOURCE = textwrap.dedent(
    """
    import torch.nn.functional as F


    def uses_linear(x, w):
        y = F.linear(x, w)
        return y


    def no_linear(x, w):
        return x @ w.T


    def fails_after_linear(x, w):
        y = F.linear(x, w)
        raise ValueError("boom")


    class Layer:
        @staticmethod
        def forward(x, w):
            return F.linear(x, w)
    """
)

USER_SOURCE = textwrap.dedent(
    """
    from vramguard.grad.patches import Patch, no_grad_around

    def make():
        return no_grad_around("vg_target_mod:uses_linear", ("linear",), "user-patch", "a user's patch")

    ready = no_grad_around("vg_target_mod:no_linear", ("linear",), "ready-patch", "an instance, not a factory")

    def not_a_patch():
        return 42

    value = 7
    """
)


@pytest.fixture
def target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Importable ``vg_target_mod`` (functions to patch) and ``vg_user_patches`` (user patch specs)."""
    (tmp_path / "vg_target_mod.py").write_text(TARGET_SOURCE)
    (tmp_path / "vg_user_patches.py").write_text(USER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("vg_target_mod", "vg_user_patches"):
        sys.modules.pop(name, None)
    yield importlib.import_module("vg_target_mod")
    for name in ("vg_target_mod", "vg_user_patches"):
        sys.modules.pop(name, None)


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty, not-yet-loaded registry (restored after the test)."""
    monkeypatch.setattr(patches, "_REGISTRY", {})
    monkeypatch.setattr(patches, "_LOADED", False)
    monkeypatch.delenv(patches.ENV_VAR, raising=False)


def _xw() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)


# --- built-ins -------------------------------------------------------------------------------------


def test_builtin_patches_are_registered(fresh_registry: None) -> None:
    names = patches.names()
    for name in ("no-grad-linear:4bit", "no-grad-linear:8bit-lt", "no-grad-linear:8bit-fp"):
        assert name in names
        p = patches.get(name)
        assert p.claims_memory_only and "PR 1935" in p.description
    assert [p.name for p in patches.available()] == [n for n in names if patches.get(n).applies()]


def test_builtin_applicability_matches_the_installed_source(fresh_registry: None) -> None:
    """A built-in applies exactly when the installed function still calls ``linear``; otherwise the reason says so."""
    import ast
    import inspect

    from bitsandbytes.autograd import _functions as bnbfn

    for name, cls in [
        ("no-grad-linear:4bit", bnbfn.MatMul4Bit),
        ("no-grad-linear:8bit-lt", bnbfn.MatMul8bitLt),
        ("no-grad-linear:8bit-fp", bnbfn.MatMul8bitFp),
    ]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
        calls_linear = patches._calls(tree, frozenset({"linear"}))
        can = patches.get(name).applies()
        assert bool(can) == calls_linear, (name, can)
        if not can:
            assert "no longer calls linear" in can.reason and "gone" in can.reason


def test_get_unknown_lists_known_names(fresh_registry: None) -> None:
    with pytest.raises(UsageError, match=r"unknown patch 'nope'; known: .*no-grad-linear:8bit-fp"):
        patches.get("nope")


# --- a patch whose target code is gone ---------------------------------------------------------------


def test_patch_whose_target_is_gone_says_so(target) -> None:  # type: ignore[no-untyped-def]
    p = patches.no_grad_around("vg_target_mod:no_linear", ("linear",), "gone", "target has no linear call")
    can = p.applies()
    assert not can and can.ok is False
    assert "vg_target_mod:no_linear no longer calls linear" in can.reason and "gone" in can.reason
    pattern = r"patch 'gone' does not apply: .*no longer calls linear"
    with pytest.raises(patches.PatchNotApplicable, match=pattern), p.apply():
        pytest.fail("body must not run")


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("vg_target_mod:missing_function", "AttributeError"),
        ("vg_no_such_module_xyz:f", "ModuleNotFoundError"),
        ("vg_target_mod:Layer", "TypeError"),  # a class, not a function
    ],
)
def test_patch_with_unresolvable_target_is_not_applicable(target, spec: str, reason: str) -> None:  # type: ignore[no-untyped-def]
    p = patches.no_grad_around(spec, ("linear",), "bad-target", "d")
    can = p.applies()
    assert not can and can.reason.startswith(reason), can.reason
    with pytest.raises(patches.PatchNotApplicable, match=reason), p.apply():
        pass


# --- apply / restore ---------------------------------------------------------------------------------


def test_apply_takes_effect_and_restores_the_exact_code(target) -> None:  # type: ignore[no-untyped-def]
    fn = target.uses_linear
    code = fn.__code__
    p = patches.no_grad_around("vg_target_mod:uses_linear", ("linear",), "t", "d")
    x, w = _xw()
    assert fn(x, w).requires_grad
    with p.apply():
        assert target.uses_linear is fn and fn.__code__ is not code
        y = fn(x, w)
        assert not y.requires_grad  # the linear ran under no_grad
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w).detach(), rtol=0, atol=0)
    assert fn.__code__ is code
    assert fn(x, w).requires_grad


def test_staticmethod_target_is_patched_through_the_class(target) -> None:  # type: ignore[no-untyped-def]
    p = patches.no_grad_around("vg_target_mod:Layer.forward", ("linear",), "t", "d")
    code = target.Layer.__dict__["forward"].__func__.__code__
    x, w = _xw()
    with p.apply():
        assert not target.Layer.forward(x, w).requires_grad
    assert target.Layer.__dict__["forward"].__func__.__code__ is code
    assert target.Layer.forward(x, w).requires_grad


def test_restore_on_exception_in_body_and_in_patched_code(target) -> None:  # type: ignore[no-untyped-def]
    p = patches.no_grad_around("vg_target_mod:uses_linear", ("linear",), "t", "d")
    code = target.uses_linear.__code__
    with pytest.raises(KeyError), p.apply():
        raise KeyError("body fails")
    assert target.uses_linear.__code__ is code

    q = patches.no_grad_around("vg_target_mod:fails_after_linear", ("linear",), "t2", "d")
    code2 = target.fails_after_linear.__code__
    with pytest.raises(ValueError, match="boom"), q.apply():
        target.fails_after_linear(*_xw())
    assert target.fails_after_linear.__code__ is code2


def test_patch_check_that_raises_is_a_reason_not_a_crash() -> None:
    def check() -> str | None:
        raise ImportError("no such library")

    p = patches.Patch(name="x", description="d", enter=lambda: pytest.fail("must not enter"), check=check)  # type: ignore[arg-type,return-value]
    assert p.applies() == patches.Applicability(False, "ImportError: no such library")
    with pytest.raises(patches.PatchNotApplicable, match="ImportError: no such library"), p.apply():
        pass


# --- user patches: spec, env var, entry points, --vram-patch's register -----------------------------


def test_load_patch_factory_and_instance(target) -> None:  # type: ignore[no-untyped-def]
    made = patches.load_patch("vg_user_patches:make")
    assert isinstance(made, patches.Patch) and made.name == "user-patch" and made.applies()
    ready = patches.load_patch(" vg_user_patches:ready ")
    assert ready.name == "ready-patch" and not ready.applies()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("vg_user_patches", r"not a patch spec: 'vg_user_patches' \(use 'package.module:function'\)"),
        (":make", r"not a patch spec"),
        ("vg_user_patches:", r"not a patch spec"),
        ("vg_no_such_module_xyz:make", r"cannot load patch 'vg_no_such_module_xyz:make': No module named"),
        ("vg_user_patches:missing", r"cannot load patch 'vg_user_patches:missing': .*missing"),
        ("vg_user_patches:not_a_patch", r"vg_user_patches:not_a_patch returned int, not a vramguard Patch"),
        ("vg_user_patches:value", r"vg_user_patches:value is neither a Patch nor a callable returning one"),
    ],
)
def test_load_patch_bad_specs_give_clear_errors(target, spec: str, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match=message) as info:
        patches.load_patch(spec)
    assert "\n" not in str(info.value)


def test_env_var_patches_are_registered(
    target, fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(patches.ENV_VAR, "vg_user_patches:make, vg_user_patches:ready,")
    names = patches.names()
    assert names[-2:] == ["user-patch", "ready-patch"]
    assert "no-grad-linear:4bit" in names
    assert "user-patch" in [p.name for p in patches.available()]
    assert "ready-patch" not in [p.name for p in patches.available()]


def test_env_var_bad_spec_is_a_usage_error(
    target, fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(patches.ENV_VAR, "vg_user_patches")
    with pytest.raises(UsageError, match="not a patch spec"):
        patches.names()


def test_entry_point_group(target, fresh_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    eps = [
        importlib.metadata.EntryPoint("user", "vg_user_patches:make", patches.ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("ready", "vg_user_patches:ready", patches.ENTRY_POINT_GROUP),
    ]
    asked: list[str] = []

    def entry_points(*, group: str):  # type: ignore[no-untyped-def]
        asked.append(group)
        return eps if group == patches.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(patches.importlib.metadata, "entry_points", entry_points)
    names = patches.names()
    assert asked == ["vramguard.patches"]
    assert {"user-patch", "ready-patch"} <= set(names)


def test_entry_point_returning_garbage_names_the_entry_point(
    target, fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    eps = [importlib.metadata.EntryPoint("junk", "vg_user_patches:not_a_patch", patches.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(patches.importlib.metadata, "entry_points", lambda *, group: eps)
    with pytest.raises(UsageError, match=r"entry point 'junk' returned int, not a vramguard Patch"):
        patches.names()


def test_register_rejects_duplicates_and_non_patches(target, fresh_registry: None) -> None:  # type: ignore[no-untyped-def]
    p = patches.load_patch("vg_user_patches:make")
    assert patches.register(p) is p
    assert patches.register(p) is p  # the same object again is fine
    other = patches.load_patch("vg_user_patches:make")
    with pytest.raises(UsageError, match="a patch named 'user-patch' is already registered"):
        patches.register(other)
    assert patches.register(other, replace=True) is other and patches.get("user-patch") is other
    with pytest.raises(UsageError, match="not a vramguard Patch"):
        patches.register("user-patch")  # type: ignore[arg-type]
    patches.unregister("user-patch")
    patches.unregister("user-patch")  # absent: no error
    assert "user-patch" not in patches.names()
