"""``vramguard estimate --fit SIZE --fit-dim image``: the largest image of a vision-language model that fits, in its
processor's patch steps, bounded by max_pixels and by --seq-len (the whole row, image tokens included)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from vramguard.errors import UsageError
from vramguard.estimate.fit_image import ImageDim, image_space
from vramguard.workload.models import QLoRAConfig
from vramguard.workload.vision import VISION_FAMILIES, ImageSteps, image_rows, vision_setup

VLM = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm"
QWEN25 = VLM / "tiny-qwen2.5-vl.json"
BASE = ["--batch", "1", "--target-modules", "all-linear", "--quiet"]


def _config(seq: int, **kw: object) -> QLoRAConfig:
    return QLoRAConfig(model=str(QWEN25), seq_len=seq, batch=1, target_modules="all-linear", **kw)  # type: ignore[arg-type]


def test_image_values_are_whole_steps_at_the_requested_aspect() -> None:
    square, wide = ImageDim("image", 28), ImageDim("image", 32, (2, 3))
    assert [square.size(k) for k in (1, 2, 16)] == [(28, 28), (56, 56), (448, 448)]
    assert [wide.size(k) for k in (1, 2, 4)] == [(32, 64), (64, 96), (128, 192)]  # width: the nearest step
    assert square.apply(_config(64), 16).image_size == "448x448"


def _overflows(seq: int, side: int) -> bool:
    """Whether the family's processor makes more tokens than ``seq`` of one ``side`` x ``side`` image (the rows'
    own check, not the search's)."""
    setup = vision_setup(_config(seq, image_size="28x28"))
    try:
        image_rows(setup.family, setup.hf_config, setup.shape.text["vocab_size"], (side, side), seq)
    except UsageError as exc:
        assert "more than seq-len" in str(exc)
        return True
    return False


def test_seq_len_bounds_the_image() -> None:
    """At seq 512 the largest square image is the last whose row the processor can make: one step more overflows."""
    space = image_space(_config(512))
    assert space.limited_by == "seq-len"
    side = space.dim.size(space.limit)[0]
    assert side % 28 == 0
    assert not _overflows(512, side) and _overflows(512, side + 28)


def test_max_pixels_bounds_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family registered with a smaller max_pixels: the limit is the last step within it, at any seq-len."""
    family = VISION_FAMILIES["qwen2_5_vl"]
    small = dataclasses.replace(family, image_steps=lambda c: ImageSteps(step=28, max_pixels=280 * 300))
    monkeypatch.setitem(VISION_FAMILIES, "qwen2_5_vl", small)
    space = image_space(_config(4096))
    assert (space.limited_by, space.dim.text(space.limit)) == ("max_pixels", "280x280")


def _total(argv: list[str], tmp: Path) -> dict:  # type: ignore[type-arg]
    from vramguard.cli.app import main

    out = tmp / "e.json"
    assert main(["estimate", "--model", str(QWEN25), *argv, *BASE, "--json", str(out)]) in (0, 1)
    return json.loads(out.read_text())["estimate"]  # type: ignore[no-any-return]


@pytest.mark.slow  # four tiny estimates and the search's runs: about a minute on a shared 2-core machine
def test_the_answer_is_the_largest_image_whose_estimate_fits(tmp_path: Path) -> None:
    """SIZE between the estimates (the same command, no --fit) of 168x168 and 196x196: the answer is 168x168, with
    the image tokens its processor makes (Qwen2.5-VL: one per 28x28 pixels)."""
    at = {s: _total(["--image-size", f"{s}x{s}", "--seq-len", "512"], tmp_path)["total_bytes"] for s in (168, 196)}
    assert at[168] < at[196]
    size = (at[168] + at[196]) // 2
    est = _total(["--image-size", "56x56", "--seq-len", "512", "--fit", f"{size}B", "--fit-dim", "image"], tmp_path)
    fit = est["fit"]
    assert fit["dim"] == "image" and fit["image"]["largest"] == "168x168"
    assert fit["image"]["image_tokens"] == 36 and fit["image"]["row_tokens"] == 38  # + vision start and end
    assert fit["image"]["limited_by"] == "seq-len" and fit["image"]["step"] == 28
    assert fit["run_count"] <= fit["bound"]


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        (VLM / "tiny-gemma3.json", [], "does not keep an image's size"),
        ("tiny-qwen3", [], "has no images"),
        (QWEN25, ["--seq-len", "4"], "not even a 28x28 image fits seq-len 4"),
        (QWEN25, ["--world-size", "2", "--sharding", "fsdp2"], "searches one device's step"),
    ],
)
def test_what_cannot_be_searched_is_one_line_exit_2(
    model: object, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from vramguard.cli.app import main

    argv = ["estimate", "--model", str(model), "--seq-len", "64", *flags, *BASE, "--fit", "24GiB", "--fit-dim", "image"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_the_users_max_pixels_bounds_the_image() -> None:
    """``--max-pixels`` (the processor's bound as the user sets it) bounds the search, and the tokens at a value are
    the ones that processor makes: the images the run is given never grow past it."""
    space = image_space(_config(4096, max_pixels=280 * 300))
    assert (space.limited_by, space.dim.text(space.limit)) == ("max_pixels", "280x280")
    assert space.pixels == {"max_pixels": 280 * 300}
    assert space.tokens(space.limit)[1] == (280 // 28) ** 2


def test_a_batch_fit_of_images_is_bounded_by_the_host_pixels_its_rows_take() -> None:
    """``--fit`` over the batch of a vision-language model: every probe's rows are real images through the
    processor on the host, so the search stops at :data:`IMAGE_FIT_PIXELS` of them (it searched up to 2^20 rows,
    until the host ran out of memory), never below the requested batch."""
    import argparse

    from vramguard.cli.estimate import IMAGE_FIT_PIXELS, _limit

    args = argparse.Namespace(fit_dim="batch", steps=2)
    assert _limit(_config(256, image_size="224x224"), args, "loop") == IMAGE_FIT_PIXELS // (224 * 224)
    two = _config(256, image_size="224x224", images_per_row=2)
    assert _limit(two, args, "loop") == IMAGE_FIT_PIXELS // (2 * 224 * 224)
    huge = dataclasses.replace(_config(256, image_size="4096x4096"), batch=3)
    assert _limit(huge, args, "loop") == 3
    assert _limit(_config(256), args, "loop") > IMAGE_FIT_PIXELS // (224 * 224)  # text rows: not bounded so


def test_fit_dim_without_fit_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``--fit-dim`` says what ``--fit`` searches: given alone it was ignored (exit 0, no search)."""
    from vramguard.cli.app import main

    assert main(["estimate", "--model", str(QWEN25), *BASE, "--image-size", "56x56", "--fit-dim", "image"]) == 2
    assert capsys.readouterr().err.strip().endswith("--fit-dim image says what --fit searches: give --fit")
