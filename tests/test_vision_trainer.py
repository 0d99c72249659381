"""TRL's own SFTTrainer step for a vision-language model (issue 45): a ``ProcessorMixin`` as ``processing_class``,
a vision dataset (images + messages) rendered with the family's Hub chat template by TRL's
``DataCollatorForVisionLanguageModeling``, the 4-bit model handed unprepared, and on meta the collated batch
carrying its values; with ``--target cpu`` the estimate equals ``vramguard audit --trainer sft`` to the byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramguard.cli.app import main
from vramguard.workload.models import QLoRAConfig

pytest.importorskip("trl")

VLM = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm"


def _figures(doc: dict) -> dict:
    """What the audit measures and the estimate must equal: each phase's peak, the totals, each step's peaks and
    retained bytes, and the saved bytes of every layer of every stack."""
    return {
        "phases": {name: p["peak_bytes"] for name, p in doc["phases"].items()},
        "totals": doc["totals"],
        "steps": [(s["peak_bytes"], s["retained_bytes"], s["retained_after_forward"]) for s in doc["steps"]],
        "layers": [(row["name"], row["saved_bytes"]) for row in doc["layers"]],
    }


def _audit_and_estimate(
    tmp_path: Path, family: str, size: str | None, seq: int, steps: int = 1
) -> tuple[dict, dict]:
    base = ["--model", str(VLM / f"tiny-{family}.json"), "--seq-len", str(seq)]
    base += ["--image-size", size] if size else []  # none: text-only rows (the seed's TEXT mode)
    base += ["--batch", "1", "--target-modules", "all-linear", "--steps", str(steps), "--quiet"]
    audit, estimate = tmp_path / "audit.json", tmp_path / "estimate.json"
    # exit 0 or 1 (a finding: tiny Qwen3-VL's deepstack activations have a weight's shape), the same for both
    measured = main(["audit", *base, "--trainer", "sft", "--json", str(audit)])
    assert measured in (0, 1)
    assert main(["estimate", *base, "--target", "cpu", "--json", str(estimate)]) == measured  # sft: the default
    return json.loads(audit.read_text()), json.loads(estimate.read_text())


def test_the_sft_step_of_a_vlm_on_meta_equals_its_audit(tmp_path: Path) -> None:
    """Tiny Qwen2-VL, one 56x56 image a row: ``vramguard estimate`` runs SFTTrainer's own step on meta (not the
    loop), and its figures equal the CPU audit of SFTTrainer's step byte for byte, per stack's layer too."""
    audited, estimated = _audit_and_estimate(tmp_path, "qwen2-vl", "56x56", 64)
    assert estimated["config"]["recipe"].startswith("recipe: trl sft "), estimated["config"]["recipe"]
    assert "SFTTrainer's own step" in estimated["config"]["recipe"]
    assert estimated["device"] == "meta" and audited["config"]["trainer"] == "SFTTrainer"
    assert _figures(estimated) == _figures(audited)
    assert {row["stack"] for row in estimated["layers"]} == {"vision tower", "projector", "language model"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "size", "seq"),
    [
        ("qwen2.5-vl", "56x56", 64),
        ("qwen2.5-vl", "112x84", 128),
        ("qwen3-vl", "56x56", 128),  # mm_token_type_ids and deepstack's boolean masks, from the values
        ("qwen3-vl", "112x112", 320),
        ("gemma3", "56x56", 256),  # token_type_ids: bidirectional attention over the image
        ("idefics3", "56x56", 256),
        ("llava-next", "56x56", 256),
        ("qwen3.5", "56x56", 128),  # its thinking template's <think> markers
        ("qwen3-vl-moe", "56x56", 128),
        ("qwen3-vl", None, 96),  # text-only rows: messages alone, tokenized in SFTTrainer's dataset preparation
        ("gemma3", None, 96),
    ],
)
def test_every_family_with_a_template_equals_its_audit(
    tmp_path: Path, family: str, size: str | None, seq: int
) -> None:
    audited, estimated = _audit_and_estimate(tmp_path, family, size, seq, steps=2)
    assert "SFTTrainer's own step" in estimated["config"]["recipe"]
    assert _figures(estimated) == _figures(audited)


@pytest.mark.parametrize(
    ("family", "size", "seq", "images"), [("qwen2-vl", "56x56", 64, 1), ("qwen3-vl", "56x84", 160, 2)]
)
def test_the_rows_are_seq_len_long_as_trls_collator_makes_them(family: str, size: str, seq: int, images: int) -> None:
    """Each row, rendered with the family's chat template and processed by TRL's own vision collator as
    SFTTrainer runs it (max_length = seq-len), is exactly seq-len tokens, its image tokens the processor's, no
    padding (every label is a token)."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from vramguard.workload.vision import image_token_id, vision_setup
    from vramguard.workload.vision_sft import sft_processor, sft_rows

    config = QLoRAConfig(
        model=str(VLM / f"tiny-{family}.json"), seq_len=seq, batch=1, image_size=size, images_per_row=images
    )
    setup = vision_setup(config)
    processor = sft_processor(setup, config)
    rows = sft_rows(setup, processor, config, 3)
    batch = DataCollatorForVisionLanguageModeling(processor=processor, max_length=seq)(rows)
    assert tuple(batch["input_ids"].shape) == (3, seq)
    image_id = image_token_id(setup.family, setup.hf_config, setup.shape.text["vocab_size"])
    assert (batch["input_ids"] == image_id).sum(dim=1).tolist() == [setup.rows.image_tokens] * 3
    assert bool((batch["labels"] == batch["input_ids"]).all())
    assert processor.tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in processor.chat_template


def test_what_sfttrainers_vlm_step_does_not_run_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A family SFTTrainer's step does not take yet (SmolVLM's processor renders its template only with its video
    processor) and the tower's checkpointing turned off (Trainer turns checkpointing on inside train()): asked for
    by name, one line naming what and the workaround (exit 2)."""
    smol = ["--model", str(VLM / "tiny-smolvlm.json"), "--image-size", "56x56", "--seq-len", "640"]
    tower = ["--model", str(VLM / "tiny-qwen2-vl.json"), "--image-size", "56x56", "--seq-len", "64"]
    smol_why = "SmolVLM (its processor renders the chat template only with its video processor"
    for argv, what in ((smol, smol_why), ([*tower, "--no-tower-checkpointing"], "--no-tower-checkpointing")):
        assert main(["estimate", *argv, "--trainer", "sft", "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert what in err and "--trainer loop" in err and "\n" not in err, err


def test_a_text_row_the_template_alone_overflows_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Text-only rows (the seed's TEXT mode) whose chat template alone is longer than seq-len: one line,
    exit 2, in words (review: "the chat template take")."""
    argv = ["--model", str(VLM / "tiny-qwen2-vl.json"), "--seq-len", "4", "--target-modules", "all-linear"]
    assert main(["estimate", *argv, "--trainer", "sft", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the chat template takes 15 tokens" in err and "raise seq-len" in err and "\n" not in err, err


def test_a_family_without_a_template_falls_back_to_the_loop_and_says_so() -> None:
    """Not asked for by name (estimate's default), SFTTrainer's step that cannot run yet leaves the run to
    vramguard's loop, and the recipe line says which and why."""
    import argparse

    from vramguard.cli.options import resolve_trainer

    args = argparse.Namespace(trainer=None, config=None, trainer_default="sft")
    config = QLoRAConfig(model=str(VLM / "tiny-smolvlm.json"), seq_len=640, image_size="56x56")
    trainer, recipe = resolve_trainer(args, config)
    assert trainer == "loop" and "(ran instead of sft's own step, which does not run SmolVLM (its" in recipe
    llava = QLoRAConfig(model=str(VLM / "tiny-llava.json"), seq_len=640, image_size="56x56")
    assert "a llava model (its chat template is not registered" in resolve_trainer(args, llava)[1]
    ok = QLoRAConfig(model=str(VLM / "tiny-qwen2-vl.json"), seq_len=64, image_size="56x56")
    assert resolve_trainer(args, ok)[0] == "sft"


def test_a_data_dependent_results_storage_is_what_the_host_kernel_allocated(tmp_path: Path) -> None:
    """Qwen2.5-VL's window lengths of a 112x84 image (a merged grid of 4x3, not a whole window) go through
    ``unique_consecutive``, whose CPU kernel allocates its input's 3 int32 and keeps 2: with checkpointing the
    tower's blocks keep them to backward, so the meta run holds the 12 bytes the audit holds, not 8 (vramguard's
    loop, the values of :class:`~vramguard.estimate.vision.ImageValues`; SFTTrainer's step takes the same)."""
    base = ["--model", str(VLM / "tiny-qwen2.5-vl.json"), "--image-size", "112x84", "--seq-len", "128"]
    base += ["--batch", "1", "--target-modules", "all-linear", "--gradient-checkpointing", "--steps", "1", "--quiet"]
    audit, estimate = tmp_path / "audit.json", tmp_path / "estimate.json"
    assert main(["audit", *base, "--device", "cpu", "--json", str(audit)]) == 0
    assert main(["estimate", *base, "--trainer", "loop", "--target", "cpu", "--json", str(estimate)]) == 0
    assert _figures(json.loads(estimate.read_text())) == _figures(json.loads(audit.read_text()))


def test_keep_end_truncation_of_image_rows_is_refused_as_sfttrainer_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TRL's SFTTrainer raises in its ``__init__`` for ``truncation_mode: keep_end`` on a vision dataset while
    ``max_length`` is set (its default included): a `trl sft` YAML asking it of rows with images is one line,
    exit 2, not a figure; text-only rows and ``max_length: null`` are what TRL runs."""
    from vramguard.workload.run_config import load_run_config

    head = f"model_name_or_path: {VLM / 'tiny-qwen2-vl.json'}\nuse_peft: true\nload_in_4bit: true\n"
    head += "lora_target_modules: all-linear\ntruncation_mode: keep_end\n"
    for lengths, refused in (("max_length: 64\n", True), ("", True), ("max_length: null\n", False)):
        path = tmp_path / "sft.yaml"
        path.write_text(head + lengths)
        run = load_run_config(path)
        run.config(seq_len=64)  # text-only rows: SFTTrainer truncates them from the end
        if not refused:
            run.config(seq_len=64, image_size="56x56")
            continue
        assert main(["estimate", "--config", str(path), "--image-size", "56x56", "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert "truncation_mode keep_end" in err and "\n" not in err, err


def test_large_results_carry_no_value_and_change_no_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """A valued op's result over ``VALUED_BYTES`` gets no host value (computing a 4-D attention mask of 8 rows of
    8,192 tokens on the host cost a second an op): with the limit at 4 KiB, so that the tiny batch's position ids,
    patch positions and TRL's loss masks lose theirs, Qwen3-VL's estimate through SFTTrainer is the same byte for
    byte (Qwen2.5-VL's and Qwen2-VL's in the loop too, by hand); at 0 (no value kept at all) a data-dependent op
    raises, never a wrong shape."""
    from vramguard.estimate import meta
    from vramguard.estimate.trainer import run_trainer_estimate

    dropped: list[int] = []
    too_large = meta._too_large

    def counted(t: object, *rest: object) -> bool:
        large = too_large(t, *rest)
        dropped.extend([1] if large else [])
        return large

    monkeypatch.setattr(meta, "_too_large", counted)
    monkeypatch.setattr(meta._RoutedValues, "limit", lambda self: meta.VALUED_BYTES)  # no floor of the batch's
    for family in ("tiny-qwen3-vl",):
        config = QLoRAConfig(
            model=str(VLM / f"{family}.json"), seq_len=128, batch=2, image_size="56x56", target_modules="all-linear"
        )
        docs = []
        for limit in (meta.VALUED_BYTES, 4096):
            monkeypatch.setattr(meta, "VALUED_BYTES", limit)
            dropped.clear()
            doc = run_trainer_estimate(config, "sft", steps=2, target="cpu").to_dict()
            doc.pop("elapsed_s")
            docs.append(json.dumps(doc, sort_keys=True, default=str))
        assert dropped, family  # the 4 KiB limit dropped values
        assert docs[1] == docs[0], family
    monkeypatch.setattr(meta, "VALUED_BYTES", 0)
    with pytest.raises((NotImplementedError, RuntimeError)):  # meta's "no data", "without output_size"
        run_trainer_estimate(config, "sft", steps=2, target="cpu")
