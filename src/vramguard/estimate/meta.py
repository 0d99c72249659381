"""A QLoRA model on the meta device: the libraries' own modules, shapes and dtypes, no weights.

:func:`build_meta` follows :func:`vramguard.workload.models.build_qlora` step for step, with the one
difference that no checkpoint is written and loaded:

* the transformers model is instantiated on ``meta`` (``_from_config`` at the compute dtype, what
  ``from_pretrained(dtype=...)`` gives every parameter);
* transformers' own bitsandbytes quantizer (``AutoHfQuantizer`` from the same ``BitsAndBytesConfig``)
  swaps the linear layers for ``bnb.nn.Linear4bit`` (``preprocess_model``, as ``from_pretrained``
  does before loading), and each weight is quantized by ``Params4bit._quantize`` on meta, which
  is what transformers' ``Bnb4bitQuantize`` reaches through ``Params4bit(...).to(device)`` on a
  real device (``Params4bit.to`` skips meta, so it is called directly): packed nibbles, absmax and
  the double-quantization state get their real shapes and dtypes;
* ``postprocess_model`` marks the model 4-bit, then PEFT's ``prepare_model_for_kbit_training`` and
  ``get_peft_model`` run unchanged (with DoRA, PEFT deep-copies each ``Linear4bit``, which bitsandbytes
  cannot do for a meta weight: :func:`_deepcopy_on_meta`; its dequantization, ``bitsandbytes::dequantize_4bit``,
  has bitsandbytes' own fake kernel, which meta runs).

On meta every data-dependent branch (``.item()``, ``bool(tensor)``) raises. transformers 5.x takes
one such branch per forward: ``masking_utils.find_packed_sequence_indices`` asks whether the
position ids hold several packed sequences. :func:`forced_decisions` answers it as the real run
does (synthetic batches have ``position_ids = arange(seq)``: one sequence per row, no packing, no
padding mask), while still running the function's own ops, so the temporaries are the same.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakTensorKeyDictionary

from vramguard.errors import UsageError
from vramguard.estimate.autocast import autocast_off
from vramguard.estimate.meta_kernels import STEP_KERNELS, meta_kernels
from vramguard.estimate.no_init import values_not_drawn
from vramguard.measure.storage import tensor_leaves
from vramguard.model.layers import sdpa_kernel
from vramguard.step.patching import patch_all, patched
from vramguard.step.request import META, TARGETS
from vramguard.workload.models import (
    BUILD_ERRORS,
    METHODS,
    ModelSpec,
    QLoRAConfig,
    QLoRAModel,
    bnb_4bit_config,
    build_error,
    padding_free_batch,
    parse_dtype,
    prepare_for_training,
    refuse_kernel_experts,
    resolve_attention,
    routing_line,
    weights_line,
    with_lora,
)
from vramguard.workload.routing import Routing

class _AnswerScalars(TorchDispatchMode):
    """Answers ``_local_scalar_dense`` (``.item()``, ``bool()``) of a meta tensor with ``answer``."""

    def __init__(self, answer: bool) -> None:
        super().__init__()
        self.answer = answer
        self.answered = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == META:
            self.answered += 1
            return self.answer
        return func(*args, **(kwargs or {}))


class ShapeCache(TorchDispatchMode):
    """The meta results of pointwise ops (``torch.Tag.pointwise``: ``mul``, ``add``, ``addcdiv_``, ``silu``,
    ...) and of every op whose schema writes and aliases nothing (``mm``, ``mean``, ``cat``,
    ``native_layer_norm``, bitsandbytes' ``gemm_4bit``) answered from the first result of the same op on the
    same metadata.

    torch registers its Python references (``torch._refs``, ``torch._prims``) as the meta kernels of the
    pointwise ops: about 120 us an op, against 2 us for the same op on a small CPU tensor and 15 us for a meta
    ``mm``, and most of a meta step (a 1B-shaped QLoRA step: 1.92 s, 1.33 s with this cache; 3,900 of its
    3,967 pointwise ops repeat one already seen). A meta kernel reads only metadata, so the output of a
    pointwise op is fixed by the op, its tensors' shapes, strides, dtypes and devices, and its other
    arguments, of which a float (or complex) scalar's type alone decides anything (type promotion), and
    torch's default dtype (an int tensor's ``sqrt``): the key holds exactly these. A repeat gets a new meta
    tensor of the first result's shape, strides and dtype (``empty_strided``, the storage the kernel makes),
    or, for an in-place op, its own first argument, as the kernel returns it.

    The foreach ops of pointwise ops (``_foreach_sqrt``, ``_foreach_addcdiv_``: CUDA's AdamW step on meta)
    are answered the same way, a list of results or, for one that writes its first list, nothing (what the
    kernel returns). ``answers``: where the first results are kept; the meta step passes the process's
    (:data:`PROCESS_ANSWERS`), so a second estimate in a process (``--fit``'s, the cheaper changes') answers
    what the first one computed; None: a cache of its own.

    Entered below every other mode of the meta step (first), so the tracker and the other modes see each
    result as the kernel's. ``native_dropout`` (:data:`SEVERAL_FRESH`) is answered the same way, a tuple of new
    results, and ``linalg_vector_norm`` (:data:`ONE_FRESH`) as a pointwise op. Anything else passes through:
    an op that writes or aliases an argument but a pointwise one's first (an ``out=``, a view), tensor
    subclasses (FSDP2's DTensors), real tensors other than a pointwise op's 0-d ones, an in-place op on a real
    tensor (Adam's step counter on the host counts), an in-place op that resized what it wrote, and a first
    result that is no fresh meta tensor.

    The other ops (kinds 6 and 7 of :meth:`_kind`): their Python meta kernels cost as much (``native_layer_norm``
    about 1.2 ms a call, ``mean`` 0.3 ms, bitsandbytes' ``gemm_4bit`` 0.1 ms) and read no more than metadata,
    but a float may decide a shape there (``interpolate``'s scale factor) and a host tensor's value too
    (``index`` by a host boolean mask): their keys hold every scalar by value, and a real tensor is not keyed.
    A first result that shares an input's storage (``_unsafe_view``, whose schema says nothing of it) or whose
    storage is not exactly its extent leaves that key to the kernel; the ops whose Meta kernel the step itself
    registers (:data:`~vramguard.estimate.meta_kernels.STEP_KERNELS`: they count what they answer) are never
    cached."""

    def __init__(self, answers: dict[tuple[Any, ...], Any] | None = None) -> None:
        super().__init__()
        self._shapes: dict[tuple[Any, ...], Any] = {} if answers is None else answers
        self.hits = 0
        self.misses = 0

    def _kind(self, func: Any) -> int:
        """0: not cached; 1: a pointwise op with a new result; 2: one that writes its first argument; 3: a
        foreach op of a pointwise op (``_foreach_sqrt``) with a new list of results; 4: one that writes its
        first list (``_foreach_lerp_``, which returns nothing); 5: one of :data:`SEVERAL_FRESH` (a tuple of
        new results); 6 and 7: any other op whose schema neither writes nor aliases anything, of one tensor
        result (6: ``mm``, ``mean``, ``cat``, bitsandbytes' ``gemm_4bit``) or several (7: ``native_layer_norm``),
        all of whose arguments are keyed by value (:func:`_exact_key`)."""
        kind = _KINDS.get(func)
        if kind is None:
            kind = 5 if func in SEVERAL_FRESH else 1 if func in ONE_FRESH else 0
            schema = func._schema
            written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            out = any(a.name == "out" for a in schema.arguments)
            writes_first = bool(written) and written == schema.arguments[:1] and not out
            if torch.Tag.pointwise in func.tags and len(schema.returns) == 1:
                if not written:
                    kind = 1
                elif writes_first:
                    kind = 2
            elif _foreach_of_pointwise(schema.name):
                if not written and [str(r.type) for r in schema.returns] == ["List[Tensor]"]:
                    kind = 3
                elif writes_first and not schema.returns:
                    kind = 4
            elif kind == 0 and _fresh_by_schema(func):
                kind = 6 if len(schema.returns) == 1 else 7
            _KINDS[func] = kind
        return kind

    def _key(self, func: Any, args: Any, kwargs: dict[str, Any], exact: bool = False) -> tuple[Any, ...] | None:
        key: list[Any] = [func, torch.get_default_dtype()]  # an int tensor's sqrt is of the default dtype
        keyed = _exact_key if exact else _value_key
        for name, value in (*((None, a) for a in args), *kwargs.items()):
            key.append(name)
            if type(value) is list or type(value) is tuple:  # a foreach op's tensors or scalars
                items = [keyed(v) for v in value]
                if _UNKEYED in items:
                    return None
                key.append((type(value), tuple(items)))
                continue
            item = keyed(value)
            if item is _UNKEYED:
                return None
            key.append(item)
        return tuple(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = self._kind(func)
        if kind == 2 and not (type(args[0]) is torch.Tensor and args[0].device.type == META):
            kind = 0  # written values are real off meta (Adam's step counter on the host): the kernel runs
        if kind == 4 and not all(isinstance(t, torch.Tensor) and t.device.type == META for t in args[0]):
            kind = 0  # the same for a foreach op (Adam's step counters on the host, one a parameter)
        key = self._key(func, args, kwargs, exact=kind >= 6) if kind else None
        if key is None:
            return func(*args, **kwargs)
        known = self._shapes.get(key)
        if known is None:
            self.misses += 1
            written = args[0] if kind == 4 else [args[0]] if kind == 2 else []
            before = [(t.shape, t.stride(), t.dtype) for t in written]
            out = func(*args, **kwargs)
            # an in-place op that resized what it wrote (``clamp_min_`` of a 0-d tensor by a (3, 4) one, the
            # foreach ``maximum_``'s broadcast) is left to its kernel every time: a repeat must change it too
            if [(t.shape, t.stride(), t.dtype) for t in written] == before:
                self._remember(kind, key, args, out)
            return out
        if known is _KERNEL:  # a first result the cache cannot make (one sharing an input's storage)
            return func(*args, **kwargs)
        self.hits += 1
        if kind == 2:
            return args[0]
        if kind == 4:
            return None
        if kind == 3 or kind == 5 or kind == 7:
            made = [torch.empty_strided(shape, stride, dtype=dtype, device=META) for shape, stride, dtype in known]
            return made if kind == 3 else tuple(made)
        shape, stride, dtype = known
        return torch.empty_strided(shape, stride, dtype=dtype, device=META)

    def _remember(self, kind: int, key: tuple[Any, ...], args: Any, out: Any) -> None:
        """Keep the kernel's answer of a first call under ``key``, where a repeat can be answered as it."""
        if kind == 1 and _fresh(out):
            self._shapes[key] = (out.shape, out.stride(), out.dtype)
        elif kind == 2 and out is args[0]:
            self._shapes[key] = (out.shape, out.stride(), out.dtype)
        elif kind == 3 and type(out) is list and all(_fresh(t) for t in out):
            self._shapes[key] = tuple((t.shape, t.stride(), t.dtype) for t in out)
        elif kind == 4 and out is None:
            self._shapes[key] = ()
        elif kind == 5 and type(out) is tuple and all(_fresh(t) for t in out) and _apart(out):
            self._shapes[key] = tuple((t.shape, t.stride(), t.dtype) for t in out)
        elif kind >= 6:
            outs = (out,) if kind == 6 else out
            inputs = {t.untyped_storage()._cdata for t in tensor_leaves(args) if t.device.type == META}
            own = (kind == 6 or type(out) is tuple) and all(_fresh_whole(t, inputs) for t in outs)
            if own and _apart(outs):
                made = tuple((t.shape, t.stride(), t.dtype) for t in outs)
                self._shapes[key] = made[0] if kind == 6 else made
            else:
                self._shapes[key] = _KERNEL  # the kernel answers every call with this key


SEVERAL_FRESH = frozenset({torch.ops.aten.native_dropout.default})
"""Ops of several results whose meta kernel reads only metadata, each result a new tensor of its own:
``native_dropout`` (CUDA's dropout on meta, :func:`_dropout_as_on`: the output and its bool mask), whose meta
kernel is torch's Python decomposition (``rand_like``, a compare, two multiplies: about 4 ms a call, the
largest single cost of an 8B step with LoRA dropout, 3,584 calls). Its ``p`` is a float: its type is in the
key, its value decides no shape."""


ONE_FRESH = frozenset({torch.ops.aten.linalg_vector_norm.default})
"""Ops of one new result, not tagged pointwise, whose meta kernel reads only metadata and the arguments the key
holds by value: ``linalg_vector_norm`` (``clip_grad_norm_``'s norm of each gradient, Trainer's ``max_grad_norm``:
a Python reference as its meta kernel, ~1.6 ms a call, one per trainable tensor a step); its ``dim``, ``keepdim``
and ``dtype`` are keyed by value, its float ``ord`` by type (no order changes the result's shape or dtype)."""


def _apart(out: tuple[torch.Tensor, ...]) -> bool:
    """Whether each result has a storage of its own (none a view of another's)."""
    return len({t.untyped_storage()._cdata for t in out}) == len(out)


PROCESS_ANSWERS: dict[tuple[Any, ...], Any] = {}
"""The meta step's :class:`ShapeCache` answers, kept for the process: a key holds everything a meta
kernel's result depends on (torch's default dtype included), so an answer holds for any later step."""

_KINDS: dict[Any, int] = {}
""":meth:`ShapeCache._kind` of each op seen (a function of the op's schema and tags alone)."""

_UNKEYED = object()
""":func:`_value_key` of an argument the cache cannot key (the op then runs its kernel)."""


def _value_key(value: Any) -> Any:
    """What a pointwise op's key holds of one argument: a tensor's metadata (a meta tensor, or a real one of
    0 dimensions), a float's or complex's type, another scalar's value; :data:`_UNKEYED` for anything else
    (a real tensor with dimensions, a tensor subclass, which its own dispatch decides, another layout)."""
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if value.layout is not torch.strided:
            return _UNKEYED
        if value.is_meta:  # (a real 0-d tensor's key names its device: a longer tuple)
            return (value.shape, value.stride(), value.dtype)
        if value.dim():
            return _UNKEYED
        return (value.shape, value.stride(), value.dtype, value.device)
    if isinstance(value, torch.Tensor):
        return _UNKEYED
    if type(value) in (float, complex):
        return type(value)
    if value is None or type(value) in _KEYED_BY_VALUE:
        return (type(value), value)
    return _UNKEYED


def _exact_key(value: Any) -> Any:
    """What the key of an op of kind 6 or 7 (:meth:`ShapeCache._kind`) holds of one argument: a meta
    tensor's metadata, any scalar by value (a float may decide a shape there: ``upsample``'s scale factors),
    :data:`_UNKEYED` for a real tensor (a host tensor's value may decide a shape: ``index`` by a host boolean
    mask) and anything else."""
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if not value.is_meta or value.layout is not torch.strided:
            return _UNKEYED
        return (value.shape, value.stride(), value.dtype)
    if kind is float or kind is complex:
        return (kind, value)
    return _value_key(value)


def _fresh_by_schema(func: Any) -> bool:
    """Whether ``func``'s schema says its results are new tensors: no argument written or aliased, no
    ``out=``, every return a plain ``Tensor`` with no alias; not an op whose Meta kernel the step registers
    (:mod:`vramguard.estimate.meta_kernels`: their kernels count what they answer)."""
    schema = func._schema
    if func.__name__.split(".")[0] in STEP_KERNELS or not schema.returns:
        return False
    if any(a.alias_info is not None for a in schema.arguments):  # (an out= argument is written: it has one)
        return False
    return all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)


_KERNEL = object()
"""What the cache keeps under a key whose first result it cannot make: the kernel answers every call."""


def _fresh_whole(out: Any, inputs: set[int]) -> bool:
    """Whether ``out`` is a new meta tensor whose storage is none of ``inputs`` and exactly what
    ``empty_strided`` of its shape and strides allocates (``_unsafe_view`` shares its input's storage with no
    alias in its schema)."""
    if not _fresh(out) or out.untyped_storage()._cdata in inputs:
        return False
    extent = 1 + sum((n - 1) * s for n, s in zip(out.shape, out.stride(), strict=True)) if out.numel() else 0
    return out.untyped_storage().nbytes() == extent * out.element_size()


def _fresh(out: Any) -> bool:
    """Whether a kernel's result is a new meta tensor of its own (no view into another's storage)."""
    return type(out) is torch.Tensor and out.device.type == META and out.storage_offset() == 0


@functools.lru_cache(maxsize=None)
def _foreach_of_pointwise(name: str) -> bool:
    """Whether the op named ``name`` (``aten::_foreach_sqrt``, ``aten::_foreach_addcdiv_``) applies a
    pointwise op (``sqrt``, ``addcdiv``: one tagged ``torch.Tag.pointwise``) to each tensor of its lists: its
    meta results are each that op's, fixed by the metadata alone (``_foreach_norm`` reduces: not one)."""
    prefix = "aten::_foreach_"
    if not name.startswith(prefix):
        return False
    packet = getattr(torch.ops.aten, name[len(prefix) :].rstrip("_"), None)
    if packet is None:
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


#: the non-tensor arguments a pointwise op's key holds by value (a float's or complex's type is enough)
_KEYED_BY_VALUE = (bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


@contextlib.contextmanager
def forced_decisions(
    target: str = "cpu", one_sequence_per_row: bool = True, autocast: bool = False
) -> Iterator[dict[str, int]]:
    """The step-level decisions of a meta run for ``target`` (:func:`target_decisions`) with the rows' answer
    ``one_sequence_per_row`` (:func:`rows_answered`) and, with ``autocast`` (Trainer's mixed precision),
    ``target``'s autocast (:func:`target_autocast`), in one block: what the bf16 and padding-free techniques'
    contexts put on a step (:mod:`vramguard.estimate.techniques`), for a caller that runs its own step (the
    vision step, the tests). Yields the decisions' counter; with ``autocast`` the autocast's counts
    (``autocast_routed``, ``autocast_unprobed``) are written into it when the block ends."""
    taken: dict[str, int] = {}
    routed: dict[str, int] = {}
    try:
        with rows_answered(one_sequence_per_row), target_decisions(target) as taken:
            if not autocast:
                yield taken
            else:
                with target_autocast(target) as routed:
                    yield taken
    finally:
        taken.update(routed)  # after the decisions' own counts (grouped_mm), as the meta step lists them


class _Rows:
    """What the meta run answers when transformers asks whether each row of the batch holds one sequence
    (:attr:`one_sequence`; its real position ids hold the answer, meta has none): ``find_packed_sequence_indices``
    (:func:`target_decisions`) and FlashAttention-2's ``_is_packed_sequence``
    (:func:`vramguard.estimate.flash.flash_attention_2`) read it when asked."""

    one_sequence = True
    """The synthetic rows' answer (no position ids are passed: one sequence per row); a padding-free batch's
    is what its boundaries say (:func:`rows_answered`, the padding-free technique's context)."""


ROWS = _Rows()
"""The meta run's answer on the rows of the batch (:class:`_Rows`)."""


@contextlib.contextmanager
def rows_answered(one_sequence_per_row: bool) -> Iterator[None]:
    """Within the block, the meta run answers that each row holds one sequence (``one_sequence_per_row``) or
    several (a padding-free batch whose real position ids restart within a row:
    :attr:`MetaQLoRAModel.one_sequence_per_row`); :data:`ROWS` patched through the one helper. Yields nothing
    (it counts nothing: the decisions count the questions)."""
    with patched(ROWS, "one_sequence", one_sequence_per_row):
        yield


@contextlib.contextmanager
def target_decisions(target: str = "cpu") -> Iterator[Decisions]:
    """Within the block, the meta step's data-dependent and device-dependent decisions are taken as on
    ``target``, whatever techniques the step uses: ``find_packed_sequence_indices`` on meta position ids decides
    as it does for the batch on a real device (:data:`ROWS`' answer): "one sequence per row" (returns None) for
    the synthetic rows, or, for a padding-free batch whose real position ids hold several sequences in a row,
    "packed" (returns the sequence indices, their shape and dtype as on the device, so the packed-sequence mask
    is built); attention and dropout on meta take the kernels ``target`` would (:func:`_sdpa_as_on`; on CUDA
    dropout is ``native_dropout``, which keeps a bool mask, where the CPU multiplies by a mask in the input's
    dtype).

    ``torch.autocast`` (and ``torch.amp.autocast``) takes a meta device type as the CPU's, enabling nothing
    itself; Trainer's mixed precision is the bf16 technique's context (:func:`target_autocast`), entered inside
    this block.

    torch's optimizers pick their implementation by the parameters' device (``foreach`` where the device has
    foreach kernels, ``fused=True`` checked against the devices with fused kernels); on meta they pick as on
    ``target``: CUDA's foreach AdamW (a temporary as large as the parameters in the step) where the CPU runs the
    single-tensor loop, and the fused kernel (meta has its shape rules) on either.

    Yields a counter of the decisions taken (:class:`Decisions`), so a caller can check the branch was reached.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    from torch.optim import optimizer as torch_optimizer
    from transformers import masking_utils

    functional = torch.nn.functional
    meta_autocast = _meta_autocast("cpu")
    grouped = _GroupedMmAnyDtype()
    taken = Decisions(grouped)
    packed = _packed_answer(masking_utils.find_packed_sequence_indices, taken)
    patches = [
        (masking_utils, "find_packed_sequence_indices", packed),
        (functional, "scaled_dot_product_attention", _meta_sdpa(target, taken)),
        (functional, "dropout", _dropout_as_on(target, functional.dropout)),
        (torch, "autocast", meta_autocast),
        (torch.amp, "autocast", meta_autocast),
        # the optimizers' implementation: torch.optim.optimizer asks these two
        (torch_optimizer, "_get_foreach_kernels_supported_devices", _foreach_devices(target)),
        (torch_optimizer, "_get_fused_kernels_supported_devices", _fused_devices),
    ]
    shapes = ShapeCache(PROCESS_ANSWERS)
    norms = _LayerNormStatsAsOnCpu() if target == "cpu" else contextlib.nullcontext()
    try:
        with contextlib.ExitStack() as stack:
            patch_all(stack, patches)
            # the cache first: below every mode the step pushes (it answers as the kernels)
            with meta_kernels({"_grouped_mm": grouped}), shapes, norms:
                yield taken
    finally:
        taken["grouped_mm"] = grouped.answered


@contextlib.contextmanager
def target_autocast(target: str) -> Iterator[Autocasted]:
    """Within the block (inside :func:`target_decisions`), ``torch.autocast`` (and ``torch.amp.autocast``) on
    a meta device type is ``target``'s autocast: its regions run under
    :class:`~vramguard.estimate.autocast.TargetAutocast`, which applies ``target``'s real autocast policy to the
    meta step, sdpa's inputs are cast as ``target``'s autocast casts them before its kernel is chosen, and a
    checkpointed block's device is ``target`` (so its recomputation restores ``target``'s autocast state, as a
    real device's run does). The bf16 technique's context (:mod:`vramguard.estimate.techniques.autocast`).

    Yields its counter (:class:`Autocasted`): the functions routed through the target's autocast
    (``autocast_routed``) and those it could not probe (``autocast_unprobed``), written when the block ends."""
    from torch.utils import checkpoint

    functional = torch.nn.functional
    routing = _routing(target)
    meta_autocast = _meta_autocast(target)
    meta_autocast.routing = routing  # type: ignore[attr-defined]
    routed = Autocasted(routing)
    sdpa = _autocast_sdpa(target, routing, functional.scaled_dot_product_attention)  # the decisions' (outside)
    patches = [
        (torch, "autocast", meta_autocast),
        (torch.amp, "autocast", meta_autocast),
        (functional, "scaled_dot_product_attention", sdpa),
        # a checkpointed block's device is the target's (its recomputation restores that autocast)
        (checkpoint, "_infer_device_type", _infer_as(target, checkpoint._infer_device_type)),
    ]
    try:
        with contextlib.ExitStack() as stack:
            patch_all(stack, patches)
            yield routed
    finally:
        routed["autocast_routed"] = routing.routed
        routed["autocast_unprobed"] = len(routing.unprobed)


_NATIVE_LAYER_NORM = torch.ops.aten.native_layer_norm.default


class _LayerNormStatsAsOnCpu(TorchDispatchMode):
    """``native_layer_norm`` on meta as the CPU runs it: its mean and rstd (which autograd saves) in the input's
    dtype where the input is bf16 or fp16 and its weight and bias are too (or absent), as torch's CPU kernel makes
    them (``param_scalar_type``: fp32 only for a mixed-type call); the meta kernel, CUDA's rule, makes them fp32
    always. A LayerNorm left in bf16 (a vision tower's with ``--method lora``: no k-bit preparation upcasts it)
    saved twice the CPU's bytes for its statistics on meta. Entered for the ``cpu`` target only."""

    LOW = (torch.bfloat16, torch.float16)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is not _NATIVE_LAYER_NORM:
            return out
        x, params = args[0], args[2:4]
        if x.device.type != META or x.dtype not in self.LOW:
            return out
        if any(p is not None and p.dtype != x.dtype for p in params):
            return out  # mixed: fp32 statistics on the CPU too
        stats = (torch.empty_strided(s.shape, s.stride(), dtype=x.dtype, device=META) for s in out[1:])
        return (out[0], *stats)


class Decisions(dict):  # type: ignore[type-arg]
    """:func:`target_decisions`' counter of the decisions taken (``find_packed_sequence_indices``,
    ``scaled_dot_product_attention``), with the count its ``_grouped_mm`` kernel keeps (``grouped_mm``) written in
    when the block ends. :meth:`counts` reads them all now and :meth:`add` adds to each: a step that prices
    repeated micro-batches from one (:class:`vramguard.workload.training.Repeats`) counts theirs."""

    def __init__(self, grouped: Any) -> None:
        super().__init__(find_packed_sequence_indices=0, scaled_dot_product_attention=0)
        self._grouped = grouped

    def counts(self) -> dict[str, int]:
        """Every count as it stands now."""
        return {**self, "grouped_mm": self._grouped.answered}

    def add(self, more: dict[str, int]) -> None:
        """Add ``more`` (counts by :meth:`counts`' names) to each count."""
        for name, n in more.items():
            if name == "grouped_mm":
                self._grouped.answered += n
            else:
                self[name] += n


class Autocasted(dict):  # type: ignore[type-arg]
    """:func:`target_autocast`'s counter: ``autocast_routed`` and ``autocast_unprobed`` (0 until the block ends,
    when they are written in); :meth:`counts` and :meth:`add` as :class:`Decisions`' (a repeated micro-batch's
    routed functions)."""

    def __init__(self, routing: Any) -> None:
        super().__init__(autocast_routed=0, autocast_unprobed=0)  # a counter from the start, not one that saw nothing
        self._routing = routing

    def counts(self) -> dict[str, int]:
        """The functions routed so far."""
        return {"autocast_routed": self._routing.routed}

    def add(self, more: dict[str, int]) -> None:
        """Add ``more`` (by :meth:`counts`' names) to the count."""
        self._routing.routed += more.get("autocast_routed", 0)


def _packed_answer(original: Any, taken: dict[str, int]) -> Any:
    """transformers' ``find_packed_sequence_indices`` on meta position ids, answered as the real ones answer
    (:data:`ROWS`; counted in ``taken``); other devices' run unchanged."""

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if position_ids.device.type != META:
            return original(position_ids)
        # the real ops run (same temporaries); only the `(mask[:, -1] == 0).all()` test is answered, with
        # what the real position ids answer: every row one sequence (no packed-sequence mask), or not
        with _AnswerScalars(ROWS.one_sequence):
            result = original(position_ids)
        taken["find_packed_sequence_indices"] += 1
        return result

    return find_packed_sequence_indices


def _meta_sdpa(target: str, taken: dict[str, int]) -> Any:
    """torch's ``scaled_dot_product_attention`` on meta tensors through ``target``'s kernel (:func:`_sdpa_as_on`;
    counted in ``taken``)."""
    original_sdpa = torch.nn.functional.scaled_dot_product_attention

    def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if query.device.type != META:
            return original_sdpa(query, key, value, *args, **kwargs)
        taken["scaled_dot_product_attention"] += 1
        return _sdpa_as_on((target, original_sdpa), query, key, value, *args, **kwargs)

    return scaled_dot_product_attention


def _autocast_sdpa(target: str, routing: Any, sdpa: Any) -> Any:
    """``sdpa`` (:func:`_meta_sdpa`'s) with its meta inputs cast as ``target``'s autocast would under the
    ``routing`` mode (:class:`~vramguard.estimate.autocast.TargetAutocast`) while it is enabled: autocast casts
    the inputs as the target's sdpa kernel would get them, then the kernel runs with autocast off (the autocast
    kernel's redispatch), so its choice sees the cast dtypes."""

    def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if query.device.type != META or not torch.is_autocast_enabled(target):
            return sdpa(query, key, value, *args, **kwargs)
        # probed on fake aliases (their device is the target's: ``sdpa`` hands them to torch's own)
        (query, key, value, *args), kwargs = routing.autocast_inputs(sdpa, (query, key, value, *args), kwargs)
        with autocast_off(target):
            return sdpa(query, key, value, *args, **kwargs)

    return scaled_dot_product_attention


def _dropout_as_on(target: str, original_dropout: Any) -> Any:
    """torch's ``dropout`` on meta as ``target`` runs it: on CUDA ``native_dropout`` (a bool mask kept), where
    the CPU multiplies by a mask in the input's dtype."""

    def dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if input.device.type != META or target != "cuda" or not training or p == 0.0:
            return original_dropout(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    return dropout


def _infer_as(target: str, original_infer: Any) -> Any:
    """``torch.utils.checkpoint._infer_device_type`` answering ``target`` for meta tensors."""

    def _infer_device_type(*args: Any) -> str:
        found = original_infer(*args)
        return target if found == META else found

    return _infer_device_type


def _foreach_devices(target: str) -> Any:
    """The devices with foreach kernels as torch's optimizers ask them, meta among them on ``target`` cuda
    (torch.utils._foreach_utils' own list, read there again, so a block inside another one answers for its own
    target)."""
    from torch.utils import _foreach_utils

    def foreach_devices() -> list[str]:
        devices = _foreach_utils._get_foreach_kernels_supported_devices()
        return [*devices, META] if target == "cuda" else devices

    return foreach_devices


def _fused_devices() -> list[str]:
    """The devices with fused optimizer kernels, meta among them (meta has the fused kernel's shape rules)."""
    from torch.utils import _foreach_utils

    return [*_foreach_utils._get_fused_kernels_supported_devices(), META]


def _function_modes() -> list[Any]:
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


def _routing(target: str) -> Any:
    from vramguard.estimate.autocast import TargetAutocast

    return TargetAutocast(target)


def _meta_autocast(target: str) -> type:
    """``torch.autocast`` for the block of :func:`forced_decisions`: device type ``meta`` is ``target``'s,
    and CUDA's autocast state is set (TLS) where torch's own class disables itself for want of a GPU. With a
    ``routing`` mode (:class:`~vramguard.estimate.autocast.TargetAutocast`), an enabled region turns it on,
    and the outermost region's exit clears its cast cache, as autocast's own."""

    class _TargetDeviceAutocast(_MetaAutocast):
        routing: Any = None  # the TargetAutocast mode of the block (Trainer's mixed precision), or None
        depth = 0

        def __init__(
            self, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None
        ) -> None:
            device = target if device_type == META else device_type
            if device == "cuda" and not torch.cuda.is_available():
                super().__init__("cpu", enabled=enabled, cache_enabled=cache_enabled)
                self.device = "cuda"
                self.fast_dtype = dtype if dtype is not None else torch.get_autocast_dtype("cuda")
            else:
                super().__init__(device, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            self.pushed = False

        def __enter__(self) -> Any:
            out = super().__enter__()
            cls = type(self)
            cls.depth += 1
            routing = cls.routing
            # the routing mode is on over every region where the target's autocast is (Trainer's forward,
            # a checkpointed block's recomputation in backward, which restores the forward's state)
            if routing is not None and self._enabled and routing not in _function_modes():
                routing.__enter__()
                self.pushed = True
            return out

        def __exit__(self, *exc: object) -> Any:
            cls = type(self)
            if self.pushed:
                cls.routing.__exit__(None, None, None)
                self.pushed = False
            out = super().__exit__(*exc)
            cls.depth -= 1
            if cls.depth == 0 and cls.routing is not None:
                cls.routing.region_exited()  # autocast drops its cast cache here
            return out

    return _TargetDeviceAutocast


class _MetaAutocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast`` that takes ``device_type="meta"`` as the CPU's: PEFT's expert-parameter LoRA
    (``_LoraFactorsProxy``) disables autocast on its weight's device, which torch cannot look up for meta.
    Only the device type is changed; what the block enables or disables is the caller's."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        super().__init__("cpu" if device_type == META else device_type, *args, **kwargs)  # type: ignore[arg-type]


class _GroupedMmAnyDtype:
    """``aten._grouped_mm`` on meta tensors of any dtype, as the CPU kernel takes them: the op's Meta kernel over
    the step (:func:`vramguard.estimate.meta_kernels.meta_kernels`; torch's own before and after it).

    transformers 5.x runs mixture-of-experts layers through ``torch.nn.functional.grouped_mm`` (its
    ``grouped_mm`` experts implementation, the default). After ``prepare_model_for_kbit_training`` the
    unquantized expert weights are fp32, which the CPU kernel multiplies, but torch's meta kernel follows
    the CUDA fast path's check ("Expected inputs of BF16 type"). The output is made by the meta kernel's
    own shape rule (``_create_grouped_mm_output_tensor``: shape, strides, dtype), skipping only that check
    (``answered`` counts them); bf16 inputs get torch's meta kernel itself. Autograd, above the dispatch modes
    and this kernel, saves what its formula saves."""

    def __init__(self) -> None:
        self.answered = 0

    def __call__(
        self, a: torch.Tensor, b: torch.Tensor, offs: Any = None, bias: Any = None, out_dtype: Any = None
    ) -> torch.Tensor:
        from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

        if a.dtype == b.dtype == torch.bfloat16:
            return meta_grouped_mm(a, b, offs, bias, out_dtype)  # type: ignore[no-any-return]
        self.answered += 1
        return _create_grouped_mm_output_tensor(a, b, offs, out_dtype)  # type: ignore[no-any-return]


class _RoutedValues(TorchDispatchMode):
    """The values of a mixture of experts' routing tensors, carried beside their meta tensors.

    A routing forced on meta (:func:`routed_on_meta`) hands the experts modules a meta ``top_k_index`` whose
    host value is known. Every op whose meta inputs all have values runs twice: on meta (its storage, views and
    all, as the tracker counts it) and on the host values (its output's value). The eager experts' loop then
    takes its data-dependent steps as the real device does: ``nonzero`` (``torch.where``, the experts hit) gets
    the host result's shape, ``.item()`` (the loop's tests, a 0-d index) the host value. While an experts
    module's forward runs (:attr:`inside`), integer and bool tensors made from nothing (``one_hot``'s zeros) get
    host values too. An op that writes a valued tensor with inputs of unknown value drops its value; a
    data-dependent op on an unknown value still raises, as meta does without this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.values: Any = _Valued()
        self.inside = 0
        self.answered = 0
        self.given_bytes = 0  # the largest storage given a value (the batch's pixels)

    def give(self, host: torch.Tensor) -> torch.Tensor:
        """A meta tensor with ``host``'s shape, strides and dtype, whose value is ``host``."""
        t = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=META)
        self.values[t] = host
        self.given_bytes = max(self.given_bytes, host.untyped_storage().nbytes())
        return t

    def give_as_made(self, host: torch.Tensor) -> torch.Tensor:
        """:meth:`give` of a data-dependent op's host result, its meta storage as large as the storage the host
        kernel allocated: ``unique_consecutive`` allocates its input's length and shrinks the tensor, not the
        storage, so the CPU holds those bytes (Qwen2.5-VL's window lengths of an image whose merged grid is not
        a whole number of windows: 12 bytes held, 8 used)."""
        size = host.untyped_storage().nbytes()
        if size <= host.numel() * host.element_size() or host.element_size() == 0:
            return self.give(host)
        whole = torch.empty(size // host.element_size(), dtype=host.dtype, device=META)
        t = whole.as_strided(host.shape, host.stride(), host.storage_offset())
        self.values[t] = host
        return t

    def limit(self) -> int:
        """The largest new storage a valued op's result gets a value for: :data:`VALUED_BYTES`, or the largest
        tensor given a value if larger. What is made from the batch's own tensors elementwise is no larger
        than they are (Idefics3 and SmolVLM find their real images from the pixels,
        ``(pixel_values == 0.0).sum(...)`` of a bf16 copy, then index with them: 17 tiles of 364x364 a row, the
        copy of 2 rows is 27 MB)."""
        return max(VALUED_BYTES, self.given_bytes)

    def enter_experts(self, entering: bool) -> None:
        self.inside += 1 if entering else -1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_flatten, tree_map

        kwargs = kwargs or {}
        metas = [t for t in tensor_leaves((args, kwargs)) if t.device.type == META]
        valued = [t for t in metas if t in self.values]
        if not valued:
            out = func(*args, **kwargs)
            made = self.inside and not metas and isinstance(out, torch.Tensor) and out.device.type == META
            integral = made and not (out.dtype.is_floating_point or out.dtype.is_complex)
            if integral and not _too_large(out, frozenset(), self.limit()):
                with _disable_current_modes():  # a factory's int/bool
                    self.values[out] = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return out
        if len(valued) < len(metas):  # values meet unknown values: no value comes out, a written one is lost
            for t in _written(func, args, kwargs):
                self.values.pop(t, None)
            return func(*args, **kwargs)

        def to_host(t: Any) -> Any:
            return self.values[t] if isinstance(t, torch.Tensor) and t in self.values else t

        def on_host() -> Any:
            with _disable_current_modes():
                return func(*tree_map(to_host, args), **tree_map(to_host, kwargs))

        if func is torch.ops.aten._local_scalar_dense.default:
            self.answered += 1
            return on_host()
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):  # a data-dependent shape (nonzero): the host result's
            self.answered += 1
            return tree_map(lambda h: self.give_as_made(h) if isinstance(h, torch.Tensor) else h, on_host())
        inputs = {t.untyped_storage()._cdata for t in metas}
        # no value (a 4-D attention mask), a written one lost
        if any(_too_large(o, inputs, self.limit()) for o in tensor_leaves(out)):
            for t in _written(func, args, kwargs):
                self.values.pop(t, None)
            return out
        host = on_host()
        outs, _ = tree_flatten(out)
        hosts, _ = tree_flatten(host)
        for o, h in zip(outs, hosts, strict=True):
            if isinstance(o, torch.Tensor) and o.device.type == META:
                self.values[o] = h
        return out


class _Valued(WeakTensorKeyDictionary):  # type: ignore[misc]
    """:class:`_RoutedValues`' values: a dictionary keyed weakly by tensor identity (torch's), with the ids of the
    tensors ever given a value kept beside it. Every op of the step asks of each of its meta tensors whether it
    has a value, and almost none has: a lookup makes a weak reference to ask, the set answers "no" without one
    (an id in the set is still asked of the dictionary: the tensor it named may be gone, its id reused)."""

    def __init__(self) -> None:
        super().__init__()
        self.given: set[int] = set()

    def __setitem__(self, key: Any, value: Any) -> None:
        self.given.add(id(key))
        super().__setitem__(key, value)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.given.add(id(key))
        return super().setdefault(key, default)

    def update(self, other: Any = None, **kwargs: Any) -> None:
        for key, value in (*dict(other or {}).items(), *kwargs.items()):
            self[key] = value

    def __contains__(self, key: Any) -> bool:
        return id(key) in self.given and super().__contains__(key)


VALUED_BYTES = 1 << 24
"""The largest new storage a valued op's result gets a value for (16 MiB). What the step's code reads values of
(rows, positions, grids, image-token masks, window indices) is rows x seq or patches long; what is larger is a
rows x seq x seq attention mask, which only attention reads, and computing it on the host costs seconds (8 rows of
8,192 tokens: 512 MiB, 1 s an op). A view keeps its base's value whatever its size (an image-token mask expanded to
the embeddings). A data-dependent op that would read a value not kept raises, as meta does (never a wrong shape).
The limit is never below the largest tensor the batch gives (:meth:`_RoutedValues.limit`)."""


def _too_large(t: Any, inputs: frozenset[int] | set[int], limit: int) -> bool:
    """Whether ``t`` (an op's result on meta) is a new storage over ``limit`` (:meth:`_RoutedValues.limit`):
    not one of its op's ``inputs``' storages (a view's, an in-place op's result). Inside ``__torch_dispatch__``
    a view's output is not yet marked a view (``_is_view()`` is False for ``view``, ``slice``, ``expand``:
    autograd marks it above the mode), so the storage is the test."""
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == META
        and t.untyped_storage()._cdata not in inputs
        and t.untyped_storage().nbytes() > limit
    )


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's mutable arguments)."""
    written = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written


@contextlib.contextmanager
def routed_on_meta(model: torch.nn.Module, kind: Routing, tokens: int) -> Iterator[dict[str, Any]]:
    """Within the block the meta ``model``'s experts get the ``kind`` routing
    (:func:`vramguard.workload.routing.forced_routing`, the hook the audit's forced routing runs), its values
    carried beside the meta tensors (:class:`_RoutedValues`) so the eager experts' loop runs as on a device.
    Enter it outside the tracker (whose mode then sees the meta results, not the host values). Yields the
    hook's counter, with ``answered``: the data-dependent steps answered from the values."""
    from vramguard.workload.routing import forced_routing

    values = _RoutedValues()
    with values, forced_routing(model, kind, tokens, place=values.give, inside=values.enter_experts) as taken:
        yield taken
    taken["answered"] = values.answered


_SDPA_PARAMS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_FLASH = 1  # torch's SDPBackend.flash_attention


def _sdpa_as_on(
    on: tuple[str, Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``scaled_dot_product_attention`` on meta tensors, through the kernel the target would pick (``on``: the
    target and torch's own function).

    CUDA (no device here to ask): :func:`vramguard.model.layers.sdpa_kernel`'s rules; its flash and
    memory-efficient kernels keep what the CPU's flash kernel keeps (q, k, v, out, logsumexp; the
    memory-efficient one pads its logsumexp to 32 rows: a few KiB the meta run leaves out), and the
    math composite is what meta runs anyway. The CPU:

    On meta, torch always takes the math path (it materialises the attention matrix and saves it
    for backward); a CPU or GPU run takes a fused kernel that saves the output and the logsumexp
    only. torch's own backend choice (``torch._fused_sdp_choice``) is asked about stand-ins of the
    same shapes, dtypes and last-dimension strides on the CPU (one row each, so nothing is allocated
    in proportion to the model); when it picks flash attention, the meta run calls the op the CPU
    composite calls, ``_scaled_dot_product_flash_attention_for_cpu``, whose meta kernel and
    backward are torch's own (the CPU kernel takes fewer key/value heads as they are: ``enable_gqa``).
    """
    target, original = on
    params = dict(zip(_SDPA_PARAMS, args, strict=False))
    params.update(kwargs)
    mask = params.get("attn_mask")
    dropout = float(params.get("dropout_p", 0.0) or 0.0)
    causal = bool(params.get("is_causal", False))
    scale = params.get("scale")
    gqa = bool(params.get("enable_gqa", False))
    if target == "cuda":
        kernel = sdpa_kernel(
            "cuda", query.element_size(), query.shape[-3], key.shape[-3], query.shape[-1], mask is not None
        )
        if kernel == "math":
            return original(query, key, value, *args, **kwargs)
        if mask is not None and mask.dtype == torch.bool:
            # the memory-efficient kernel keeps the additive mask for backward (on the H100: b x 1 x s x s x e
            # per masked layer)
            mask = _additive_mask(mask, query.dtype)
        out, _logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout, causal, attn_mask=mask, scale=scale
        )
        return out

    def stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        row = torch.zeros(t.shape[-1], dtype=t.dtype)
        return row.expand(t.shape) if t.stride(-1) == 1 else torch.zeros(1, dtype=t.dtype).expand(t.shape)

    with _disable_current_modes():  # the stand-ins are no part of the run: trackers must not count them
        choice = torch._fused_sdp_choice(
            stand_in(query),
            stand_in(key),
            stand_in(value),
            stand_in(mask),
            dropout,
            causal,
            scale=scale,
            enable_gqa=gqa,
        )
    if choice != _FLASH:
        return original(query, key, value, *args, **kwargs)
    if mask is not None and mask.dtype == torch.bool:
        # the CPU flash kernel keeps the additive mask for backward (a padding-free batch's packed-sequence mask)
        mask = _additive_mask(mask, query.dtype)
    out, _logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout, causal, attn_mask=mask, scale=scale
    )
    return out


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask made additive in ``dtype`` as the sdpa composite makes it before a fused kernel
    (``convert_boolean_attn_mask``; torch 2.13, seen through a dispatch mode on the CPU: two scalar tensors and
    one ``where``, no inverted copy of the mask, the scalars freed with the statement as C++ temporaries are)."""
    return torch.where(
        mask,
        torch.scalar_tensor(0.0, dtype=dtype, device=mask.device),
        torch.scalar_tensor(-float("inf"), dtype=dtype, device=mask.device),
    )


def _quantize_on_meta(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Quantize every ``Linear4bit`` weight on meta, as the checkpoint's weight in ``dtype`` (what
    ``from_pretrained(dtype=...)`` hands the quantizer), and give its bias ``dtype`` too (the swapped-in
    layer's is torch's default float32, where ``from_pretrained`` loads the checkpoint's in ``dtype``: FSDP1
    then refused to flatten a unit of bf16 weights and fp32 biases that the real recipe flattens); returns
    how many.

    The swapped-in ``Linear4bit`` holds a float32 meta weight (torch's default dtype); quantizing that
    would record float32 in the quant state, and every dequantization (``MatMul4Bit``'s backward, DoRA's
    weight norm) would then make a float32 weight where the real run makes one in ``dtype``.

    bitsandbytes caches the 8-bit code of double quantization (``functional.name2qmap``) on the
    device of its first use: created on meta, it would break every later real quantization in the
    process ("Cannot copy out of meta tensor"). The cache is restored as it was.
    """
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    cached = dict(bnb_functional.name2qmap)
    count = 0
    try:
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit) and not getattr(module.weight, "bnb_quantized", False):
                w = module.weight
                # as transformers' Bnb4bitQuantize: Params4bit(value, requires_grad=False, **old.__dict__)
                module.weight = bnb.nn.Params4bit(
                    w.data.to(dtype), requires_grad=False, **w.__dict__
                )._quantize(META)
                if module.bias is not None:  # the checkpoint's bias, loaded in dtype as well
                    module.bias = torch.nn.Parameter(module.bias.data.to(dtype), requires_grad=False)
                count += 1
    finally:
        bnb_functional.name2qmap.clear()
        bnb_functional.name2qmap.update(cached)
    return count


@contextlib.contextmanager
def _deepcopy_on_meta() -> Iterator[None]:
    """Within the block, ``copy.deepcopy`` of a meta ``Params4bit`` works, as it does on a real device.

    PEFT's DoRA (``DoraLinearLayer.update_layer``) deep-copies the base ``Linear4bit`` before dequantizing its
    weight for the weight norm. bitsandbytes' ``Params4bit.__deepcopy__`` makes the copy with
    ``Params4bit.__new__(cls)``, whose placeholder ``torch.empty(0)`` is on the default device (the CPU), then
    sets ``.data`` to the packed weight: torch refuses a meta tensor as the data of a CPU one ("incompatible
    tensor type"). The original method runs unchanged with meta as the default device, so its placeholder is a
    meta tensor; real-device parameters are copied as before."""
    import bitsandbytes as bnb

    cls = bnb.nn.Params4bit
    original = cls.__dict__["__deepcopy__"]

    def __deepcopy__(self: Any, memo: dict[int, Any]) -> Any:
        if self.device.type != META:
            return original(self, memo)
        with torch.device(META):
            return original(self, memo)

    with patched(cls, "__deepcopy__", __deepcopy__):
        yield


@values_not_drawn()  # a meta parameter has no values to draw (vramguard.estimate.no_init)
def build_meta(
    config: QLoRAConfig,
    spec: ModelSpec | None = None,
    method: str = "qlora",
    device: str = META,
    sharded: bool = False,
    prepared: bool = True,
) -> QLoRAModel:
    """The model :func:`vramguard.workload.models.build_qlora` builds for ``config``, on the meta device.

    ``config.device`` is ignored for the build (validated as given); the returned model's config
    says ``device`` (``meta``), so its batches are created there. ``method`` picks what is trained
    (:data:`METHODS`). ``device="cpu"`` builds the ``lora`` and ``full`` models with random weights on
    the host, the reference the tests hold the meta run against (``qlora``'s is ``build_qlora``).
    ``sharded``: the FSDP + QLoRA recipe, as ``build_qlora(sharded=True)`` (``qlora`` only).
    ``prepared`` False: the 4-bit model as ``from_pretrained`` loads it, without k-bit preparation and LoRA (what
    TRL's SFTTrainer is handed with a ``peft_config``: it does its own; ``qlora`` only).
    """
    if method not in METHODS:
        raise UsageError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if device != META and method == "qlora":
        raise ValueError("build the real-device QLoRA model with vramguard.workload.models.build_qlora")
    config.validate()
    spec = spec or config.spec
    vision = _vision_meta(config, spec, method, device, not sharded, prepared)
    if vision is not None:  # the family's processor's rows, their values carried on meta (estimate.vision)
        return vision
    from transformers.quantizers import AutoHfQuantizer
    from transformers.utils import logging as hf_logging

    hf_config, model_class, attn, notes = resolve_attention(config, spec)
    refuse_kernel_experts(hf_config, spec.name)
    built = attn
    if (
        attn == "flash_attention_2"
    ):  # transformers refuses it without the package: built with sdpa, run with it
        built = hf_config._attn_implementation = "sdpa"
        notes.append(_flash_note(config))
    compute_dtype = parse_dtype(config.compute_dtype)
    weights_dtype = parse_dtype(config.full_dtype) if method == "full" else compute_dtype
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    checkpointing = {"use_reentrant": False} if config.gradient_checkpointing else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device(device):
                model = model_class._from_config(hf_config, dtype=weights_dtype, attn_implementation=built)
        except (*BUILD_ERRORS, RuntimeError) as exc:
            raise UsageError(f"transformers cannot build {spec.name}: {build_error(exc)}") from None
        if method == "qlora":
            quantizer = AutoHfQuantizer.from_config(
                bnb_4bit_config(config, sharded=sharded), pre_quantized=False
            )
            quantizer.preprocess_model(model, device_map={"": META}, dtype=compute_dtype)
            _quantize_on_meta(model, compute_dtype)
            quantizer.postprocess_model(model)
            model.hf_quantizer = quantizer
            if not prepared:
                return _unprepared(model, config, spec, attn, notes, device)
            model = prepare_for_training(model, config, sharded=sharded)
        elif config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        if method == "full":
            for p in model.parameters():
                p.requires_grad_(True)
        else:
            model = _lora_on(model, config, device)
    model.train()
    model.config.use_cache = False
    loaded = getattr(model, "config", hf_config)  # from_pretrained set its experts implementation there
    notes += [line for line in (weights_line(model, loaded), routing_line(loaded)) if line]
    return MetaQLoRAModel(
        model=model,
        spec=spec,
        config=_with_device(config, device),
        attn_implementation=attn,
        notes=tuple(notes),
    )


def _lora_on(model: Any, config: QLoRAConfig, device: str) -> Any:
    """PEFT's LoRA on the built ``model`` (:func:`vramguard.workload.models.with_lora`). DoRA copies the 4-bit base
    layer (:func:`_deepcopy_on_meta`); PEFT makes each LoRA matrix on the host, draws it and moves it to its base
    layer's device: on meta nothing drawn is kept, so nothing is drawn (as the vision build and the trainer's
    setup: 224 x 3 host draws of an 8B shape, about 1 s of CPU)."""
    drawn = values_not_drawn(meta_only=False) if device == META else contextlib.nullcontext()
    with _deepcopy_on_meta(), drawn:
        return with_lora(model, config)


def _vision_meta(
    config: QLoRAConfig, spec: ModelSpec, method: str, device: str, one_device: bool, prepared: bool = True
) -> QLoRAModel | None:
    """A vision-language model (:func:`vramguard.estimate.vision.build_vision_meta`) for ``method`` (``qlora`` or
    ``lora``) on ``device``: on meta its rows' values kept on it for the step (``image_values``: run_estimate steps
    it under ``values_on_meta``, the trainer's step its collated batches); ``lora`` on the CPU is the tests'
    reference, its rows real tensors. ``prepared`` False: the 4-bit model unprepared, for SFTTrainer. Refused in
    one line off one device (``one_device``: not sharded) and for ``full``. None for a text model (given a vision
    tower option: refused in one line)."""
    from vramguard.workload.vision import is_vision_spec, refuse_tower_options, vision_setup

    if not is_vision_spec(spec):
        refuse_tower_options(config)
        return None
    if method not in VISION_METHODS or not one_device:
        methods = " or ".join(VISION_METHODS)
        raise UsageError(
            f"vision-language models are estimated for --method {methods} on one device for now (qlora through "
            "SFTTrainer's step or vramguard's loop, lora in the loop)"
        )
    from vramguard.estimate.vision import build_vision_meta, vision_meta_of

    if prepared:
        built_vlm, values = build_vision_meta(config, spec=spec, method=method, device=device)
    else:  # SFTTrainer's: its own LoRA (qlora only: refuse_unpriced)
        built_vlm, values = vision_meta_of(vision_setup(config, spec=spec), config, method, device, prepared=False)
    if device == META:
        built_vlm.q.image_values = values  # run_estimate steps it under values_on_meta
    return built_vlm.q  # type: ignore[no-any-return]


VISION_METHODS: tuple[str, ...] = ("qlora", "lora")
"""The methods a vision-language model is built for (:func:`_vision_meta`): its 4-bit base or its base in the
compute dtype, LoRA as PEFT puts it on either."""


def _flash_note(config: QLoRAConfig) -> str:
    """The build's note for flash_attention_2: built with sdpa, run with flash-attn 2's kernel priced on meta."""
    return (
        "flash_attention_2: the flash_attn package is CUDA-only and not loaded; transformers' flash path runs "
        "with flash-attn 2's kernel priced from its own rules (vramguard.estimate.flash): it saves q, k, v, "
        "the output, an fp32 b x h x s logsumexp and no s x s tensor"
        + ("; a padding-free batch runs its varlen kernel (an h x total logsumexp)" if config.padding_free else "")
    )


def _unprepared(
    model: Any, config: QLoRAConfig, spec: ModelSpec, attn: str, notes: list[str], device: str
) -> QLoRAModel:
    """The 4-bit model as loaded (training mode, no cache), for a trainer that prepares it itself."""
    model.train()
    model.config.use_cache = False
    loaded = getattr(model, "config", None)
    notes += [line for line in (weights_line(model, loaded), routing_line(loaded)) if line]
    return MetaQLoRAModel(
        model=model, spec=spec, config=_with_device(config, device), attn_implementation=attn, notes=tuple(notes)
    )


class MetaQLoRAModel(QLoRAModel):
    """A :class:`QLoRAModel` built here: its batches are uninitialised tensors of the real shape and
    dtype (on meta, ``randint`` on the host first would allocate batch x seq x 8 bytes for nothing)."""

    def batch(self, step: int = 0) -> dict[str, torch.Tensor]:
        """Step ``step``'s inputs: on meta, ``input_ids`` and ``labels`` as one uninitialised (batch, seq_len)
        long tensor, which costs no memory; on a real device, the synthetic tokens of
        :meth:`QLoRAModel.batch`. A padding-free batch is TRL's collator's on the host (its tensors' shapes
        and dtypes, each an uninitialised meta tensor; its integers as they are)."""
        if self.config.device != META:
            return super().batch(step)
        shape = (self.config.batch, self.config.seq_len)
        if self.config.padding_free:
            made: dict[int, torch.Tensor] = {}  # one meta tensor per host tensor (cu_seq_lens_q is _k)
            batch = padding_free_batch(torch.zeros(shape, dtype=torch.long), self.config.packing)
            for k, v in batch.items():
                if isinstance(v, torch.Tensor):
                    batch[k] = made.setdefault(id(v), torch.empty(v.shape, dtype=v.dtype, device=META))
            return batch
        ids = torch.empty(shape, dtype=torch.long, device=META)
        return {"input_ids": ids, "labels": ids}

    def host_labels(self) -> torch.Tensor:
        """The labels of the real batch, on the host (their values, which a meta batch lacks): the synthetic rows'
        are token ids (none ignored), a padding-free batch's are TRL's collator's (the first token of each
        sequence ignored). Liger's fused cross-entropy asks their non-ignored count (``.item()``)."""
        shape = (self.config.batch, self.config.seq_len)
        if self.config.padding_free:
            return padding_free_batch(torch.zeros(shape, dtype=torch.long), self.config.packing)["labels"]
        return torch.zeros(shape, dtype=torch.long)

    @property
    def one_sequence_per_row(self) -> bool:
        """Whether the batch's real position ids hold one sequence per row, as transformers' own
        ``find_packed_sequence_indices`` decides on the host's position ids: always for the synthetic rows
        (no position ids are passed), and for a padding-free batch what its boundaries say
        (:func:`vramguard.workload.models.packed_lengths`). :func:`forced_decisions` answers the meta run's
        test with it."""
        if not self.config.padding_free:
            return True
        from transformers.masking_utils import find_packed_sequence_indices

        shape = (self.config.batch, self.config.seq_len)
        position_ids = padding_free_batch(torch.zeros(shape, dtype=torch.long), self.config.packing)[
            "position_ids"
        ]
        return find_packed_sequence_indices(position_ids) is None


def _with_device(config: QLoRAConfig, device: str) -> QLoRAConfig:
    import dataclasses

    return dataclasses.replace(config, device=device)  # not validated: validate() allows cpu/cuda only
