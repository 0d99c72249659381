"""``vramguard estimate --fit SIZE --fit-dim image``: the largest image a vision-language model's step fits in SIZE
at the requested batch and sequence length.

The search (:func:`vramguard.estimate.fit.search`) runs over the sizes the family's processor makes of an image at
the requested ``--image-size``'s aspect ratio (square without one): its own resize
(:attr:`vramguard.workload.vision.ImageSteps.resize`, Qwen's and GLM-4V's ``smart_resize``: each side in
``patch_size * merge_size`` steps, 28 pixels for Qwen2-VL, Qwen2.5-VL and GLM-4V, 32 for Qwen3-VL, between
``min_pixels`` and ``max_pixels``) applied to every image height at that ratio, value ``k`` the ``k``-th
smallest size it makes (:func:`processor_sizes`). Two bounds cap it before any meta run: ``max_pixels`` (the
largest size it makes: a larger image is resized to at most it, so memory stops growing there) and
``--seq-len``, the whole row as TRL's ``max_length`` counts it, image tokens included (a row whose image
tokens alone exceed it is no row TRL trains on): the answer is never past either, and says which one held it.

A family whose processor does not keep the image's size (Gemma 3's fixed size and pan-and-scan crops, LLaVA-NeXT's
tiles, Idefics3's splitting, InternVL's crops) is searched by the processor's own token count instead
(:func:`tiled_space`): value ``k`` is the ``k``-th run of sizes at the ratio that it gives the same tokens
(:func:`token_runs`); where every size gets the same tokens there is nothing to search, and that is one line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from vramguard.errors import UsageError
from vramguard.estimate.fit import Dim
from vramguard.workload.models import QLoRAConfig


@dataclass(frozen=True)
class ImageDim(Dim):
    """Value ``k``: the ``k``-th smallest of ``sizes`` (height, width), the sizes the processor makes of an image
    at ``aspect`` (height, width) in ``step``-pixel sides (:func:`processor_sizes`)."""

    step: int = 1
    aspect: tuple[int, int] = (1, 1)
    sizes: tuple[tuple[int, int], ...] = ()

    def size(self, value: int) -> tuple[int, int]:
        """(height, width) of value ``value``."""
        return self.sizes[value - 1]

    def text(self, value: int) -> str:
        """``HxW`` of value ``value`` (what ``--image-size`` takes)."""
        h, w = self.size(value)
        return f"{h}x{w}"

    def apply(self, config: QLoRAConfig, value: int) -> QLoRAConfig:
        """``config`` with images of value ``value``."""
        return dataclasses.replace(config, image_size=self.text(value))


@dataclass(frozen=True)
class ImageSpace:
    """What ``--fit-dim image`` searches: its :class:`ImageDim`, the largest value (``limit``) and the bound that set
    it (``max_pixels`` or ``seq-len``), and what the processor needs to count a value's tokens."""

    dim: ImageDim
    limit: int
    limited_by: str
    family: Any
    hf_config: Any
    vocab_size: int
    images_per_row: int
    steps: Any  # the processor's ImageSteps, with the user's --min-pixels / --max-pixels (None: a tiling processor)
    pixels: dict[str, Any] | None = None  # what the config tells the processor (None: nothing, its own settings)
    up_to: tuple[tuple[int, int] | None, ...] = ()
    """A tiling processor's (no ``steps``): per value, the largest image probed that gets its tokens (None: every
    larger one probed does; :func:`token_runs`)."""

    def tokens(self, value: int) -> tuple[int, int]:
        """(tokens the row's images take with their markers, image tokens) at ``value``, as the processor counts."""
        from vramguard.workload.vision import row_tokens

        args = (self.family, self.hf_config, self.vocab_size, self.dim.size(value), self.images_per_row)
        return row_tokens(*args, pixels=self.pixels)

    def known(self, image_size: str, total: int) -> dict[int, int]:
        """The requested shape's total as the search's known value, where the size the processor makes of its
        image is one of the searched sizes."""
        from vramguard.workload.vision import parse_image_size

        if not image_size:
            return {}
        size = parse_image_size(image_size)
        if self.steps is not None:
            made = self.steps.resized(*size)
            values = [k for k in range(1, self.limit + 1) if self.dim.size(k) == made]
        else:  # a tiling processor: the value whose run of probed sizes holds the image's long side
            values = [k for k in range(1, self.limit + 1) if max(self.dim.size(k)) <= max(size) <= self._top(k)]
        return {values[0]: total} if values else {}

    def _top(self, value: int) -> int:
        """The longest side of the images probed that get ``value``'s tokens."""
        top = self.up_to[value - 1]
        return PROBE_SIDE if top is None else max(top)

    def answer(self, largest: int, ran: list[int]) -> dict[str, Any]:
        """``--json``'s ``estimate.fit.image``: the image at the answer (None: not even the smallest fits) with its
        tokens, the step and aspect searched, the bound, and the image of each run (``ran``: the values run, in
        order; the fit's ``runs`` give their totals)."""
        out: dict[str, Any] = {
            "step": self.dim.step,
            "aspect": list(self.dim.aspect),
            "limit": self.dim.text(self.limit),
            "limited_by": self.limited_by,
            "largest": None,
            "row_tokens": None,
            "image_tokens": None,
            "ran": [self.dim.text(value) for value in ran],
        }
        if largest:
            out["largest"] = self.dim.text(largest)
            out["row_tokens"], out["image_tokens"] = self.tokens(largest)
        if self.steps is None:  # a tiling processor: the tokens of a run of sizes, from its smallest
            top = self.up_to[largest - 1] if largest else None
            out.update(step=None, follows="tokens", probed_up_to=PROBE_SIDE, same_from=out["largest"])
            out["largest"] = f"{top[0]}x{top[1]}" if top else out["largest"]
        return out


def _largest(ok: Any, hi: int) -> int:
    """The largest value in [0, ``hi``] for which ``ok`` holds (it holds below any value it holds for; 0: none):
    doubling from 1, then bisecting, so that no value above twice the answer is tried (a value here is an image,
    and a large one costs the processor seconds)."""
    lo, k = 0, 1
    while k <= hi and ok(k):
        lo, k = k, 2 * k
    hi = min(k, hi + 1)  # the smallest value known not to hold (hi + 1: none tried)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def processor_sizes(steps: Any, aspect: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """The sizes (height, width) the processor makes of images at ``aspect`` (height, width), fewest pixels first,
    one per pixel count: its own resize (:meth:`~vramguard.workload.vision.ImageSteps.resized`) of an image of
    every height from 1 pixel, as wide as the ratio makes it, until the image is 4 x ``max_pixels`` or a side
    reaches :data:`~vramguard.workload.vision.MAX_IMAGE_SIDE` (past ``max_pixels`` the resize shrinks every
    image at the ratio to about the same size). A height whose image the processor refuses (an aspect ratio
    beyond 200, Qwen's bound) is left out."""
    from vramguard.workload.vision import MAX_IMAGE_SIDE

    h, w = aspect
    made: dict[int, tuple[int, int]] = {}
    for height in range(1, MAX_IMAGE_SIDE + 1):
        width = max(1, (2 * height * w + h) // (2 * h))
        if width > MAX_IMAGE_SIDE or height * width > 4 * steps.max_pixels:
            break
        try:
            size = steps.resized(height, width)
        except ValueError:  # the processor's own refusal (an aspect ratio beyond its bound)
            continue
        if max(size) <= MAX_IMAGE_SIDE:
            made.setdefault(size[0] * size[1], size)
    return tuple(made[pixels] for pixels in sorted(made))


PROBE_SIDE = 4096
"""The longest side of the images ``--fit-dim image`` gives a tiling processor (no patch steps) to find where its
token count changes: past it the count is taken not to grow (LLaVA-NeXT's largest tile grid on the Hub is 1344
pixels, Gemma 3's pan-and-scan makes at most 4 crops of at least 256)."""

PROBE_FROM = 16
"""The longest side of the smallest image probed."""

PROBE_CALLS = 96
"""The most processor calls a tiling processor's probe may take (each a synthetic image through it)."""


def _probed(aspect: tuple[int, int], side: int) -> tuple[int, int]:
    """The image at ``aspect`` (height, width) whose longest side is ``side``."""
    h, w = aspect
    top = max(h, w)
    return max(1, (2 * side * h + top) // (2 * top)), max(1, (2 * side * w + top) // (2 * top))


def token_runs(tokens_at: Any, aspect: tuple[int, int]) -> list[tuple[int, int, Any]] | None:
    """(first longest side, last longest side, tokens) of each run of images at ``aspect``, from
    :data:`PROBE_FROM` to :data:`PROBE_SIDE` pixels on the longest side, that ``tokens_at`` (a size's tokens, as
    the processor counts them) gives the same tokens: bisected between probes whose tokens differ, to the pixel,
    in at most :data:`PROBE_CALLS` calls (more: None). The count is taken to grow with the image: a count that
    comes and goes between two probes of one count is not seen."""
    seen = {side: tokens_at(_probed(aspect, side)) for side in (PROBE_FROM, PROBE_SIDE)}
    pending = [(PROBE_FROM, PROBE_SIDE)]
    while pending:
        a, b = pending.pop()
        if seen[a] == seen[b] or b - a < 2:
            continue
        if len(seen) >= PROBE_CALLS:
            return None
        mid = (a + b) // 2
        seen[mid] = tokens_at(_probed(aspect, mid))
        pending += [(mid, b), (a, mid)]  # the smaller images first: they cost the processor less
    runs: list[list[Any]] = []
    for side in sorted(seen):
        if runs and runs[-1][2] == seen[side]:
            runs[-1][1] = side
        else:
            runs.append([side, side, seen[side]])
    return [(first, last, tokens) for first, last, tokens in runs]


def tiled_space(space: ImageSpace, config: QLoRAConfig) -> ImageSpace:
    """``space`` (of a family whose processor does not keep the image's size: Gemma 3's fixed size, LLaVA-NeXT's
    tiles, Idefics3's splitting, ...) with its values: one per run of image sizes at its aspect ratio that the
    processor gives the same tokens (:func:`token_runs`), each run by its smallest image, fewest tokens first.
    One run (every size the same tokens: nothing to search), or more runs than the probe resolves, is one line."""
    from vramguard.workload.vision import row_tokens

    family, aspect = space.family, space.dim.aspect

    def tokens_at(size: tuple[int, int]) -> tuple[int, int]:
        return row_tokens(space.family, space.hf_config, space.vocab_size, size, space.images_per_row, space.pixels)

    runs = token_runs(tokens_at, aspect)
    ratio = f"{aspect[0]}:{aspect[1]}"
    if runs is None:
        raise UsageError(
            f"{family.name}'s processor changes an image's tokens at more sizes than --fit-dim image probes "
            f"({PROBE_CALLS} processor calls at {ratio}): give --image-size a size to estimate instead"
        )
    if len(runs) == 1:
        raise UsageError(
            f"{family.name}'s processor ({family.image_processor}) gives every {ratio} image from {PROBE_FROM} to "
            f"{PROBE_SIDE} pixels on its longest side the same {runs[0][2][1]} image token(s): there is no image size "
            f"to search; search --fit-dim batch or seq at this --image-size{family.image_fit_hint(config)}"
        )
    sizes = tuple(_probed(aspect, first) for first, _, _ in runs)
    up_to = tuple(_probed(aspect, last) for _, last, _ in runs[:-1]) + (None,)
    dim = dataclasses.replace(space.dim, sizes=sizes)
    return dataclasses.replace(space, dim=dim, limit=len(sizes), up_to=up_to)


def image_space(config: QLoRAConfig) -> ImageSpace:
    """The :class:`ImageSpace` of ``config`` (a vision-language model's; its ``image_size`` the aspect ratio, none:
    square): the sizes its processor makes (:func:`processor_sizes`, up to the largest within ``max_pixels``), or
    for a processor without patch steps the runs of sizes it gives the same tokens (:func:`tiled_space`), capped
    by the image tokens ``seq_len`` holds. A text model, a processor that gives every size the same tokens, or a
    seq-len too short for the smallest image is one line."""
    from vramguard.workload.vision import (
        family_of,
        is_vision_spec,
        parse_image_size,
        pixel_bounds,
        processor_options,
        vision_shape,
    )

    spec = config.spec
    if not is_vision_spec(spec):
        raise UsageError(f"--fit-dim image searches a vision-language model's image size: {spec.name} has no images")
    if config.video_frames:
        raise UsageError(
            "--fit-dim image does not search beside a video yet (its row's video tokens are not counted in "
            "the search): --fit-dim seq or batch with --video-frames, or a search without the video"
        )
    hf_config = spec.transformers_config()
    family = family_of(hf_config.model_type)
    options = processor_options(config, family)
    h, w = parse_image_size(config.image_size) if config.image_size else (1, 1)
    aspect = (h // math.gcd(h, w), w // math.gcd(h, w))
    vocab = vision_shape(spec.name, hf_config).text["vocab_size"]
    if family.image_steps is None:
        space = tiled_space(ImageSpace(ImageDim("image", 0, aspect), 0, "tokens", family, hf_config, vocab,
                                       config.images_per_row, None, options or None), config)
    else:
        steps = dataclasses.replace(family.image_steps(hf_config), **pixel_bounds(config))  # the user's bounds win
        sizes = processor_sizes(steps, aspect)
        if not sizes:
            raise UsageError(f"{family.name}'s processor makes no image of a {aspect[0]}:{aspect[1]} aspect ratio")
        space = ImageSpace(ImageDim("image", steps.step, aspect, sizes), len(sizes), "max_pixels", family,
                           hf_config, vocab, config.images_per_row, steps, options or None)
    if space.tokens(space.limit)[0] <= config.seq_len:  # one processor call where seq-len holds the largest image
        return space
    by_seq = _largest(lambda k: space.tokens(k)[0] <= config.seq_len, space.limit - 1)
    if by_seq < 1:
        used, _ = space.tokens(1)
        raise UsageError(
            f"not even a {space.dim.text(1)} image fits seq-len {config.seq_len} ({used} tokens in {family.name}'s "
            "rows): raise --seq-len"
        )
    return dataclasses.replace(space, limit=by_seq, limited_by="seq-len")


__all__ = ["PROBE_SIDE", "ImageDim", "ImageSpace", "image_space", "processor_sizes", "tiled_space", "token_runs"]
