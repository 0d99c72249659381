"""``vramguard estimate --fit SIZE --fit-dim image``: the largest image of a vision-language model that fits, among
the sizes its processor makes, bounded by max_pixels and by --seq-len (the whole row, image tokens included)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from rich.console import Console

from vramguard.errors import UsageError
from vramguard.estimate.fit_image import image_space, processor_sizes
from vramguard.workload.models import QLoRAConfig
from vramguard.workload.vision import VISION_FAMILIES, ImageSteps, image_rows, processor_resize, vision_setup

VLM = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "vlm"
QWEN25 = VLM / "tiny-qwen2.5-vl.json"
BASE = ["--batch", "1", "--target-modules", "all-linear", "--quiet"]


def _config(seq: int, **kw: object) -> QLoRAConfig:
    return QLoRAConfig(model=str(QWEN25), seq_len=seq, batch=1, target_modules="all-linear", **kw)  # type: ignore[arg-type]


def test_image_values_are_the_sizes_the_processor_makes_at_the_aspect() -> None:
    """The values are what the processor's own resize (transformers' smart_resize) makes of images at the
    requested aspect ratio, fewest pixels first: each side a whole step, each a size it keeps as it is, none
    below min_pixels (Qwen2.5-VL's 56x56); value ``k`` is applied as that size."""
    space = image_space(_config(4096, image_size="300x400", max_pixels=100_000))
    sizes = [space.dim.size(k) for k in range(1, space.limit + 1)]
    assert sizes[0] == (56, 56) and sizes[:4] == [(56, 56), (56, 84), (84, 84), (84, 112)]
    assert all(h % 28 == 0 and w % 28 == 0 and 3136 <= h * w <= 100_000 for h, w in sizes)
    assert [h * w for h, w in sizes] == sorted({h * w for h, w in sizes})
    assert all(space.steps.resized(h, w) == (h, w) for h, w in sizes)
    assert space.dim.apply(_config(64), 3).image_size == "84x84"


def test_the_largest_image_is_what_the_processor_makes_of_a_larger_one() -> None:
    """Reviewer finding: with --max-pixels and a non-square --image-size the search's sizes were whole steps at
    the ratio (280x364 is over 100,000 pixels, so the largest was 252x336), while the processor resizes any
    larger 3:4 image to 252x364 (117 image tokens, not 108): the search's largest is what the processor itself
    makes of a larger image."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    space = image_space(_config(4096, image_size="300x400", max_pixels=100_000))
    assert space.limited_by == "max_pixels"
    larger = {smart_resize(h, w, factor=28, min_pixels=3136, max_pixels=100_000) for h, w in ((300, 400), (3000, 4000))}
    assert larger == {space.dim.size(space.limit)} == {(252, 364)}
    assert space.tokens(space.limit)[1] == 117
    assert space.known("3000x4000", 1) == {space.limit: 1}  # the requested image is the processor's size


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
    resize = processor_resize(family.image_processor)
    small = dataclasses.replace(family, image_steps=lambda c: ImageSteps(28, 280 * 300, 3136, resize))
    monkeypatch.setitem(VISION_FAMILIES, "qwen2_5_vl", small)
    space = image_space(_config(4096))
    assert (space.limited_by, space.dim.text(space.limit)) == ("max_pixels", "280x280")


def _total(argv: list[str], tmp: Path) -> dict:  # type: ignore[type-arg]
    from vramguard.cli.app import main

    out = tmp / "e.json"
    assert main(["estimate", "--model", str(QWEN25), *argv, *BASE, "--json", str(out)]) in (0, 1)
    return json.loads(out.read_text())["estimate"]  # type: ignore[no-any-return]


SIDES = (168, 196)


@pytest.mark.slow  # four tiny estimates and the search's runs: about a minute on a shared 2-core machine
def test_the_answer_is_the_largest_image_whose_estimate_fits(tmp_path: Path) -> None:
    """SIZE between the estimates (the same command, no --fit) of 168x168 and 196x196: the answer is 168x168, with
    the image tokens its processor makes (Qwen2.5-VL: one per 28x28 pixels). ``--fit-dim image`` prices vramguard's
    loop (SFTTrainer's step on meta does not run it), so the estimates are the loop's: the default trainer's
    (SFTTrainer's, since session 19) are other bytes, and this test, slow, went on comparing with them."""
    loop = ["--trainer", "loop"]
    at = {s: _total(["--image-size", f"{s}x{s}", "--seq-len", "512", *loop], tmp_path)["total_bytes"] for s in SIDES}
    assert at[168] < at[196]
    size = (at[168] + at[196]) // 2
    argv = ["--image-size", "56x56", "--seq-len", "512", "--fit", f"{size}B", "--fit-dim", "image", *loop]
    fit = _total(argv, tmp_path)["fit"]
    assert fit["dim"] == "image" and fit["image"]["largest"] == "168x168"
    assert fit["image"]["image_tokens"] == 36 and fit["image"]["row_tokens"] == 38  # + vision start and end
    assert fit["image"]["limited_by"] == "seq-len" and fit["image"]["step"] == 28
    assert fit["run_count"] <= fit["bound"]


def test_the_answer_at_max_pixels_is_the_processors_size_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command of the reviewer's finding: --max-pixels 100000, a 300x400 image, a SIZE every image fits. The
    answer is 252x364, the size the processor makes of the requested image and of every larger 3:4 one (the
    requested shape's own run, no search run), not the 252x336 a step below; the line says where the bound is."""
    argv = ["--image-size", "300x400", "--max-pixels", "100000", "--seq-len", "512", "--fit", "100GiB"]
    est = _total([*argv, "--fit-dim", "image"], tmp_path)
    image = est["fit"]["image"]
    assert (image["largest"], image["limit"], image["limited_by"]) == ("252x364", "252x364", "max_pixels")
    assert (image["image_tokens"], est["fit"]["run_count"], image["ran"]) == (117, 0, [])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fit: "))
    assert "is 252x364 (117 image tokens" in line and "the processor makes no larger image at this aspect ratio" in line


def test_a_tiling_processor_is_searched_by_its_own_token_count() -> None:
    """LLaVA-NeXT's processor (no patch steps: it picks a tile grid of its image_grid_pinpoints) was refused. The
    search's values are the runs of square sizes it gives the same tokens, found by the processor itself to the
    pixel: the tiny config's 36 tokens up to 56x56, 88 from 57x57 up (its grid of tiles), each run by its
    smallest image; the requested image's run is the search's known value."""
    from vramguard.workload.vision import family_of, row_tokens

    space = image_space(QLoRAConfig(model=str(VLM / "tiny-llava-next.json"), seq_len=4096, batch=1))
    assert (space.limited_by, space.dim.sizes, space.up_to) == ("tokens", ((16, 16), (57, 57)), ((56, 56), None))
    config = space.hf_config
    at = {side: row_tokens(family_of("llava_next"), config, 512, (side, side))[1] for side in (16, 56, 57, 900)}
    assert [space.tokens(k)[1] for k in (1, 2)] == [at[56], at[57]] == [at[16], at[900]] == [36, 88]
    assert space.known("448x448", 7) == {2: 7} and space.known("40x40", 7) == {1: 7}
    from vramguard.view.report import render_fit

    console = Console(record=True, width=400)
    render_fit({"size_bytes": 1 << 30, "run_count": 1, "bound": 3, "changes": [], "image": space.answer(1, [1])},
               "image", 1, 4096, console)
    line = console.export_text()
    assert "is 56x56 (36 image tokens, 36 tokens of the row with their markers, as of every image from 16x16 to" in line
    assert "up to that of 57x57)" in line  # the bound is shown only where the answer is at it


def test_gemma3_pan_and_scan_crops_are_searched_and_bounded_by_seq_len() -> None:
    """Gemma 3 with --pan-and-scan: a 1:2 image gets 2 crops from 256x511 up (16 tokens each and the whole image's),
    which the search follows; at seq-len 64 the crops' row does not fit, so the smallest run is the limit."""
    gemma = VLM / "tiny-gemma3.json"
    wide = {"image_size": "300x600", "pan_and_scan": True, "batch": 1}
    space = image_space(QLoRAConfig(model=str(gemma), seq_len=4096, **wide))  # type: ignore[arg-type]
    assert [space.tokens(k) for k in (1, 2)] == [(18, 16), (69, 48)] and space.dim.size(2) == (256, 511)
    short = image_space(QLoRAConfig(model=str(gemma), seq_len=64, **wide))  # type: ignore[arg-type]
    assert (short.limit, short.limited_by) == (1, "seq-len")


def test_a_tiling_answer_names_the_run_of_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command on tiny LLaVA-NeXT: SIZE every image fits, the requested 448x448 in the last run (no search
    run): the answer is any size from 57x57 up, 88 image tokens, and the line says why it stops there."""
    from vramguard.cli.app import main

    out = tmp_path / "e.json"
    argv = ["estimate", "--model", str(VLM / "tiny-llava-next.json"), "--image-size", "448x448", "--seq-len", "512"]
    assert main([*argv, *BASE[:-1], "--fit", "100GiB", "--fit-dim", "image", "--json", str(out)]) == 0
    fit = json.loads(out.read_text())["estimate"]["fit"]
    image = fit["image"]
    assert (image["largest"], image["same_from"], image["image_tokens"], fit["run_count"]) == ("57x57", "57x57", 88, 0)
    assert (image["follows"], image["step"], image["limited_by"]) == ("tokens", None, "tokens")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fit: "))
    assert "is any size from 57x57 up (88 image tokens" in line and "gives no larger image at this aspect" in line


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        (VLM / "tiny-gemma3.json", [], "same 16 image token(s): there is no image size to search"),
        (VLM / "tiny-gemma3.json", [], "with --pan-and-scan its processor adds crops"),
        (VLM / "tiny-idefics3.json", ["--image-size", "300x600"], "every 1:2 image from 16 to 4096 pixels"),
        (VLM / "tiny-mllama.json", [], "search --fit-dim batch or seq at this --image-size"),
        ("tiny-qwen3", [], "has no images"),
        (QWEN25, ["--seq-len", "4"], "not even a 56x56 image fits seq-len 4"),  # min_pixels: 56x56 the least
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


GLM4V = VLM / "tiny-glm4v.json"


def _glm4v(seq: int, **kw: object) -> QLoRAConfig:
    return QLoRAConfig(model=str(GLM4V), seq_len=seq, batch=1, target_modules="all-linear", **kw)  # type: ignore[arg-type]


def _at(aspect: tuple[int, int], side: int) -> tuple[int, int]:
    from vramguard.estimate.fit_image import _probed

    return _probed(aspect, side)


@pytest.mark.parametrize("aspect", [(1, 1), (3, 4)])
def test_glm4v_is_searched_over_the_sizes_its_processor_makes(aspect: tuple[int, int]) -> None:
    """GLM-4V's processor (its own smart_resize: sides in 28-pixel steps, an image taken as 2 frames bounded
    together by 12,544..11,760,000 pixels) was refused: its token count changes at nearly every size (1,112 times
    from 16 to 4096 pixels at 3:4), more than the tiling probe's 96 calls. What the search relies on, over the
    processor's real outputs: (1) its values cover what the processor makes: the image processor's own count
    (``get_number_of_image_patches``) of an image of every longest side from 16 to 4096 pixels at the ratio is the
    count of one of the values' sizes (through the value's resize, ``ImageSteps.resized``); (2) along the values,
    fewest pixels first, the full processor (Glm4vProcessor on a real image) keeps each size as it is
    (``image_grid_thw`` [1, h/14, w/14]) and writes strictly more image tokens, h*w/784 of them: so the bisection
    over values is a bisection over the tokens and the answer's image gets exactly its tokens; (3) between the
    smallest image it keeps and the largest, the count never falls as the image grows."""
    import transformers

    from vramguard.workload.vision import family_processor, image_token_id, synthetic_image

    h, w = aspect
    space = image_space(_glm4v(512, image_size=f"{3 * h}x{3 * w}"))
    assert (space.dim.step, space.limited_by) == (28, "seq-len")
    sizes = [space.dim.size(k) for k in range(1, space.limit + 1)]
    every = processor_sizes(space.steps, aspect)  # up to max_pixels: what the processor makes of any image
    assert every[: len(sizes)] == tuple(sizes) and every[-1][0] * every[-1][1] * 2 <= 11_760_000
    made = {a * b // 784 for a, b in every}
    image = transformers.Glm4vImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2)
    counts = [image.get_number_of_image_patches(*_at(aspect, side)) // 4 for side in range(16, 4097)]
    assert set(counts) <= made  # (1)
    c = space.hf_config
    processor = family_processor(space.family, c, 512)
    image_id = image_token_id(space.family, c, 512)
    tokens = []
    for a, b in sizes:
        out = processor(images=[synthetic_image(a, b, 0)], text=[space.family.placeholder], return_tensors="pt")
        assert out["image_grid_thw"].tolist() == [[1, a // 14, b // 14]]
        tokens.append(int((out["input_ids"] == image_id).sum()))
    assert tokens == [a * b // 784 for a, b in sizes] and tokens == sorted(set(tokens))  # (2)
    # from the first image of the fewest tokens (at 3:4 a 71x94 one: 84x84, 9 tokens; a smaller one is enlarged
    # to 84x112, 12) to the first of the most (past it max_pixels shrinks each image to about the same size)
    first = next(i for i, n in enumerate(counts) if n == min(tokens))
    last = counts.index(max(made))
    assert all(x <= y for x, y in zip(counts[first:last], counts[first + 1 : last + 1]))  # (3)


def _glm4v_estimate(argv: list[str], tmp: Path) -> dict:  # type: ignore[type-arg]
    from vramguard.cli.app import main

    out = tmp / "e.json"
    assert main(["estimate", "--model", str(GLM4V), *argv, *BASE, "--json", str(out)]) in (0, 1)
    return json.loads(out.read_text())["estimate"]  # type: ignore[no-any-return]


def test_glm4v_fit_dim_image_answers_at_the_seq_len_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command that was refused ("more sizes than --fit-dim image probes"): at seq 512 and a SIZE every image
    fits, the answer is 616x616, the largest size GLM-4V's processor makes whose row 512 tokens hold (484 image
    tokens and its 2 markers), the requested shape's own run (no search run); the line says seq-len holds it."""
    argv = ["--image-size", "616x616", "--seq-len", "512", "--fit", "100GiB", "--fit-dim", "image"]
    fit = _glm4v_estimate(argv, tmp_path)["fit"]
    image = fit["image"]
    assert (image["largest"], image["limit"], image["limited_by"], image["step"]) == ("616x616", "616x616", "seq-len", 28)
    assert (image["image_tokens"], image["row_tokens"], fit["run_count"]) == (484, 486, 0)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fit: "))
    assert "is 616x616 (484 image tokens" in line and "28-pixel steps" in line


@pytest.mark.slow  # two tiny estimates and the search's runs: about 40 s on a shared 2-core machine
def test_glm4v_answer_is_the_largest_image_whose_estimate_fits(tmp_path: Path) -> None:
    """SIZE between the estimates (the same command, no --fit) of 196x196 and 224x224: the answer is 196x196, 49
    image tokens (one per 28x28 pixels), within the search's bound of meta runs."""
    at = {s: _glm4v_estimate(["--image-size", f"{s}x{s}", "--seq-len", "512"], tmp_path)["total_bytes"] for s in (196, 224)}
    assert at[196] < at[224]
    argv = ["--image-size", "84x84", "--seq-len", "512", "--fit", f"{(at[196] + at[224]) // 2}B", "--fit-dim", "image"]
    fit = _glm4v_estimate(argv, tmp_path)["fit"]
    assert (fit["image"]["largest"], fit["image"]["image_tokens"], fit["image"]["row_tokens"]) == ("196x196", 49, 51)
    assert fit["run_count"] <= fit["bound"] <= 8
