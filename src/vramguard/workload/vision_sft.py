"""A vision-language model's data as TRL's ``SFTTrainer`` takes it: a ``ProcessorMixin`` as ``processing_class``
and a vision dataset, each row its ``images`` and ``messages`` (a user turn, then an assistant turn), which
``SFTTrainer`` leaves unprepared and its ``DataCollatorForVisionLanguageModeling`` renders with the processor's
chat template and runs through the processor at collate time (``apply_chat_template(..., tokenize=True)``).

The processor is the family's (:func:`vramguard.workload.vision.family_processor`, its row tokenizer a word-level
one) with the chat template the family's Hub processor ships, read from TRL's own stored copy
(``trl/chat_templates/<name>.jinja``, which TRL's CI checks against the Hub's), and that template's special
tokens (each one token, as in the family's real tokenizer; its ``eos_token`` and ``pad_token`` the real
tokenizer's). The rows come out exactly ``seq_len`` tokens long as the collator makes them (image tokens and the
template's tokens included, as TRL's ``max_length`` counts them): the assistant turn is filled with
:data:`~vramguard.workload.vision.FILLER` words to that length, measured with the collator itself.

Text-only rows (no ``--image-size``) are ``messages`` alone, which SFTTrainer tokenizes in its dataset
preparation with the processor's chat template and collates as text. A family whose template is not registered
(or what the trainer's step does not take yet: video, the tower's checkpointing turned off) is
:func:`sft_refusal`'s one line: vramguard's loop prices it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vramguard.errors import UsageError
from vramguard.workload.vision import FILLER, family_processor, processor_options, synthetic_image


@dataclass(frozen=True)
class SftTemplate:
    """A family's chat template as its Hub processor ships it: ``name``, TRL's stored copy
    (``trl/chat_templates/<name>.jinja``); ``markers``, the special tokens it writes; ``eos``, ``pad`` and
    ``bos``, the tokens the family's tokenizer names so (None: none; SFTTrainer pads with the eos token then)."""

    name: str
    markers: tuple[str, ...]
    eos: str
    pad: str | None = None
    bos: str | None = None


_QWEN = SftTemplate("qwen2_5_vl", ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), "<|im_end|>", "<|endoftext|>")
SFT_TEMPLATES: dict[str, SftTemplate] = {
    # Qwen2-VL ships the template of Qwen2.5-VL byte for byte (TRL's chat_templates/README.md)
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": dataclasses.replace(_QWEN, name="qwen3_vl"),
    # (the MoE checkpoints, Qwen3-VL-30B-A3B-Instruct, ship the dense ones' template: assumed, TRL stores one)
    "qwen3_vl_moe": dataclasses.replace(_QWEN, name="qwen3_vl"),
    # Qwen3.5-4B and larger ship the template that thinks by default (TRL's chat_templates/README.md)
    "qwen3_5": SftTemplate("qwen3_5_think", (*_QWEN.markers, "<think>", "</think>"), "<|im_end|>", "<|endoftext|>"),
    "gemma3": SftTemplate(
        "gemma3", ("<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>", "<pad>"), "<eos>", "<pad>", "<bos>"
    ),
    "idefics3": SftTemplate("idefics3", ("<|begin_of_text|>", "<end_of_utterance>"), "<end_of_utterance>"),
    "llava_next": SftTemplate("llava_next", ("</s>",), "</s>"),
}
"""The families whose SFTTrainer step runs (model_type -> :class:`SftTemplate`); register one to add a family."""

SFT_NOT_YET: dict[str, str] = {
    "smolvlm": "SmolVLM (its processor renders the chat template only with its video processor, which needs "
    "torchvision)",
}
"""Why a family's SFTTrainer step does not run yet, where it is more than its template not being registered."""


def sft_refusal(config: Any, model_type: str) -> str | None:
    """What SFTTrainer's vision-language step does not run yet for ``config`` (a
    :class:`~vramguard.workload.models.QLoRAConfig`) of a ``model_type`` model, in words; None where it runs."""
    unregistered = f"a {model_type} model (its chat template is not registered in vramguard.workload.vision_sft)"
    not_yet = {
        SFT_NOT_YET.get(model_type, unregistered): model_type not in SFT_TEMPLATES,
        "video rows": bool(config.video_frames),
        "--no-tower-checkpointing": config.gradient_checkpointing and not config.tower_checkpointing,
    }
    return next((what for what, asked in not_yet.items() if asked), None)


def trainer_refusal(config: Any, trainer: str) -> str | None:
    """What ``trainer``'s own step ("sft", "trainer") does not run yet for ``config``'s vision-language model, in
    words (plain Trainer: any; SFTTrainer: :func:`sft_refusal`); None where it runs, or for a text model."""
    from vramguard.workload.vision import is_vision_spec

    if not is_vision_spec(config.spec):
        return None
    if trainer != "sft":
        return "a vision-language model"
    return sft_refusal(config, str(config.spec.hf["model_type"]))


def sft_processor(setup: Any, config: Any) -> Any:
    """The family's processor of ``setup`` (:class:`~vramguard.workload.vision.VisionSetup`) with its Hub chat
    template and that template's special tokens (see the module); ``config``: the run's QLoRAConfig (Qwen's
    ``min_pixels`` / ``max_pixels``)."""
    from importlib.resources import files

    template = SFT_TEMPLATES[setup.hf_config.model_type]
    family = setup.family
    marked = dataclasses.replace(family, tokens=(*family.tokens, *((None, t, None) for t in template.markers)))
    vocab, pixels = setup.shape.text["vocab_size"], processor_options(config, family)
    processor = family_processor(marked, setup.hf_config, vocab, pixels)
    # SFTTrainer pads with the tokenizer's pad token, else its eos token: the collator of the rows' lengths too
    named = {"eos_token": template.eos, "pad_token": template.pad or template.eos, "bos_token": template.bos}
    for attribute, token in named.items():
        if token is not None:
            setattr(processor.tokenizer, attribute, token)
    processor.chat_template = (files("trl") / "chat_templates" / f"{template.name}.jinja").read_text()
    return processor


def _row(setup: Any, words: int, seed: int) -> dict[str, Any]:
    """A dataset row: ``setup``'s images (noise, deterministic in ``seed``; none for text-only rows) and a user
    turn of one word, the assistant's of ``words`` words (TRL puts the images before the first user turn's text)."""
    answer = " ".join([FILLER] * words)
    turns = [{"role": "user", "content": FILLER}, {"role": "assistant", "content": answer}]
    if setup.image_size is None:
        return {"messages": turns}
    return {"images": [synthetic_image(*setup.image_size, seed)] * setup.images_per_row, "messages": turns}


def _length(processor: Any, row: dict[str, Any]) -> int:
    """The tokens TRL makes of ``row``: its vision collator's (a copy: the collator rewrites its rows), or for a
    text-only row its dataset preparation's tokenization of the messages (``trl.data_utils._tokenize``, the
    processor's chat template; SFTTrainer's check of the prepared rows is :func:`check_prepared`)."""
    from trl.data_utils import _tokenize
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    if "images" not in row:
        return len(_tokenize(processor, row["messages"])["input_ids"])
    made = DataCollatorForVisionLanguageModeling(processor=processor)([dict(row)])
    return int(made["input_ids"].shape[-1])


def check_prepared(runner: Any, seq_len: int) -> None:
    """Text-only rows as SFTTrainer prepared them (tokenized, truncated to ``max_length``) are ``seq_len`` long,
    else one line: a check of :func:`sft_rows` against TRL's own preparation."""
    data = runner.train_dataset
    if "input_ids" in data.column_names and len(data[0]["input_ids"]) != seq_len:
        raise UsageError(f"SFTTrainer prepared rows of {len(data[0]['input_ids'])} tokens for seq-len {seq_len}")


def sft_rows(setup: Any, processor: Any, config: Any, count: int) -> list[dict[str, Any]]:
    """``count`` rows (:func:`_row`) of exactly ``config.seq_len`` tokens each as TRL's vision collator renders
    them with ``processor``; a row the images and the template alone overflow is one line naming their tokens."""
    used = _length(processor, _row(setup, 0, config.seed))
    if used > config.seq_len:
        size = setup.image_size
        what = "the chat template takes"
        if size:
            what = f"{setup.images_per_row} image(s) of {size[0]}x{size[1]} and the chat template take"
        raise UsageError(
            f"{what} {used} tokens in {setup.family.name}'s rows under SFTTrainer ({setup.rows.image_tokens} "
            f"image tokens), more than seq-len {config.seq_len}: raise seq-len"
            + (" or lower the image size" if size else "")
        )
    rows = [_row(setup, config.seq_len - used, config.seed + i) for i in range(count)]
    got = _length(processor, rows[0])
    if got != config.seq_len:  # a check of this code: each filler word is one token
        name = setup.family.name
        raise UsageError(f"{name}'s rows came out {got} tokens under SFTTrainer for seq-len {config.seq_len}")
    return rows


def sft_data(q: Any, count: int) -> tuple[Any, Any]:
    """(the vision dataset of ``count`` rows, the processor) SFTTrainer takes for ``q`` (a vision-language
    :class:`~vramguard.workload.models.QLoRAModel`, its ``vision`` the setup)."""
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    processor = sft_processor(q.vision, q.config)
    return Dataset.from_list(sft_rows(q.vision, processor, q.config, count)), processor


def with_tower_note(q: Any) -> Any:
    """``q`` (a :class:`~vramguard.workload.models.QLoRAModel`) with a vision-language model's tower note
    (:func:`vramguard.workload.vision.tower_note`) read off the model the trainer trained (its own LoRA), as the
    loop's build notes it; ``q`` itself for a text model."""
    setup = getattr(q, "vision", None)
    if setup is None:
        return q
    from vramguard.workload.vision import tower_note

    return dataclasses.replace(q, notes=(*q.notes, *tower_note(q.model, setup, q.config)))


__all__ = [
    "SFT_NOT_YET",
    "SFT_TEMPLATES",
    "SftTemplate",
    "check_prepared",
    "sft_data",
    "sft_processor",
    "sft_refusal",
    "sft_rows",
    "trainer_refusal",
    "with_tower_note",
]
