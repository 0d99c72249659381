"""The generated tables of docs/techniques.md and docs/published.md: their scripts run (on a tiny preset, in
seconds), each page holds exactly what its script renders from its results JSON (no hand-typed number), every
published figure has its source and quote, and (``-m slow``) a full-size row re-run gives the committed bytes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "docs" / "scripts"
FIXTURES = ROOT / "fixtures" / "published"


def script(name: str) -> ModuleType:
    """docs/scripts/NAME.py as a module (the scripts are not a package; they put their folder on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"docs_scripts_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def between(page: Path, marker: str) -> str:
    text = page.read_text()
    return text.split(f"<!-- BEGIN {marker} -->\n", 1)[1].split(f"\n<!-- END {marker} -->", 1)[0]


def test_the_techniques_script_runs_on_a_tiny_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    techniques = script("techniques")
    page = tmp_path / "page.md"
    page.write_text("head\n<!-- BEGIN techniques table -->\nold\n<!-- END techniques table -->\ntail\n")
    results = tmp_path / "r.json"
    rows = "0,8"  # the baseline and rsLoRA (which changes no byte)
    assert (
        techniques.main(
            [
                "--model",
                "tiny-llama-hf",
                "--seq",
                "32",
                "--rows",
                rows,
                "--results",
                str(results),
                "--page",
                str(page),
            ]
        )
        == 0
    )
    data = json.loads(results.read_text())
    assert [r["technique"] for r in data["rows"]] == ["baseline QLoRA", "+ rsLoRA"]
    base, rslora = (r["runs"]["32"] for r in data["rows"])
    assert rslora["allocator_peak_bytes"] == base["allocator_peak_bytes"]  # use_rslora: a value, no byte
    text = page.read_text()
    assert text.startswith("head\n") and text.endswith("tail\n") and "old" not in text
    assert "| + rsLoRA | `use_rslora: true` |" in text and "0 B (same bytes)" in text


@pytest.mark.parametrize(
    ("name", "page", "marker", "results"),
    [
        ("techniques", "techniques.md", "techniques table", "measurements/techniques/llama-3.1-8b.json"),
        ("published", "published.md", "published table", "measurements/published/estimates.json"),
    ],
)
def test_each_page_holds_what_its_script_renders(name: str, page: str, marker: str, results: str) -> None:
    module = script(name)
    data = json.loads((ROOT / "docs" / results).read_text())
    rendered = (
        module.render(data)
        if name == "techniques"
        else module.render(json.loads((FIXTURES / "figures.json").read_text()), data)
    )
    assert between(ROOT / "docs" / page, marker) == rendered.rstrip()


def test_every_published_figure_has_its_source_and_a_config_that_parses() -> None:
    from vramguard.workload.run_config import load_run_config

    figures = json.loads((FIXTURES / "figures.json").read_text())
    ids = [r["id"] for r in figures["rows"]]
    assert len(ids) == len(set(ids))
    for row in figures["rows"]:
        assert row["urls"] and all(u.startswith("https://") for u in row["urls"]), row["id"]
        assert row["quote"] and row["kind"] in figures["kinds"], row["id"]
        assert load_run_config(FIXTURES / row["config"]).values["model"], row["id"]
        # the trainer the source used, named in the command the page prints (issue 44)
        assert row["flags"][:1] == ["--trainer"] and row["flags"][1] in ("sft", "trainer", "loop"), row["id"]


@pytest.mark.slow
def test_a_full_size_row_re_run_gives_the_committed_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One published row (LLaMA-7B QLoRA on a T4) and the techniques baseline at 2048, run again."""
    monkeypatch.chdir(ROOT)
    published = script("published")
    committed = json.loads((ROOT / "docs" / "measurements" / "published" / "estimates.json").read_text())
    row = next(
        r
        for r in json.loads((FIXTURES / "figures.json").read_text())["rows"]
        if r["id"].startswith("hf-4bit")
    )
    again = published.run_row(row, FIXTURES)
    assert again["total_bytes"] == committed[row["id"]]["total_bytes"]
    techniques = script("techniques")
    data = techniques.run("llama-3.1-8b", [2048], techniques.ROWS[:1])
    old = json.loads((ROOT / "docs" / "measurements" / "techniques" / "llama-3.1-8b.json").read_text())
    assert (
        data["rows"][0]["runs"]["2048"]["allocator_peak_bytes"]
        == old["rows"][0]["runs"]["2048"]["allocator_peak_bytes"]
    )


def test_the_fsdp_published_table_is_what_its_run_renders() -> None:
    """docs/distributed.md's published-vs-estimated table: each estimated cell and difference is what
    docs/scripts/fsdp_published.py reads from the committed run, not typed."""
    published = script("fsdp_published")
    runs = ROOT / "docs" / "measurements" / "2026-11-24-fsdp-published"
    table = published.render(runs)
    assert between(ROOT / "docs" / "distributed.md", "fsdp published table") == table
    assert "31.95 GiB total" in table and "−3.6 % if decimal" in table


def test_the_70b_terms_table_is_what_its_run_renders() -> None:
    """docs/distributed.md's "A 70B shape at N = 2" table is rendered from the per-rank table's committed run."""
    per_rank = script("per_rank")
    runs = ROOT / "docs" / "measurements" / "2026-11-24-per-rank"
    assert between(ROOT / "docs" / "distributed.md", "70b terms table") == per_rank.terms_table(runs)


def test_the_per_rank_table_is_what_its_runs_render() -> None:
    """docs/distributed.md's per-rank table (7B/8B/70B x N = 1, 2, 4, 8) is exactly what
    docs/scripts/per_rank.py renders from the committed runs: no hand-typed byte."""
    per_rank = script("per_rank")
    runs = ROOT / "docs" / "measurements" / "2026-11-24-per-rank"
    assert between(ROOT / "docs" / "distributed.md", "per-rank table") == per_rank.render(runs)


def test_the_routing_search_runs_and_no_random_routing_passes_the_named_bounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/scripts/routing_search.py (the search behind docs/audit.md's routing low and high): its random
    counts route every token to top_k different experts, none over the tokens; on tiny-mixtral a few of them
    stay within ``same`` and ``skewed`` (exit 0), and its row names the named routings' peaks."""
    import random

    search = script("routing_search")
    rng = random.Random(1)
    for _ in range(500):
        experts = rng.randint(2, 9)
        top_k, tokens = rng.randint(1, experts), rng.randint(1, 40)
        counts = search.random_counts(rng, tokens, top_k, experts)
        assert (
            len(counts) == experts
            and sum(counts) == tokens * top_k
            and 0 <= min(counts) <= max(counts) <= tokens
        )
    assert search.main(["--random", "2", "--presets", "tiny-mixtral"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny-mixtral |")]
    same, balanced, skewed = (int(c.replace(",", "")) for c in row.split("|")[2:5])
    assert same < balanced < skewed


def test_the_vlm_pages_hold_what_their_runs_render() -> None:
    """docs/vlm.md's tables and the seed's case study in docs/case-studies.md: each block is what
    docs/scripts/vlm.py renders from the committed runs under docs/measurements/2026-11-29-vlm/ (every run of
    the script is there, none typed), and the runs are what the script's commands ask."""
    vlm = script("vlm")
    runs = vlm.load()
    assert sorted(runs) == sorted(vlm.commands())
    for marker, (page, render) in vlm.PAGES.items():
        assert between(ROOT / "docs" / page, marker) == render(runs).rstrip(), marker
    for name, argv in vlm.commands().items():
        config = runs[name]["config"]
        assert config["model"] == argv[argv.index("--model") + 1] and str(config["seq_len"]) in argv, name
        assert config.get("image_size", "") == (argv[argv.index("--image-size") + 1] if "--image-size" in argv else "")


@pytest.mark.slow
def test_a_full_size_vlm_run_again_gives_the_committed_bytes(tmp_path: Path) -> None:
    """One committed run of docs/vlm.md (Qwen3-VL-8B, one 448x448 image, seq 512) run again by the script: the
    same bytes (about 1.5 minutes of a 2-core CPU)."""
    vlm = script("vlm")
    vlm.run("q3-448-512", vlm.commands()["q3-448-512"], tmp_path)
    again = json.loads((tmp_path / "q3-448-512.json").read_text())
    committed = vlm.load()["q3-448-512"]
    for key in ("total_bytes", "allocator_peak_bytes", "weights_bytes"):
        assert again["estimate"][key] == committed["estimate"][key], key
    assert vlm.stacks(again) == vlm.stacks(committed)
