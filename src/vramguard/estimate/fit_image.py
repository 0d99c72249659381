"""``vramguard estimate --fit SIZE --fit-dim image``: the largest image a vision-language model's step fits in SIZE
at the requested batch and sequence length.

The search (:func:`vramguard.estimate.fit.search`) runs over the sizes the family's processor keeps
(:attr:`vramguard.workload.vision.VisionFamily.image_steps`): value ``k`` is an image ``k`` steps high (Qwen's step:
``patch_size * merge_size`` pixels, 28 for Qwen2-VL and Qwen2.5-VL, 32 for Qwen3-VL) and as wide as the requested
``--image-size``'s aspect ratio makes it, rounded to a step (square without ``--image-size``). Two bounds cap it
before any meta run: the processor's ``max_pixels`` (a larger image is resized down to it: memory stops growing
there) and ``--seq-len``, the whole row as TRL's ``max_length`` counts it, image tokens included (a row whose image
tokens alone exceed it is no row TRL trains on): the answer is never past either, and says which one held it.
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
    """Images ``value * step`` pixels high, as wide as ``aspect`` (height, width) makes them, rounded to a step."""

    step: int = 1
    aspect: tuple[int, int] = (1, 1)

    def size(self, value: int) -> tuple[int, int]:
        """(height, width) of value ``value``: its width the nearest step to the aspect ratio's, at least one."""
        h, w = self.aspect
        return value * self.step, max(1, (2 * value * w + h) // (2 * h)) * self.step

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
    pixels: dict[str, int] | None = None  # the user's --min-pixels / --max-pixels (None: the processor's)

    def tokens(self, value: int) -> tuple[int, int]:
        """(tokens the row's images take with their markers, image tokens) at ``value``, as the processor counts."""
        from vramguard.workload.vision import row_tokens

        args = (self.family, self.hf_config, self.vocab_size, self.dim.size(value), self.images_per_row)
        return row_tokens(*args, pixels=self.pixels)

    def known(self, image_size: str, total: int) -> dict[int, int]:
        """The requested shape's total as the search's known value, where its image is one of the searched sizes."""
        values = [k for k in range(1, self.limit + 1) if self.dim.text(k) == image_size.replace(" ", "")]
        return {values[0]: total} if values else {}

    def answer(self, largest: int) -> dict[str, Any]:
        """``--json``'s ``estimate.fit.image``: the image at the answer (None: not even the smallest fits) with its
        tokens, the step and aspect searched, and the bound."""
        out: dict[str, Any] = {
            "step": self.dim.step,
            "aspect": list(self.dim.aspect),
            "limit": self.dim.text(self.limit),
            "limited_by": self.limited_by,
            "largest": None,
            "row_tokens": None,
            "image_tokens": None,
        }
        if largest:
            out["largest"] = self.dim.text(largest)
            out["row_tokens"], out["image_tokens"] = self.tokens(largest)
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


def image_space(config: QLoRAConfig) -> ImageSpace:
    """The :class:`ImageSpace` of ``config`` (a vision-language model's; its ``image_size`` the aspect ratio, none:
    square): its processor's steps, capped by ``max_pixels`` and by the image tokens ``seq_len`` holds. A text model,
    a family whose processor does not keep the image's size, or a seq-len too short for the smallest image is one
    line."""
    from vramguard.workload.vision import (
        MAX_IMAGE_SIDE,
        VISION_FAMILIES,
        family_of,
        is_vision_spec,
        parse_image_size,
        pixel_bounds,
        vision_shape,
    )

    spec = config.spec
    if not is_vision_spec(spec):
        raise UsageError(f"--fit-dim image searches a vision-language model's image size: {spec.name} has no images")
    hf_config = spec.transformers_config()
    family = family_of(hf_config.model_type)
    if family.image_steps is None:
        keeps = sorted({f.name for f in VISION_FAMILIES.values() if f.image_steps is not None})
        raise UsageError(
            f"{family.name}'s processor does not keep an image's size ({family.image_processor}): --fit-dim image "
            f"searches the families whose processor rounds it in patch steps ({', '.join(keeps)})"
        )
    steps = family.image_steps(hf_config)
    pixels = pixel_bounds(config)
    if config.max_pixels:  # the user's bound replaces the processor's
        steps = dataclasses.replace(steps, max_pixels=config.max_pixels)
    h, w = parse_image_size(config.image_size) if config.image_size else (1, 1)
    dim = ImageDim("image", steps.step, (h // math.gcd(h, w), w // math.gcd(h, w)))

    def within(k: int) -> bool:  # the processor keeps it: at most max_pixels, sides --image-size takes
        height, width = dim.size(k)
        return height * width <= steps.max_pixels and max(height, width) <= MAX_IMAGE_SIDE

    by_pixels = _largest(within, MAX_IMAGE_SIDE // steps.step)
    if by_pixels < 1:
        raise UsageError(f"no {h}:{w} image of {steps.step}-pixel steps is within {family.name}'s max_pixels")
    space = ImageSpace(
        dim, by_pixels, "max_pixels", family, hf_config, vision_shape(spec.name, hf_config).text["vocab_size"],
        config.images_per_row,
        pixels or None,
    )
    if space.tokens(by_pixels)[0] <= config.seq_len:  # one processor call where seq-len holds the largest image
        return space
    by_seq = _largest(lambda k: space.tokens(k)[0] <= config.seq_len, by_pixels - 1)
    if by_seq < 1:
        used, _ = space.tokens(1)
        raise UsageError(
            f"not even a {dim.text(1)} image fits seq-len {config.seq_len} ({used} tokens in {family.name}'s "
            "rows): raise --seq-len"
        )
    return dataclasses.replace(space, limit=by_seq, limited_by="seq-len")


__all__ = ["ImageDim", "ImageSpace", "image_space"]
