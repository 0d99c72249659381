"""Vision-language models: their shapes, their processors' image inputs, and a real QLoRA step of one.

A vision-language ``config.json`` keeps its language model's shape under ``text_config`` and its vision tower's
under ``vision_config``; transformers builds it with ``AutoModelForImageTextToText``. What one training row is
made of is decided by the family's processor: how an image is resized (Qwen's ``min_pixels``/``max_pixels`` and
patch rounding, Gemma 3's fixed size, LLaVA-NeXT's tiles, Idefics3's splitting), how many placeholder tokens it
takes in ``input_ids``, and which other inputs the forward reads (``pixel_values``, ``image_grid_thw``,
``mm_token_type_ids``, ``pixel_attention_mask``, ``aspect_ratio_ids``, ...). So a row is made by the family's own
processor class (:data:`VISION_FAMILIES`), with its own image processor, on a synthetic image of the asked size,
and a word-level tokenizer whose special tokens carry the ids the model config names: every count is the
processor's, none is vramguard's.

bitsandbytes' 4-bit load quantizes every ``nn.Linear`` but ``lm_head``, the vision tower's and the projector's
too, and PEFT's ``all-linear`` puts LoRA in them as well: what users get from the usual recipe, and what is
built here (:func:`build_vision_qlora`).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vramguard.errors import UsageError, first_line
from vramguard.measure.decoder import decoder_layer

MAX_IMAGE_SIDE = 16384
"""The largest image side ``--image-size`` takes (a 16k x 16k image is 805 MB of RGB pixels already)."""

MAX_IMAGES_PER_ROW = 64

STACKS = ("vision tower", "projector", "language model")
"""The three stacks a vision-language model's saved bytes are split into (:meth:`VisionFamily.stack_of`)."""


def _get(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _side(value: Any) -> int:
    """An ``image_size`` / ``patch_size`` that may be an int or a ``[h, w]`` pair (InternVL): its first side."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


@dataclass(frozen=True)
class VisionFamily:
    """How one vision-language family turns an image into model inputs: the processor a user loads with
    ``AutoProcessor`` (here built from its classes, nothing downloaded), and which modules are its vision tower
    and projector.

    ``tokens``: (the tokenizer attribute the processor reads or None, the token text, the model config attribute
    holding its id or None: any free id then). ``placeholder``: the text one image takes in a prompt before the
    processor expands it (as the family's chat template writes it). ``image_processor_kwargs`` and
    ``processor_kwargs``: what the family's ``preprocessor_config.json`` / ``processor_config.json`` on the Hub
    set, read from the model config where it says it (patch size, merge size, image size)."""

    name: str
    processor: str
    image_processor: str
    tokens: tuple[tuple[str | None, str, str | None], ...]
    placeholder: str
    image_processor_kwargs: Callable[[Any], dict[str, Any]] = lambda c: {}
    processor_kwargs: Callable[[Any], dict[str, Any]] = lambda c: {}
    tower: tuple[str, ...] = ("visual", "vision_tower", "vision_model")
    projector: tuple[str, ...] = ("merger", "multi_modal_projector", "connector", "deepstack_merger_list")
    needs: tuple[str, ...] = ()
    """Python packages the processor imports (a refusal names the missing one)."""
    tower_path: str = "model.vision_tower"
    """The vision tower's qualified module name in transformers 5's model (what ``llm_int8_skip_modules`` and
    PEFT's ``exclude_modules`` must name: transformers matches skip patterns from the start of the name, so the
    bare ``visual`` of older recipes matches nothing)."""
    projector_paths: tuple[str, ...] = ("model.multi_modal_projector",)
    """The projector's qualified module names (Qwen's merger sits inside the tower)."""
    pixels: bool = False
    """The image processor takes ``min_pixels`` / ``max_pixels`` (Qwen's and GLM-4V's ``size`` bounds)."""
    nested_images: bool = False
    """The processor takes a batch's images as one list per row (Mllama, Idefics3, SmolVLM)."""
    image_steps: Callable[[Any], ImageSteps] | None = None
    """How the processor rounds an image's sides, what ``--fit-dim image`` searches in (None: the processor does
    not keep the size, as Gemma 3's fixed size and LLaVA-NeXT's tiles: the search follows its token count,
    :mod:`vramguard.estimate.fit_image`)."""
    call_options: tuple[str, ...] = ()
    """Options of the processor's call that a flag may set (Gemma 3's ``do_pan_and_scan``,
    ``--pan-and-scan``): the processor's own call defaults win over its image processor's settings, so they go
    to every call."""
    image_fit_hint: Callable[[Any], str] = lambda config: ""
    """What ``--fit-dim image`` may search instead where the processor gives every size of an image the same
    tokens, for a run's QLoRAConfig (Gemma 3 without ``--pan-and-scan``: its crops grow with the image)."""
    video_processor: str | None = None
    """The transformers video processor class whose ``pixel_values_videos`` vramguard makes
    (``--video-frames``; None: video is refused, :func:`video_refusal`)."""
    video_size: dict[str, int] | None = None
    """The video processor's per-frame (Qwen2-VL) or whole-video (Qwen3-VL) pixel bounds as users load them from
    the Hub (``{"shortest_edge": ..., "longest_edge": ...}``), where they differ from its class defaults."""
    video_placeholder: str = ""
    """The text one video takes in a prompt before the processor expands it (as the chat template writes
    it)."""
    video_token: str | None = "<|video_pad|>"
    """The token whose positions take the video's features, counted as the row's video tokens (Qwen's
    ``<|video_pad|>``). None: the video's frames take the image token (GLM-4V writes each temporal patch as an
    image between the video's markers, InternVL each frame as an image after ``FrameN:``), so the row's video
    tokens are the image token's count less that of the row's images alone (:func:`_media_tokens`)."""
    video_without_images: str = ""
    """Why a row cannot hold images beside a video, in words ("": it can): SmolVLM's processor returns a
    video's frames under the images' own name, ``pixel_values``; GLM-4V's model takes the image token's
    positions as the images' and as the video's both."""
    video_processor_kwargs: Callable[[Any], dict[str, Any]] | None = None
    """What the video processor is built with (its checkpoints' ``video_preprocessor_config.json``); None: the
    tower's patch, merge and temporal patch sizes (Qwen's and GLM-4V's) and :attr:`video_size`."""

    def stack_of(self, module: str) -> str:
        """Which stack the module of qualified name ``module`` belongs to: ``vision tower``, ``projector`` or
        ``language model`` (everything else: embeddings, decoder layers, lm_head, the loss outside modules)."""
        parts = module.split(".")
        if any(p in self.projector for p in parts):
            return "projector"
        if any(p in self.tower for p in parts):
            return "vision tower"
        return "language model"

    def layer_of(self, module: str) -> str | None:
        """The layer of its stack that the module of qualified name ``module`` is in (the per-layer table's row):
        a vision tower's block (the outermost ``layers.N``, ``blocks.N`` or ``layer.N`` under the tower: SigLIP's
        and CLIP's ``encoder.layers.N``, Qwen's and GLM-4V's ``blocks.N``, InternVL's ``encoder.layer.N``), the
        projector (the module :attr:`projector` names, with its index where it is a list: Qwen3-VL's
        ``deepstack_merger_list.N``) or a language model's decoder layer (the one rule of
        :func:`vramguard.measure.decoder.decoder_layer`); None for what is in none of them (embeddings, the
        tower's patch embedding, ``lm_head``, the loss)."""
        stack = self.stack_of(module)
        if stack == "language model":
            return decoder_layer(module)
        if stack == "vision tower":
            m = _TOWER_LAYER.match(module)
            return m.group(1) if m else None
        parts = module.split(".")
        at = next(i for i, p in enumerate(parts) if p in self.projector) + 1
        return ".".join(parts[: at + 1 if at < len(parts) and parts[at].isdigit() else at])


_TOWER_LAYER = re.compile(r"^((?:.*?\.)?(?:layers|blocks|layer)\.\d+)(?:\.|$)")


def processor_resize(image_processor: str) -> Callable[..., tuple[int, int]]:
    """The resize of the module that defines transformers' ``image_processor`` class, the function its
    ``resize`` calls: ``smart_resize(height, width, factor, min_pixels, max_pixels)`` for Qwen's image processor."""
    import importlib

    import transformers

    return importlib.import_module(getattr(transformers, image_processor).__module__).smart_resize  # type: ignore[no-any-return]


@dataclass(frozen=True)
class ImageSteps:
    """The sizes a family's processor makes of an image: each side a multiple of ``step`` pixels (Qwen's
    ``smart_resize`` rounds to ``patch_size * merge_size``), between ``min_pixels`` and ``max_pixels`` pixels (a
    larger image is resized down, a smaller one up); ``resize`` is the processor's own function that does it
    (:func:`processor_resize`)."""

    step: int
    max_pixels: int
    min_pixels: int
    resize: Callable[..., tuple[int, int]]
    frames: int | None = None
    """GLM-4V's resize (None: Qwen's, which takes none): the frames its image processor gives an image to
    (``num_frames`` and ``temporal_factor``, its ``temporal_patch_size``, 2), whose pixels together are bounded by
    ``min_pixels`` / ``max_pixels``: an image's own bounds are half of them."""

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the processor makes of a ``height`` x ``width`` image."""
        frames = {} if self.frames is None else {"num_frames": self.frames, "temporal_factor": self.frames}
        bounds = {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}
        h, w = self.resize(height=height, width=width, factor=self.step, **bounds, **frames)
        return int(h), int(w)


_QWEN_IMAGE = "Qwen2VLImageProcessorPil"


def _qwen_steps(c: Any, pixels: dict[str, int]) -> ImageSteps:
    v = c.vision_config
    return ImageSteps(
        step=int(v.patch_size) * int(v.spatial_merge_size),
        max_pixels=pixels["max_pixels"],
        min_pixels=pixels["min_pixels"],
        resize=processor_resize(_QWEN_IMAGE),
    )


def _qwen_image(c: Any, min_pixels: int, max_pixels: int) -> dict[str, Any]:
    v = c.vision_config
    return {
        "patch_size": int(v.patch_size),
        "merge_size": int(v.spatial_merge_size),
        "temporal_patch_size": int(v.temporal_patch_size),
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }


_GLM4V_IMAGE = "Glm4vImageProcessorPil"


def _glm4v_steps(c: Any) -> ImageSteps:
    """GLM-4V's image processor's rounding (its own ``smart_resize``, as its ``resize`` calls it): each side in
    ``patch_size * merge_size`` steps (28 pixels), the image taken as ``temporal_patch_size`` frames bounded
    together by its class's ``size`` (``shortest_edge`` 12,544, ``longest_edge`` 11,760,000 pixels: what
    :func:`family_processor` builds it with)."""
    import transformers

    v = c.vision_config
    size = getattr(transformers, _GLM4V_IMAGE).size
    return ImageSteps(
        step=int(v.patch_size) * int(v.spatial_merge_size),
        max_pixels=int(size["longest_edge"]),
        min_pixels=int(size["shortest_edge"]),
        resize=processor_resize(_GLM4V_IMAGE),
        frames=int(v.temporal_patch_size),
    )


_QWEN_TOKENS: tuple[tuple[str | None, str, str | None], ...] = (
    ("image_token", "<|image_pad|>", "image_token_id"),
    ("video_token", "<|video_pad|>", "video_token_id"),
    (None, "<|vision_start|>", "vision_start_token_id"),
    (None, "<|vision_end|>", "vision_end_token_id"),
)
_QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen2-VL / Qwen2.5-VL's preprocessor_config.json: min_pixels 56*56, max_pixels 28*28*16384 (12,845,056)
_QWEN2 = {"min_pixels": 3136, "max_pixels": 12845056}
# Qwen3-VL / Qwen3.5's: size {"shortest_edge": 65536, "longest_edge": 16777216}
_QWEN3 = {"min_pixels": 65536, "max_pixels": 16777216}
# the video processors' pixel bounds as from_pretrained loads them: Qwen2-VL / Qwen2.5-VL ship no
# video_preprocessor_config.json, so transformers 5.23 reads preprocessor_config.json's (the image bounds, per
# frame; AutoProcessor.from_pretrained("Qwen/Qwen2.5-VL-7B-Instruct") prints size {3136, 12845056}); Qwen3-VL's
# video_preprocessor_config.json holds size {"shortest_edge": 4096, "longest_edge": 25165824} (the whole video).
# The classes' defaults (100,352-602,112 and 131,072-786,432) are neither.
_QWEN2_VIDEO = {"shortest_edge": _QWEN2["min_pixels"], "longest_edge": _QWEN2["max_pixels"]}
_QWEN3_VIDEO = {"shortest_edge": 4096, "longest_edge": 25165824}


def _qwen(
    name: str,
    processor: str,
    pixels: dict[str, int],
    video: str | None = None,
    video_size: dict[str, int] | None = None,
) -> VisionFamily:
    return VisionFamily(
        name=name,
        processor=processor,
        image_processor=_QWEN_IMAGE,
        tokens=_QWEN_TOKENS,
        placeholder=_QWEN_PLACEHOLDER,
        image_processor_kwargs=lambda c: _qwen_image(c, **pixels),
        tower_path="model.visual",
        projector_paths=("model.visual.merger", "model.visual.deepstack_merger_list"),
        pixels=True,
        image_steps=lambda c: _qwen_steps(c, pixels),
        video_processor=video,
        video_size=video_size,
        video_placeholder="<|vision_start|><|video_pad|><|vision_end|>",
    )


def _square(c: Any) -> dict[str, int]:
    side = _side(c.vision_config.image_size)
    return {"height": side, "width": side}


def _idefics_image(c: Any) -> dict[str, Any]:
    side = _side(c.vision_config.image_size)
    # the Hub's processors: longest edge 4 x the tower's image size (364 * 4 = 1456 for SmolVLM, 1820 = 5 * 364 for
    # Idefics3-8B: 4 here), each tile the tower's size
    return {"size": {"longest_edge": 4 * side}, "max_image_size": {"longest_edge": side}}


def _idefics_seq(c: Any) -> dict[str, Any]:
    v = c.vision_config
    return {"image_seq_len": (_side(v.image_size) // _side(v.patch_size)) ** 2 // int(c.scale_factor) ** 2}


_IDEFICS_TOKENS: tuple[tuple[str | None, str, str | None], ...] = (
    ("image_token", "<image>", "image_token_id"),
    ("fake_image_token", "<fake_token_around_image>", None),
    ("global_image_token", "<global-img>", None),
    ("end_of_utterance_token", "<end_of_utterance>", None),
    *((None, f"<row_{i + 1}_col_{j + 1}>", None) for i in range(6) for j in range(6)),
)

_LLAVA_TOKENS: tuple[tuple[str | None, str, str | None], ...] = (
    ("image_token", "<image>", "image_token_index"),
)


def _llava(c: Any) -> dict[str, Any]:
    v = c.vision_config
    return {
        "patch_size": int(v.patch_size),
        "vision_feature_select_strategy": c.vision_feature_select_strategy,
        "num_additional_image_tokens": 1,  # CLIP's class token (llava-hf's processor_config.json)
    }


def _clip_image(c: Any) -> dict[str, Any]:
    side = _side(c.vision_config.image_size)
    return {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}


_IDEFICS3 = VisionFamily(
    name="Idefics3",
    processor="Idefics3Processor",
    image_processor="Idefics3ImageProcessorPil",
    tokens=_IDEFICS_TOKENS,
    placeholder="<image>",
    image_processor_kwargs=_idefics_image,
    processor_kwargs=_idefics_seq,
    projector=("connector",),
    nested_images=True,
    tower_path="model.vision_model",
    projector_paths=("model.connector",),
)


VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_vl": _qwen("Qwen2-VL", "Qwen2VLProcessor", _QWEN2, "Qwen2VLVideoProcessor", _QWEN2_VIDEO),
    "qwen2_5_vl": _qwen("Qwen2.5-VL", "Qwen2_5_VLProcessor", _QWEN2, "Qwen2VLVideoProcessor", _QWEN2_VIDEO),
    "qwen3_vl": _qwen("Qwen3-VL", "Qwen3VLProcessor", _QWEN3, "Qwen3VLVideoProcessor", _QWEN3_VIDEO),
    "qwen3_vl_moe": _qwen("Qwen3-VL-MoE", "Qwen3VLProcessor", _QWEN3, "Qwen3VLVideoProcessor", _QWEN3_VIDEO),
    "qwen3_5": _qwen("Qwen3.5", "Qwen3VLProcessor", _QWEN3, "Qwen3VLVideoProcessor", _QWEN3_VIDEO),
    "qwen3_5_moe": _qwen("Qwen3.5-MoE", "Qwen3VLProcessor", _QWEN3, "Qwen3VLVideoProcessor", _QWEN3_VIDEO),
    "glm4v": VisionFamily(
        name="GLM-4V",
        processor="Glm4vProcessor",
        image_processor=_GLM4V_IMAGE,
        tokens=(
            ("image_token", "<|image|>", "image_token_id"),
            ("video_token", "<|video|>", "video_token_id"),
            (None, "<|begin_of_image|>", "image_start_token_id"),
            (None, "<|end_of_image|>", "image_end_token_id"),
            (None, "<|begin_of_video|>", "video_start_token_id"),
            (None, "<|end_of_video|>", "video_end_token_id"),
        ),
        placeholder="<|begin_of_image|><|image|><|end_of_image|>",
        image_processor_kwargs=lambda c: {
            "patch_size": int(c.vision_config.patch_size),
            "merge_size": int(c.vision_config.spatial_merge_size),
            "temporal_patch_size": int(c.vision_config.temporal_patch_size),
        },
        tower_path="model.visual",
        projector_paths=("model.visual.merger",),
        image_steps=_glm4v_steps,
        video_processor="Glm4vVideoProcessor",
        video_placeholder="<|begin_of_video|><|video|><|end_of_video|>",
        video_token=None,
        video_without_images="GLM-4V's model (Glm4vModel) finds the images' features by the image token, "
        "which its processor writes for the video's frames too (transformers: \"Image features and image "
        "tokens do not match\")",
    ),
    "gemma3": VisionFamily(
        name="Gemma 3",
        processor="Gemma3Processor",
        image_processor="Gemma3ImageProcessorPil",
        tokens=(
            ("image_token", "<image_soft_token>", "image_token_index"),
            ("boi_token", "<start_of_image>", "boi_token_index"),
            ("eoi_token", "<end_of_image>", "eoi_token_index"),
        ),
        placeholder="<start_of_image>",
        image_processor_kwargs=lambda c: {"size": _square(c)},
        processor_kwargs=lambda c: {"image_seq_length": int(c.mm_tokens_per_image)},
        call_options=("do_pan_and_scan",),
        nested_images=True,
        image_fit_hint=lambda config: (
            ""
            if config.pan_and_scan
            else "; with --pan-and-scan its processor adds crops to an image of aspect ratio 1.2 or more once it is "
            "large enough, more crops the larger and longer it is: search with it at such an --image-size"
        ),
    ),
    "paligemma": VisionFamily(
        name="PaliGemma",
        processor="PaliGemmaProcessor",
        image_processor="SiglipImageProcessorPil",
        tokens=(("image_token", "<image>", "image_token_index"), ("bos_token", "<bos>", None)),
        placeholder="<image>",
        image_processor_kwargs=lambda c: {"size": _square(c)},
    ),
    "llava": VisionFamily(
        name="LLaVA",
        processor="LlavaProcessor",
        image_processor="LlavaImageProcessorPil",
        tokens=_LLAVA_TOKENS,
        placeholder="<image>",
        image_processor_kwargs=_clip_image,
        processor_kwargs=_llava,
    ),
    "llava_next": VisionFamily(
        name="LLaVA-NeXT",
        processor="LlavaNextProcessor",
        image_processor="LlavaNextImageProcessorPil",
        tokens=_LLAVA_TOKENS,
        placeholder="<image>",
        image_processor_kwargs=lambda c: {**_clip_image(c), "image_grid_pinpoints": c.image_grid_pinpoints},
        processor_kwargs=_llava,
    ),
    "mistral3": VisionFamily(
        name="Mistral 3",
        processor="PixtralProcessor",
        image_processor="PixtralImageProcessorPil",
        tokens=(
            ("image_token", "[IMG]", "image_token_index"),
            ("image_break_token", "[IMG_BREAK]", None),
            ("image_end_token", "[IMG_END]", None),
        ),
        placeholder="[IMG]",
        image_processor_kwargs=lambda c: {
            "size": {"longest_edge": _side(c.vision_config.image_size)},
            "patch_size": {
                "height": int(c.vision_config.patch_size),
                "width": int(c.vision_config.patch_size),
            },
        },
        processor_kwargs=lambda c: {
            "patch_size": int(c.vision_config.patch_size),
            "spatial_merge_size": int(c.spatial_merge_size),
        },
        needs=("torchvision",),
    ),
    "mllama": VisionFamily(
        name="Mllama",
        processor="MllamaProcessor",
        image_processor="MllamaImageProcessorPil",
        tokens=(
            ("image_token", "<|image|>", "image_token_index"),
            (None, "<|python_tag|>", None),
            ("bos_token", "<|begin_of_text|>", None),
        ),
        placeholder="<|image|>",
        image_processor_kwargs=lambda c: {
            "size": _square(c),
            "max_image_tiles": int(c.vision_config.max_num_tiles),
        },
        nested_images=True,
        tower_path="model.vision_model",
    ),
    "idefics3": _IDEFICS3,
    # SmolVLM is Idefics3's architecture and processor under its own classes (its processor imports num2words)
    "smolvlm": dataclasses.replace(
        _IDEFICS3,
        name="SmolVLM",
        processor="SmolVLMProcessor",
        image_processor="SmolVLMImageProcessorPil",
        needs=("num2words",),
        video_processor="SmolVLMVideoProcessor",
        video_placeholder="<video>",
        video_token=None,
        video_processor_kwargs=_idefics_image,  # (frames resized as the images are, to the tower's size)
        video_without_images=(
            "SmolVLM's processor returns a video's frames as pixel_values, the images' own name"
        ),
    ),
    "internvl": VisionFamily(
        name="InternVL",
        processor="InternVLProcessor",
        image_processor="GotOcr2ImageProcessorPil",
        tokens=(
            ("context_image_token", "<IMG_CONTEXT>", "image_token_id"),
            ("start_image_token", "<img>", None),
            ("end_image_token", "</img>", None),
            ("video_token", "<video>", None),
        ),
        placeholder="<IMG_CONTEXT>",
        image_processor_kwargs=lambda c: {"size": _square(c), "crop_to_patches": True},
        video_processor="InternVLVideoProcessor",
        video_placeholder="<video>",
        video_token=None,
        # frames resized to the tower's image size, as its image tiles are (the class default: 384x384)
        video_processor_kwargs=lambda c: {"size": _square(c)},
        processor_kwargs=lambda c: {
            "image_seq_length": int(
                (_side(c.vision_config.image_size) // _side(c.vision_config.patch_size)) ** 2
                * float(c.downsample_ratio) ** 2
            )
        },
    ),
}
"""Every vision-language ``model_type`` vramguard builds rows for, by its processor (the Hub's processor of the
family's reference checkpoints: Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen3-VL-8B-Instruct, google/gemma-3-4b-it,
llava-hf/llava-1.5-7b-hf, llava-hf/llava-v1.6-mistral-7b-hf, meta-llama/Llama-3.2-11B-Vision, HuggingFaceM4/Idefics3-8B-Llama3,
HuggingFaceTB/SmolVLM-Instruct, google/paligemma-3b-pt-224, mistralai/Mistral-Small-3.1-24B-Instruct-2503,
OpenGVLab/InternVL3-1B-hf, THUDM/GLM-4.1V-9B-Thinking)."""

VIDEO_ATTRIBUTES = ("video_processor",)


def is_vision_config(data: dict[str, Any]) -> bool:
    """Whether a ``config.json`` dict is a vision-language model's: it has a ``vision_config``, or its
    ``model_type`` is one of :data:`VISION_FAMILIES`."""
    return isinstance(data.get("vision_config"), dict) or data.get("model_type") in VISION_FAMILIES


def family_of(model_type: str) -> VisionFamily:
    """The :class:`VisionFamily` of ``model_type`` (UsageError naming the known ones when there is none)."""
    try:
        return VISION_FAMILIES[model_type]
    except KeyError:
        raise UsageError(
            f"model_type {model_type!r} is a vision-language model vramguard makes no image inputs for "
            f"(known: {', '.join(sorted(VISION_FAMILIES))})"
        ) from None


@dataclass(frozen=True)
class VisionShape:
    """The shapes of a vision-language config: its language model's (``text``, the fields a text model's
    :class:`~vramguard.workload.models.ModelSpec` has) and its vision tower's (``vision``: layers, hidden size,
    heads, patch size)."""

    model_type: str
    text: dict[str, Any]
    vision: dict[str, int]


_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_VISION_KEYS = {
    "layers": ("depth", "num_hidden_layers"),
    "hidden_size": ("hidden_size", "embed_dim"),
    "heads": ("num_heads", "num_attention_heads", "attention_heads"),
    "patch_size": ("patch_size",),
}


def vision_shape(path: Path | str, config: Any) -> VisionShape:
    """The :class:`VisionShape` of a transformers vision-language config; a missing or non-positive size is a
    one-line UsageError naming the sub-config and key (never the text model's ``vocab_size ... None``)."""
    text = config.get_text_config(decoder=True)
    vision = getattr(config, "vision_config", None)
    if text is None or text is config or vision is None:
        raise UsageError(f"model config {path}: a vision-language config needs text_config and vision_config")
    fields: dict[str, Any] = {}
    for key in _TEXT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UsageError(
                f"model config {path}: text_config.{key} must be a positive integer, got {value!r}"
            )
        fields[key] = value
    kv = getattr(text, "num_key_value_heads", None) or fields["num_attention_heads"]
    fields["num_key_value_heads"] = kv
    head_dim = getattr(text, "head_dim", None) or fields["hidden_size"] // fields["num_attention_heads"]
    fields["head_dim"] = head_dim
    fields["tie_word_embeddings"] = bool(getattr(config, "tie_word_embeddings", False))
    shapes: dict[str, int] = {}
    for key, names in _VISION_KEYS.items():
        value = _get(vision, *names)
        value = _side(value) if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UsageError(
                f"model config {path}: vision_config.{names[0]} must be a positive integer, got {value!r}"
            )
        shapes[key] = value
    return VisionShape(model_type=config.model_type, text=fields, vision=shapes)


def image_text_class(hf_config: Any) -> Any:
    """The ``AutoModelForImageTextToText`` class of a transformers config (UsageError when there is none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    try:
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(hf_config)]
    except KeyError:
        raise UsageError(
            f"model_type {hf_config.model_type!r} has no image-text-to-text model class in transformers"
        ) from None


_SIZE = re.compile(r"\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*")


def parse_image_size(text: str) -> tuple[int, int]:
    """``HxW`` (height by width, in pixels) as ``(height, width)``; anything else is a UsageError."""
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise UsageError(f"image size must be HxW in pixels (e.g. 448x448), got {text!r}")
    h, w = int(m.group(1)), int(m.group(2))
    if not (0 < h <= MAX_IMAGE_SIDE and 0 < w <= MAX_IMAGE_SIDE):
        raise UsageError(f"image size sides must be between 1 and {MAX_IMAGE_SIDE} pixels, got {h}x{w}")
    return h, w


FILLER = "w"
"""The one word of text the rows are filled with (a token of its own in :func:`row_tokenizer`)."""


def token_ids(family: VisionFamily, hf_config: Any, vocab_size: int) -> dict[str, int]:
    """The id of every special token the family's processor writes: the model config's where it names one
    (``image_token_id``, ``vision_start_token_id``, ...), else a free id counted down from the vocabulary's end.
    Ids 0 and 1 are the tokenizer's unknown token and :data:`FILLER`."""
    ids: dict[str, int] = {}
    for _attr, text, key in family.tokens:
        if key is not None:
            value = getattr(hf_config, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if not 2 <= value < vocab_size:
                    raise UsageError(
                        f"{family.name} config: {key} {value} is outside the language model's vocabulary "
                        f"(2 to {vocab_size - 1} here)"
                    )
                if value in ids.values():
                    raise UsageError(f"{family.name} config: {key} {value} is another special token's id too")
                ids[text] = value
    free = vocab_size - 1
    for _attr, text, _key in family.tokens:
        if text in ids:
            continue
        while free in ids.values():
            free -= 1
        if free < 2:
            raise UsageError(
                f"{family.name} config: the vocabulary is too small for the processor's special tokens"
            )
        ids[text] = free
        free -= 1
    return ids


IMAGE_TOKEN_ATTRIBUTES = ("image_token", "context_image_token")
"""The tokenizer attribute of the token an image's features replace (InternVL calls it the context token; Gemma 3's
processor names ``boi_token`` its ``image_token``, but the features go in its tokenizer's ``image_token``)."""


def image_token_id(family: VisionFamily, hf_config: Any, vocab_size: int) -> int:
    """The id of the token whose positions take the image features (what the model config names)."""
    text = next(text for attr, text, _ in family.tokens if attr in IMAGE_TOKEN_ATTRIBUTES)
    return token_ids(family, hf_config, vocab_size)[text]


def row_tokenizer(family: VisionFamily, ids: dict[str, int]) -> Any:
    """A word-level tokenizer (the ``tokenizers`` library's, wrapped as transformers' fast tokenizer) whose
    special tokens are the family's, with ``ids``, and the attributes its processor reads (``image_token``,
    ``boi_token``, ...); every other word is one token (:data:`FILLER`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, FILLER: 1, **ids}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    named = {
        attr: text
        for attr, text, _key in family.tokens
        if attr is not None and not attr.endswith("bos_token")
    }
    extra: dict[str, Any] = {}
    bos = next((text for attr, text, _ in family.tokens if attr == "bos_token"), None)
    if bos is not None:
        extra["bos_token"] = bos
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", extra_special_tokens=named, **extra
    )
    tok.add_special_tokens({"additional_special_tokens": [t for t in ids if t != bos]})
    return tok


def _without_video(cls: type) -> type:
    """``cls`` (a processor class) without its video sub-processor: transformers' video processors need
    torchvision, and no image row reads them. Everything else (the image processor, the placeholder
    expansion, the token type ids) is ``cls``'s own code. A video slot ``cls.__init__`` requires (SmolVLM's
    ``video_processor`` has no default) is given None: ``ProcessorMixin`` pairs its arguments with the
    attributes left, so the None is dropped."""
    import inspect

    from transformers.processing_utils import ProcessorMixin

    attributes = [a for a in cls.get_attributes() if a not in VIDEO_ATTRIBUTES]
    if attributes == cls.get_attributes():
        return cls
    params = inspect.signature(cls.__init__).parameters
    empty = inspect.Parameter.empty
    required = {a: None for a in VIDEO_ATTRIBUTES if a in params and params[a].default is empty}

    class ImageOnly(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **required, **kwargs)

        @classmethod
        def get_attributes(klass) -> list[str]:
            return attributes

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    assert issubclass(ImageOnly, ProcessorMixin)
    return ImageOnly


def video_refusal(family: VisionFamily) -> str | None:
    """Why ``family``'s rows cannot take a video (one line), None when they can: its processor takes no video
    in the installed transformers (no ``video_processor`` attribute), or takes one that vramguard does not
    make yet."""
    import transformers

    if family.video_processor is not None:
        return None
    try:
        takes = "video_processor" in getattr(transformers, family.processor).get_attributes()
    except ImportError:  # transformers' placeholder of a processor whose package is missing (Pixtral's)
        return f"video frames: {family.name}'s processor ({family.processor}) needs {', '.join(family.needs)}"
    if takes:
        done = ", ".join(f.name for f in VISION_FAMILIES.values() if f.video_processor is not None)
        return (
            f"video frames: {family.name}'s processor ({family.processor}) takes video, but vramguard does "
            f"not make its video rows yet (done: {done})"
        )
    return (
        f"video frames: {family.name} takes no video in transformers {transformers.__version__} "
        f"({family.processor} has no video processor)"
    )


def _video_processor(family: VisionFamily, hf_config: Any) -> Any:
    """The family's video processor with its :attr:`VisionFamily.video_processor_kwargs` (InternVL's and SmolVLM's
    frame sizes), or else the tower's patch, merge and temporal patch sizes and the pixel bounds users load from
    the Hub (:attr:`VisionFamily.video_size`; 2 frames a temporal patch); torchvision missing is a one-line
    UsageError naming the way out."""
    import importlib.util

    import transformers

    refusal = video_refusal(family)
    if refusal is not None:
        raise UsageError(refusal)
    if importlib.util.find_spec("torchvision") is None:
        raise UsageError(
            f"{family.name}'s video processor ({family.video_processor}) needs the torchvision package: pip "
            "install torchvision, a build matching this torch (e.g. torch 2.14.1 with torchvision 0.29.1)"
        )
    if family.video_processor_kwargs is not None:
        return getattr(transformers, family.video_processor)(**family.video_processor_kwargs(hf_config))
    v = hf_config.vision_config
    size = {"size": dict(family.video_size)} if family.video_size is not None else {}
    return getattr(transformers, family.video_processor)(
        patch_size=int(v.patch_size),
        merge_size=int(v.spatial_merge_size),
        temporal_patch_size=int(v.temporal_patch_size),
        **size,
    )


def family_processor(
    family: VisionFamily,
    hf_config: Any,
    vocab_size: int,
    pixels: dict[str, int] | None = None,
    video: bool = False,
) -> Any:
    """The family's processor for ``hf_config``: its own processor and image processor classes, with the
    settings its Hub checkpoints' processor files hold (:class:`VisionFamily`), and :func:`row_tokenizer`.
    ``pixels``: ``min_pixels`` / ``max_pixels`` given to the image processor as users pass them to
    ``AutoProcessor.from_pretrained`` (Qwen's families; they replace its ``size`` bounds); the family's
    :attr:`VisionFamily.call_options` among them (``do_pan_and_scan``) are kept for every call of the
    processor (:func:`_process`), as users pass them to ``processor(...)``. ``video``: with the family's video
    processor (:func:`_video_processor`; without it the processor class is built without its video slot)."""
    import importlib.util

    import transformers

    for package in family.needs:
        if importlib.util.find_spec(package) is None:
            raise UsageError(
                f"{family.name}'s processor ({family.processor}) needs the {package} package: pip install {package}"
            )
    ids = token_ids(family, hf_config, vocab_size)
    image_cls = getattr(transformers, family.image_processor)
    processor_cls = getattr(transformers, family.processor)
    videos = {"video_processor": _video_processor(family, hf_config)} if video else {}
    if not video:
        processor_cls = _without_video(processor_cls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = {k: v for k, v in (pixels or {}).items() if k in family.call_options}
        bounds = {k: v for k, v in (pixels or {}).items() if k not in calls}
        image_processor = image_cls(**family.image_processor_kwargs(hf_config), **bounds)
        if family.processor == "PaliGemmaProcessor":  # its processor reads the count off the image processor
            v = hf_config.vision_config
            image_processor.image_seq_length = (_side(v.image_size) // _side(v.patch_size)) ** 2
        processor = processor_cls(
            image_processor=image_processor,
            tokenizer=row_tokenizer(family, ids),
            **videos,
            **family.processor_kwargs(hf_config),
        )
    processor.vramguard_call_options = calls  # read by _process
    return processor


def synthetic_image(height: int, width: int, seed: int) -> Any:
    """An RGB PIL image of ``height`` x ``width`` pixels of noise, deterministic in ``seed``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed % (1 << 63))
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


MAX_VIDEO_FRAMES = 768
"""The most frames ``--video-frames`` takes (Qwen's video processors' ``max_frames``)."""

MAX_VIDEO_PIXELS = 2**28
"""The most pixels a row's video may hold (frames x height x width: 268,435,456, e.g. 64 frames of 2048x2048): its
frames are made on the host and handed to the processor, which takes them as floats (4 bytes a channel), so a video
beyond this is refused before anything is made rather than ending the host's memory (review: 768 frames of
4096x4096 ended in a MemoryError)."""

VIDEO_FPS = 2.0
"""The rate the row's frames were sampled at, as the video metadata tells the processor (Qwen3-VL's video
processor's ``fps``: it writes each temporal patch's timestamp, ``<1.0 seconds>``, into the prompt from it;
Qwen2.5-VL's ``second_per_grid_ts`` is ``temporal_patch_size / fps``)."""


@dataclass(frozen=True)
class VideoAsk:
    """A row's video: ``frames`` frames of ``size`` (height, width) pixels, already sampled (the processor is
    called with ``do_sample_frames=False`` and metadata of :data:`VIDEO_FPS`, as users pass frames they
    sampled); the family's video processor resizes them and groups them 2 a temporal patch (an odd count: the
    last frame repeated)."""

    frames: int
    size: tuple[int, int]

    def video(self, seed: int) -> Any:
        """The frames, noise deterministic in ``seed``: a ``(frames, height, width, 3)`` uint8 array."""
        import numpy as np

        rng = np.random.default_rng(seed % (1 << 63))
        return rng.integers(0, 256, (self.frames, *self.size, 3), dtype=np.uint8)

    def text(self) -> str:
        """The video in words (the rows' note, an overflow's message)."""
        h, w = self.size
        return f"a video of {self.frames} frame{'' if self.frames == 1 else 's'} of {h}x{w}"


def _what_to_lower(video: Any) -> str:
    """What a row too long for ``--seq-len`` can lower: the image size, or a video's frame count (a frame below the
    video processor's minimum pixels is enlarged: a smaller one takes as many tokens)."""
    if not video:
        return "image size"
    return "frame count (frames below the video processor's minimum pixels are enlarged)"


def video_ask(config: Any) -> VideoAsk | None:
    """The :class:`VideoAsk` of a :class:`~vramguard.workload.models.QLoRAConfig` (``video_frames``,
    ``video_size``), None without one."""
    if not config.video_frames:
        return None
    return VideoAsk(frames=config.video_frames, size=parse_image_size(config.video_size))


@dataclass
class ImageRows:
    """A batch of vision-language rows as the family's processor made them, with how many tokens each image took."""

    inputs: dict[str, Any]
    image_tokens: int
    """Placeholder tokens of the row's images (the image token's count in one row)."""
    text_tokens: int
    video_tokens: int = 0
    """Placeholder tokens of the row's video (the video token's count in one row)."""

    @property
    def layout(self) -> str:
        """The image inputs the processor made, by name and shape (Qwen's grid by value)."""
        parts = []
        for k, v in self.inputs.items():
            if k in _ROW_KEYS or not isinstance(v, torch.Tensor):
                continue
            parts.append(
                f"{k} {v.tolist()}" if k.endswith("grid_thw") else f"{k} {'x'.join(map(str, v.shape))}"
            )
        return ", ".join(parts) or "no image inputs"


_ROW_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids")


def _video_options(processor: Any, videos: list[Any] | None) -> dict[str, Any]:
    """The processor call's video options: the frames as given (no sampling), their metadata at
    :data:`VIDEO_FPS`, the frames' layout (channels last, as :meth:`VideoAsk.video` makes them: a frame 1 or
    3 pixels high would otherwise be read as channels first), and where the video processor has one
    (Qwen3-VL's) the per-frame pixel bound of transformers 5.23's default (``cap_pixels_per_frame`` False,
    said so to silence its warning; another video processor warns of it as an argument it ignores)."""
    if not videos:
        return {}
    metadata = [
        {"fps": VIDEO_FPS, "total_num_frames": len(v), "frames_indices": list(range(len(v)))} for v in videos
    ]
    cap = {"cap_pixels_per_frame": False} if hasattr(processor.video_processor, "cap_pixels_per_frame") else {}
    return {
        "videos": videos,
        "do_sample_frames": False,
        "video_metadata": metadata,
        "input_data_format": "channels_last",
        **cap,
    }


def _process(
    processor: Any, images: list[Any] | None, texts: list[str], videos: list[Any] | None = None
) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            options = getattr(processor, "vramguard_call_options", {})
            options = {**options, **_video_options(processor, videos)}
            return dict(processor(images=images, text=texts, return_tensors="pt", **options))
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            what = "these videos" if videos else "these images" if images else "text-only rows"
            raise UsageError(f"{type(processor).__name__} refuses {what}: {first_line(exc)}") from None


def _tokens_of(
    processor: Any,
    ids: tuple[int, ...],
    prompt: str,
    images: list[Any] | None,
    videos: list[Any] | None = None,
) -> tuple[int, ...]:
    """(tokens a row of ``prompt`` with its images and videos takes, then the count of each of ``ids`` among
    them), as ``processor`` expands it."""
    bare = _process(processor, images, [prompt], videos)["input_ids"]
    return (int(bare.shape[-1]), *(int((bare == i).sum()) for i in ids))


def _media_tokens(
    family: VisionFamily, processor: Any, ids: tuple[int, ...], prompt: str, media: tuple[Any, Any]
) -> tuple[int, int, list[int]]:
    """(tokens of a row of ``prompt`` with ``media``, its images' tokens, its video's tokens as a list: one count
    with a video, none without), as ``processor`` expands them. Where the video's frames take the image token
    (:attr:`VisionFamily.video_token` None) the images' own are counted by the processor on the row without the
    video."""
    used, image_tokens, *video_tokens = _tokens_of(processor, ids, prompt, *media)
    if media[1] and family.video_token is None:
        alone = 0
        if media[0]:
            alone = _tokens_of(processor, ids, prompt.replace(family.video_placeholder, ""), media[0])[1]
        image_tokens, video_tokens = alone, [image_tokens - alone]
    return used, image_tokens, video_tokens


def row_tokens(
    family: VisionFamily,
    hf_config: Any,
    vocab_size: int,
    image_size: tuple[int, int],
    images_per_row: int = 1,
    pixels: dict[str, int] | None = None,
) -> tuple[int, int]:
    """(tokens ``images_per_row`` images of ``image_size`` take in a row with their markers, image tokens among
    them), as the family's processor expands them (``pixels``: its ``min_pixels`` / ``max_pixels``,
    :func:`family_processor`): the least ``--seq-len`` that holds them."""
    processor = family_processor(family, hf_config, vocab_size, pixels)
    image_id = image_token_id(family, hf_config, vocab_size)
    prompt = family.placeholder * images_per_row
    images = [synthetic_image(*image_size, 0)] * images_per_row
    used, image_tokens = _tokens_of(processor, (image_id,), prompt, images)
    return used, image_tokens


def image_rows(
    family: VisionFamily,
    hf_config: Any,
    vocab_size: int,
    image_size: tuple[int, int] | None,
    seq_len: int,
    batch: int = 1,
    images_per_row: int = 1,
    seed: int = 0,
    pixels: dict[str, int] | None = None,
    video: VideoAsk | None = None,
) -> ImageRows:
    """``batch`` rows of exactly ``seq_len`` tokens each (``--seq-len`` is the whole row, image tokens included,
    as TRL's ``max_length`` counts it): ``images_per_row`` images of ``image_size`` (height, width), each as the
    family's processor expands it, and ``video`` (its frames, :class:`VideoAsk`) as its video processor makes
    it, then :data:`FILLER` text to the row's length. Made by the family's processor: its ``input_ids`` and
    ``attention_mask``, every image and video input its forward reads, and ``labels`` (the ``input_ids``, the
    image and video tokens masked with -100 as TRL's vision collator masks them). A row the images alone
    overflow is a UsageError naming their token count. ``image_size`` and ``video`` None: text-only rows (no
    image inputs). ``pixels``: the image processor's ``min_pixels`` / ``max_pixels``
    (:func:`family_processor`)."""
    if image_size is not None and video is not None and family.video_without_images:
        raise UsageError(
            f"{family.video_without_images}, so a row cannot hold both: give --image-size or --video-frames"
        )
    processor = family_processor(family, hf_config, vocab_size, pixels, video=video is not None)
    image_id = image_token_id(family, hf_config, vocab_size)
    if image_size is None and video is None:  # what the processor adds to a text (PaliGemma's bos) counts too
        extra = int(_process(processor, None, [FILLER])["input_ids"].shape[-1]) - 1
        if seq_len <= extra:
            raise UsageError(f"{family.name}'s processor adds {extra} tokens to a row: seq-len must be more")
        inputs = _process(processor, None, [" ".join([FILLER] * (seq_len - extra))] * batch)
        inputs["labels"] = inputs["input_ids"].clone()
        return ImageRows(inputs=inputs, image_tokens=0, text_tokens=int(inputs["input_ids"].shape[-1]))
    if image_size is None:
        images_per_row = 0
    elif not 0 < images_per_row <= MAX_IMAGES_PER_ROW:
        raise UsageError(f"images per row must be between 1 and {MAX_IMAGES_PER_ROW}, got {images_per_row}")
    ids = (image_id,)
    if video is not None and family.video_token is not None:
        ids += (token_ids(family, hf_config, vocab_size)[family.video_token],)
    prompt = family.placeholder * images_per_row + (family.video_placeholder if video else "")
    used, image_tokens, video_tokens = _media_tokens(
        family, processor, ids, prompt, _media(image_size, images_per_row, video, seed)
    )
    if used > seq_len:
        raise UsageError(
            f"{_asked(image_size, images_per_row, video)} take {used} tokens in {family.name}'s rows "
            f"({', '.join(_counted(image_tokens, video_tokens))}), more than seq-len "
            f"{seq_len}: raise seq-len or lower the {_what_to_lower(video)}"
        )
    text = prompt + (" " + " ".join([FILLER] * (seq_len - used)) if seq_len > used else "")
    media = [_media(image_size, images_per_row, video, seed + b) for b in range(batch)]
    images = [i for m in media for i in (m[0] or [])] or None
    if images and family.nested_images:
        images = [images[b * images_per_row : (b + 1) * images_per_row] for b in range(batch)]
    inputs = _process(processor, images, [text] * batch, [v for m in media for v in (m[1] or [])] or None)
    got = int(inputs["input_ids"].shape[-1])
    if (
        got != seq_len
    ):  # the processor's own rows must come out as asked: a check of this code, not of the user's
        raise UsageError(f"{family.name}'s processor made rows of {got} tokens for seq-len {seq_len}")
    inputs.pop("video_metadata", None)  # (the processor's record of the call, no model input)
    labels = inputs["input_ids"].clone()
    for i in ids:
        labels[labels == i] = -100
    inputs["labels"] = labels
    spent = image_tokens + sum(video_tokens)
    return ImageRows(
        inputs=inputs, image_tokens=image_tokens, text_tokens=seq_len - spent, video_tokens=sum(video_tokens)
    )


def _media(
    image_size: tuple[int, int] | None, images_per_row: int, video: VideoAsk | None, seed: int
) -> tuple[list[Any] | None, list[Any] | None]:
    """(a row's images, its videos) of noise deterministic in ``seed``; None for none."""
    images = [synthetic_image(*image_size, seed)] * images_per_row if image_size else None
    return images, [video.video(seed)] if video else None


def _counted(image_tokens: int, video_tokens: list[int]) -> list[str]:
    """The placeholder tokens a row's images and video take, in words (those of what the row holds)."""
    counts = [f"{image_tokens} image tokens"] if image_tokens or not video_tokens else []
    return counts + [f"{n} video tokens" for n in video_tokens]


def _asked(image_size: tuple[int, int] | None, images_per_row: int, video: VideoAsk | None) -> str:
    """What a row holds, in words (the overflow message's subject)."""
    parts = [f"{images_per_row} image(s) of {image_size[0]}x{image_size[1]}"] if image_size else []
    return " and ".join(parts + ([video.text()] if video else []))


@dataclass
class VisionQLoRAModel:
    """A PEFT-wrapped 4-bit vision-language model (:func:`build_vision_qlora`) with the rows it trains on: a
    :class:`~vramguard.workload.models.QLoRAModel` whose :meth:`batch` is the family processor's image rows."""

    q: Any  # the QLoRAModel
    family: VisionFamily
    rows: ImageRows
    image_size: tuple[int, int] | None
    images_per_row: int


def load_vision_config(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """(the transformers config, the ``config.json`` dict) of a vision-language config file; a file that is no
    vision-language config transformers knows is a one-line UsageError."""
    import json

    from vramguard.workload.families import transformers_config
    from vramguard.workload.models import MAX_CONFIG_BYTES, read_at_most

    try:
        data = json.loads(read_at_most(Path(path), MAX_CONFIG_BYTES + 1).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(f"cannot read model config {path}: {first_line(exc)}") from None
    if not isinstance(data, dict) or not is_vision_config(data):
        raise UsageError(f"model config {path} is no vision-language config (no vision_config)")
    try:
        config = transformers_config(data)
    except Exception as exc:  # noqa: BLE001  (transformers' own validation, one line)
        raise UsageError(f"model config {path}: {first_line(exc)}") from None
    return config, data


TOWER_DTYPES = ("4bit", "unquantized")
"""``vision_tower``: the tower's linear layers 4-bit (what ``load_in_4bit`` alone does) or left out of the
quantization (its qualified name added to ``BitsAndBytesConfig(llm_int8_skip_modules=...)``)."""

LORA_SCOPES = ("all", "language-model", "language-model+projector")
"""``lora_scope``: where the target modules get LoRA: everywhere they match (``all``, PEFT's own rule: the tower
too), in the language model only (the tower and projector frozen, as most VLM recipes do: ms-swift's
``freeze_vit``, LLaMA-Factory's ``freeze_vision_tower``, Unsloth's ``finetune_vision_layers=False``), or in the
language model and the projector. Done with PEFT's ``exclude_modules`` regex of the tower's (and projector's)
qualified names."""


@dataclass(frozen=True)
class TowerChoices:
    """The vision tower's choices of one run, resolved and validated once (:func:`tower_choices`) and passed to
    both builds: ``skip_modules``, the ``llm_int8_skip_modules`` list given to ``BitsAndBytesConfig`` (None:
    transformers' default, which keeps ``lm_head`` only); ``exclude_modules``, PEFT's ``exclude_modules`` regex
    (None: none); ``tower_checkpointing``: with gradient checkpointing, whether the tower's layers stay
    checkpointed (transformers' ``gradient_checkpointing_enable`` sets every layer's flag, the tower's too; off:
    the tower's flags cleared after it, as a user's loop over ``model.visual.modules()`` does)."""

    vision_tower: str
    skip_modules: tuple[str, ...] | None
    lora_scope: str
    exclude_modules: str | None
    tower_checkpointing: bool
    modules_to_save: tuple[str, ...] | None = None
    """PEFT's ``modules_to_save``: the projector trained whole (``train_projector``), None: nothing."""

    @property
    def is_default(self) -> bool:
        """Whether every choice is the usual recipe's (4-bit tower, LoRA where the targets match, checkpointed)."""
        return (
            self.skip_modules is None
            and self.exclude_modules is None
            and self.tower_checkpointing
            and self.modules_to_save is None
        )


def _split(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def tower_choices(config: Any, family: VisionFamily) -> TowerChoices:
    """The :class:`TowerChoices` of ``config`` (a :class:`~vramguard.workload.models.QLoRAConfig`) for
    ``family``: ``vision_tower unquantized`` adds the family's tower name to ``llm_int8_skip_modules`` (with
    ``lm_head`` when the list was empty: a list replaces transformers' default skips, and the default keeps the
    output layer); ``lora_scope`` is PEFT's ``exclude_modules`` regex of the tower (and the projector);
    ``train_projector`` trains the projector whole (PEFT's ``modules_to_save``), so it is left unquantized
    (bitsandbytes' 4-bit weights cannot take gradients) and without LoRA."""
    skip = _split(config.llm_int8_skip_modules)
    projector = family.projector_paths[:1]  # (Qwen3-VL's deepstack mergers, a ModuleList, stay as they are)
    if config.vision_tower == "unquantized":
        skip = tuple(dict.fromkeys((*(skip or ("lm_head",)), family.tower_path)))
    if config.train_projector:
        if config.lora_scope == "language-model+projector":
            raise UsageError("train-projector trains the projector whole: it takes no LoRA (lora-scope language-model)")
        skip = tuple(dict.fromkeys((*(skip or ("lm_head",)), *projector)))
    inside = tuple(p for p in family.projector_paths if p.startswith(family.tower_path + "."))
    outside = tuple(p for p in family.projector_paths if p not in inside)
    excluded: tuple[str, ...] = projector if config.train_projector else ()
    kept: tuple[str, ...] = ()
    if config.lora_scope == "language-model":
        excluded = (family.tower_path, *outside)
    elif config.lora_scope == "language-model+projector":
        excluded, kept = (family.tower_path,), inside
    exclude = None
    if excluded:
        keep = f"(?!(?:{'|'.join(re.escape(p) for p in kept)})\\.)" if kept else ""
        exclude = f"{keep}(?:{'|'.join(re.escape(p) for p in excluded)})\\..*"
    return TowerChoices(
        vision_tower=config.vision_tower,
        skip_modules=skip or None,
        lora_scope=config.lora_scope,
        exclude_modules=exclude,
        tower_checkpointing=config.tower_checkpointing,
        modules_to_save=projector if config.train_projector else None,
    )


def validate_tower_options(config: Any) -> None:
    """The vision options' values (one line each): called by ``QLoRAConfig.validate``."""
    if config.vision_tower not in TOWER_DTYPES:
        raise UsageError(f"vision-tower must be one of {', '.join(TOWER_DTYPES)}, got {config.vision_tower!r}")
    if config.lora_scope not in LORA_SCOPES:
        raise UsageError(f"lora-scope must be one of {', '.join(LORA_SCOPES)}, got {config.lora_scope!r}")
    for name in ("tower_checkpointing", "train_projector", "pan_and_scan"):
        if not isinstance(getattr(config, name), bool):
            raise UsageError(f"{name.replace('_', '-')} must be true or false, got {getattr(config, name)!r}")
    skip = config.llm_int8_skip_modules
    if not isinstance(skip, str) or any(not _SKIP_NAME.fullmatch(n) for n in _split(skip)):
        raise UsageError(
            f"llm-int8-skip-modules must be comma-separated module names or patterns, got {skip!r}"
        )
    for name in ("min_pixels", "max_pixels"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PIXELS:
            raise UsageError(f"{name.replace('_', '-')} must be an integer from 1 to {MAX_PIXELS:,}, got {value!r}")
    if config.min_pixels and config.max_pixels and config.min_pixels > config.max_pixels:
        raise UsageError(f"min-pixels {config.min_pixels:,} is more than max-pixels {config.max_pixels:,}")
    frames, size = config.video_frames, config.video_size
    if isinstance(frames, bool) or not isinstance(frames, int) or not 0 <= frames <= MAX_VIDEO_FRAMES:
        raise UsageError(f"video-frames must be an integer from 1 to {MAX_VIDEO_FRAMES}, got {frames!r}")
    if not isinstance(size, str) or bool(frames) != bool(size):
        raise UsageError("video-frames and video-size go together: N frames of HxW pixels each")
    if size:
        try:
            height, width = parse_image_size(size)
        except UsageError as exc:
            raise UsageError(f"video-size: {exc}") from None
        if frames * height * width > MAX_VIDEO_PIXELS:
            raise UsageError(
                f"a video of {frames} frames of {size} is {frames * height * width:,} pixels, more than the "
                f"{MAX_VIDEO_PIXELS:,} vramguard makes on the host for the processor: lower the frames or their size "
                "(Qwen's processors shrink large frames anyway)"
            )


_SKIP_NAME = re.compile(r"[A-Za-z0-9_.\-*+?()|\[\]^$\\]+")
MAX_PIXELS = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE

TOWER_FIELDS = (
    "vision_tower",
    "llm_int8_skip_modules",
    "lora_scope",
    "tower_checkpointing",
    "train_projector",
    "min_pixels",
    "max_pixels",
    "pan_and_scan",
    "video_frames",
    "video_size",
)
"""The :class:`~vramguard.workload.models.QLoRAConfig` fields of a vision-language model's tower and processor:
recorded in the JSON document only where they differ from their defaults; a text model given one is refused."""


def pixel_bounds(config: Any) -> dict[str, int]:
    """The image processor's ``min_pixels`` / ``max_pixels`` the config sets (``--min-pixels``, ``--max-pixels``;
    none: the processor's own), as users pass them to ``AutoProcessor.from_pretrained``."""
    return {k: getattr(config, k) for k in ("min_pixels", "max_pixels") if getattr(config, k)}


def processor_options(config: Any, family: VisionFamily) -> dict[str, Any]:
    """What the config tells the family's processor (:func:`family_processor`'s ``pixels``): its
    ``min_pixels`` / ``max_pixels`` (:func:`pixel_bounds`) and ``do_pan_and_scan`` (``--pan-and-scan``); one the
    family's processor does not take is a one-line UsageError."""
    pixels: dict[str, Any] = pixel_bounds(config)
    if pixels and not family.pixels:
        raise UsageError(f"min-pixels / max-pixels bound Qwen's processors; {family.name}'s takes no such bound")
    if config.pan_and_scan:
        if "do_pan_and_scan" not in family.call_options:
            raise UsageError(f"pan-and-scan is Gemma 3's processor's; {family.name}'s has none")
        pixels["do_pan_and_scan"] = True
    return pixels


def refuse_tower_options(config: Any) -> None:
    """A text model given a vision-tower option: one line naming it."""
    from dataclasses import fields

    defaults = {f.name: f.default for f in fields(config)}
    given = [n.replace("_", "-") for n in TOWER_FIELDS if getattr(config, n) != defaults[n]]
    if given:
        raise UsageError(f"{', '.join(given)}: options of a vision-language model, and this model has no vision tower")


def tower_line(model: torch.nn.Module, family: VisionFamily, choices: TowerChoices, config: Any) -> str:
    """What the built model's vision tower, projector and language model really are, per stack: linear layers
    4-bit or unquantized (with their dtype after PEFT's k-bit preparation), layers with LoRA, trainable
    parameters, and with gradient checkpointing how many checkpointing layers are on (a tower with none cannot
    be checkpointed by transformers: said so). ``config``: the run's QLoRAConfig (its targets, checkpointing)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    checkpointing, targets = config.gradient_checkpointing, config.target_modules
    from vramguard.units import format_bytes
    from vramguard.workload.models import storage_bytes_of

    counts: dict[str, dict[str, Any]] = {
        s: {"4bit": 0, "plain": 0, "dtypes": set(), "lora": 0, "trained": 0, "ckpt": 0, "layers": 0, "bytes": 0}
        for s in STACKS
    }
    for name, module in model.named_modules():
        c = counts[family.stack_of(name)]
        if hasattr(module, "lora_A"):
            c["lora"] += 1
        elif isinstance(module, torch.nn.Linear) and ".lora_" not in name and not name.endswith("lm_head"):
            if type(module).__name__ == "Linear4bit":
                c["4bit"] += 1
            else:
                c["plain"] += 1
                c["dtypes"].add(str(module.weight.dtype).removeprefix("torch."))
        if isinstance(module, GradientCheckpointingLayer):
            c["layers"] += 1
            c["ckpt"] += bool(module.gradient_checkpointing)
    for name, p in model.named_parameters():
        c = counts[family.stack_of(name)]
        qs = getattr(p, "quant_state", None)
        c["bytes"] += storage_bytes_of(p, qs) if qs is not None else p.numel() * p.element_size()
        if p.requires_grad:
            c["trained"] += p.numel()
    parts = []
    for stack, c in counts.items():
        linear = f"{c['4bit']} 4-bit linear"
        if c["plain"]:
            linear += f", {c['plain']} unquantized ({'/'.join(sorted(c['dtypes']))})"
        text = (
            f"{stack}: weights {format_bytes(c['bytes'])} ({linear}), LoRA on {c['lora']}, "
            f"{c['trained']:,} trained params"
        )
        if checkpointing and stack != "projector":
            text += (
                f", {c['ckpt']} of {c['layers']} layers checkpointed" if c["layers"]
                else ", no checkpointing layer (transformers cannot checkpoint it: its activations are all kept)"
            )
        parts.append(text)
    asked = ["vision-tower unquantized"] if choices.vision_tower == "unquantized" else []
    if choices.skip_modules is not None:
        asked.append(f"llm_int8_skip_modules {list(choices.skip_modules)}{_unmatched(model, choices.skip_modules)}")
    asked.append(f"lora-scope {choices.lora_scope}")
    if targets != "all-linear":
        asked.append(f"target_modules {targets!r}")
    if choices.exclude_modules is not None:
        asked.append(f"PEFT exclude_modules {choices.exclude_modules!r}")
    if choices.modules_to_save is not None:
        asked.append(f"projector trained whole (PEFT modules_to_save {list(choices.modules_to_save)})")
    if checkpointing:
        asked.append(f"tower checkpointing {'on' if choices.tower_checkpointing else 'off'}")
    return f"vision tower choices ({'; '.join(asked)}): " + "; ".join(parts)


def _unmatched(model: torch.nn.Module, patterns: tuple[str, ...]) -> str:
    """The part of the line naming the skip patterns that matched no linear layer (transformers' own matcher,
    ``should_convert_module``, on the base model's names) and the output layer 4-bit because of it."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name:
            names.append(name.removeprefix("base_model.model.").removesuffix(".base_layer"))
    dead = [p for p in patterns if all(should_convert_module(n, [p]) for n in names)]
    head = next((m for n, m in model.named_modules() if n.endswith("lm_head")), None)
    out = ""
    if dead:
        out += (
            f" (matched no layer: {', '.join(dead)}; transformers matches a name from the start of the qualified "
            "name, at a module boundary, or as its end)"
        )
    if head is not None and type(head).__name__ == "Linear4bit":
        out += " (lm_head 4-bit: the list replaces transformers' default skips)"
    return out


def apply_tower_checkpointing(model: torch.nn.Module, family: VisionFamily, choices: TowerChoices) -> None:
    """With tower checkpointing off, clear the flag ``gradient_checkpointing_enable`` set on every module of the
    tower (what a user's ``for m in model.visual.modules(): m.gradient_checkpointing = False`` does)."""
    if choices.tower_checkpointing:
        return
    for name, module in model.named_modules():
        if family.stack_of(name) == "vision tower" and getattr(module, "gradient_checkpointing", False):
            module.gradient_checkpointing = False


@dataclass
class VisionSetup:
    """What the real build (:func:`build_vision_qlora`) and the meta one (:mod:`vramguard.estimate.vision`) of a
    vision-language config share: the resolved model, its family and shapes, the model class, the attention it
    runs and the processor's rows."""

    spec: Any  # the ModelSpec
    hf_config: Any
    family: VisionFamily
    shape: VisionShape
    model_class: Any
    attn: str
    rows: ImageRows
    image_size: tuple[int, int] | None
    images_per_row: int
    choices: TowerChoices
    video: VideoAsk | None = None

    @property
    def name(self) -> str:
        """The model's name (the config file's stem, a preset's or a Hub id)."""
        return str(self.spec.name)

    def _video_line(self) -> str:
        r, f, video = self.rows, self.family, self.video
        assert video is not None
        images = ""
        if self.image_size is not None:
            h, w = self.image_size
            images = f"{self.images_per_row} image(s) of {h}x{w} ({r.image_tokens} image tokens) and "
        return (
            f"vision-language model ({f.name}): {images}{video.text()} a row (given as sampled at "
            f"{VIDEO_FPS:g} fps), {r.video_tokens} video tokens as its processor makes them ({f.processor}, "
            f"{f.video_processor}: {r.layout}) + {r.text_tokens} text tokens = seq-len "
            f"{r.image_tokens + r.video_tokens + r.text_tokens}"
        )

    def line(self) -> str:
        """What a row is, in one line (the build's note)."""
        r = self.rows
        if self.video is not None:
            return self._video_line()
        if self.image_size is None:
            return (
                f"vision-language model ({self.family.name}): text-only rows of {r.text_tokens} tokens (no "
                "--image-size): the vision tower and projector hold weights and run nothing"
            )
        h, w = self.image_size
        return (
            f"vision-language model ({self.family.name}): {self.images_per_row} image(s) of {h}x{w} a row, "
            f"{r.image_tokens} image tokens as its processor makes them ({self.family.processor}, "
            f"{self.family.image_processor}: {r.layout}) + {r.text_tokens} text tokens = seq-len "
            f"{r.image_tokens + r.text_tokens}"
        )


def is_vision_spec(spec: Any) -> bool:
    """Whether a resolved model (:class:`~vramguard.workload.models.ModelSpec`) is a vision-language model."""
    return spec.hf is not None and is_vision_config(spec.hf)


def vision_setup(
    config: Any,
    image_size: tuple[int, int] | None = None,
    images_per_row: int | None = None,
    spec: Any = None,
) -> VisionSetup:
    """The :class:`VisionSetup` of ``config`` (a :class:`~vramguard.workload.models.QLoRAConfig` whose model is a
    vision-language config; ``spec``: that model resolved). ``image_size`` and ``images_per_row`` default to the
    config's (``--image-size``, ``--images-per-row``; no image size: text-only rows). A bad config or a processor
    that cannot run here is one line."""
    config.validate()
    spec = spec if spec is not None else config.spec
    if image_size is None and config.image_size:
        image_size = parse_image_size(config.image_size)
    if images_per_row is None:
        images_per_row = config.images_per_row
    hf_config = spec.transformers_config()
    family = family_of(hf_config.model_type)
    shape = vision_shape(spec.name, hf_config)
    model_class = image_text_class(hf_config)
    pixels = processor_options(config, family)
    choices = tower_choices(config, family)
    video = video_ask(config)
    rows = image_rows(
        family,
        hf_config,
        shape.text["vocab_size"],
        image_size,
        config.seq_len,
        config.batch,
        images_per_row if image_size is not None else 0,
        config.seed,
        pixels,
        video,
    )
    attn = config.attn_implementation
    if attn == "flash_attention_2":
        raise UsageError("vision-language models are measured with sdpa or eager attention for now")
    if config.target_modules == "peft-default":
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

        if hf_config.model_type not in PEFT_DEFAULTS:
            raise UsageError(
                f"PEFT has no default target modules for {hf_config.model_type} (peft-default, TRL's default): "
                "name them, e.g. --target-modules all-linear (LoRA in the vision tower too)"
            )
    if config.padding_free or config.use_liger_kernel:
        raise UsageError("vision-language models are not priced padding-free or with Liger's kernels yet")
    if attn == "sdpa" and not getattr(model_class, "_supports_sdpa", False):
        attn = "eager"
    hf_config._attn_implementation = attn
    return VisionSetup(
        spec,
        hf_config,
        family,
        shape,
        model_class,
        attn,
        rows,
        image_size,
        images_per_row if image_size else 0,
        choices,
        video,
    )


def image_text_model(
    setup: VisionSetup, model: torch.nn.Module, config: Any, inputs: dict[str, Any], prepared: bool = True
) -> Any:
    """The :class:`~vramguard.workload.models.QLoRAModel` of a built vision-language ``model`` whose
    :meth:`batch` is ``inputs`` (the same images every step: a step's bytes depend on their sizes only) and whose
    ``vision`` is ``setup``. ``prepared`` False: the model as loaded, before a trainer's own LoRA (the tower's
    line, which reads where LoRA went, is then the trainer's to add: :func:`tower_note`)."""
    from vramguard.workload.models import QLoRAModel

    class ImageTextModel(QLoRAModel):
        vision = setup
        one_sequence_per_row = True  # (the meta run's question: the rows pass no position ids)

        def batch(self, step: int = 0) -> dict[str, Any]:
            """The processor's rows."""
            return dict(inputs)

    notes: tuple[str, ...] = (setup.line(),)
    if setup.attn != config.attn_implementation:
        notes += (f"{setup.model_class.__name__} has no sdpa attention in transformers: it ran eager attention",)
    if prepared:
        notes += tower_note(model, setup, config)
    return ImageTextModel(
        model=model, spec=setup.spec, config=config, attn_implementation=setup.attn, notes=notes
    )


def tower_note(model: torch.nn.Module, setup: VisionSetup, config: Any) -> tuple[str, ...]:
    """The build's note on the tower's choices (:func:`tower_line` of the model with its LoRA) where a choice or
    the targets are not the usual recipe's; none otherwise (all-linear's notes stay as they were)."""
    if setup.choices.is_default and config.target_modules == "all-linear":
        return ()
    return (tower_line(model, setup.family, setup.choices, config),)


def build_vision_qlora(
    config: Any,
    image_size: tuple[int, int] | None = None,
    images_per_row: int | None = None,
    spec: Any = None,
    prepared: bool = True,
) -> VisionQLoRAModel:
    """A vision-language model as users load it for QLoRA: random weights written to a temporary checkpoint,
    ``AutoModelForImageTextToText.from_pretrained`` of it with the ``BitsAndBytesConfig`` of ``config`` (a
    :class:`~vramguard.workload.models.QLoRAConfig`: 4-bit, its quant type and compute dtype), PEFT's
    ``prepare_model_for_kbit_training`` and ``get_peft_model`` with its LoRA (``all-linear`` by default, which
    includes the vision tower and projector, as bitsandbytes quantizes them), and the family processor's rows of
    ``config.seq_len`` tokens (:func:`image_rows`) as its batch. ``prepared`` False: the 4-bit model as
    ``from_pretrained`` loads it, without k-bit preparation and LoRA (TRL's SFTTrainer does its own)."""
    from transformers.utils import logging as hf_logging

    from vramguard.workload.models import (
        BUILD_ERRORS,
        bnb_4bit_config,
        build_error,
        parse_dtype,
        prepare_for_training,
        with_lora,
    )

    setup = vision_setup(config, image_size, images_per_row, spec)
    compute_dtype = parse_dtype(config.compute_dtype)
    torch.manual_seed(config.seed)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="vramguard-vlm-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            random_model = setup.model_class(setup.hf_config)
        except BUILD_ERRORS as exc:
            raise UsageError(f"transformers cannot build {setup.name}: {build_error(exc)}") from None
        random_model.save_pretrained(tmp)
        del random_model
        model = setup.model_class.from_pretrained(
            tmp,
            quantization_config=bnb_4bit_config(config, skip_modules=setup.choices.skip_modules),
            device_map={"": config.device},
            dtype=compute_dtype,
            attn_implementation=setup.attn,
        )
        if prepared:
            model = prepare_for_training(model, config)
            apply_tower_checkpointing(model, setup.family, setup.choices)
            model = with_lora(model, config, setup.choices)
    model.train()
    model.config.use_cache = False
    device = torch.device(config.device)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in setup.rows.inputs.items()}
    q = image_text_model(setup, model, config, inputs, prepared)
    return VisionQLoRAModel(
        q=q,
        family=setup.family,
        rows=setup.rows,
        image_size=setup.image_size,
        images_per_row=setup.images_per_row,
    )


def saved_by_stack(records: Any, family: VisionFamily) -> dict[str, int]:
    """Saved bytes of a ledger's records (:class:`~vramguard.measure.ledger.SavedRecord`) per stack
    (:data:`STACKS`), each record under the stack of the module that saved it."""
    out = dict.fromkeys(STACKS, 0)
    for r in records:
        out[family.stack_of(r.module)] += r.bytes
    return out


__all__ = [
    "STACKS",
    "VISION_FAMILIES",
    "ImageRows",
    "ImageSteps",
    "processor_options",
    "processor_resize",
    "VisionFamily",
    "VisionQLoRAModel",
    "VisionSetup",
    "VisionShape",
    "VideoAsk",
    "build_vision_qlora",
    "family_of",
    "family_processor",
    "image_rows",
    "image_text_class",
    "image_text_model",
    "is_vision_config",
    "is_vision_spec",
    "load_vision_config",
    "parse_image_size",
    "row_tokenizer",
    "row_tokens",
    "saved_by_stack",
    "synthetic_image",
    "token_ids",
    "tower_note",
    "vision_setup",
    "vision_shape",
    "video_ask",
    "video_refusal",
]
