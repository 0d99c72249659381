"""The docs site builds with ``mkdocs build --strict``, every relative link of README and the docs points at
something that exists, every page is in the nav, and docs/measurements/index.md names every folder and file
of docs/measurements/. (The code blocks and dotted names of the pages: tests/test_readme.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MEASUREMENTS = DOCS / "measurements"

LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(page: Path) -> list[str]:
    """Relative link targets of a Markdown page (anchors dropped) that are neither a file nor a folder."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if path and not (page.parent / path).exists():
            out.append(target)
    return out


def _pages() -> list[Path]:
    """README and every Markdown page of docs/ that a person wrote (the results stores hold none; the sweep's
    report.md is generated)."""
    return [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "store" not in p.parts)]


def test_every_relative_link_resolves() -> None:
    assert [f"{page.relative_to(ROOT)}: {target}" for page in _pages() for target in broken_links(page)] == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "there").mkdir()
    page = tmp_path / "p.md"
    page.write_text(
        "[a](there/) [b](gone/run1/x.log#top) [c](https://x.org/y) [d](#here)\n```\n[e](nope)\n```\n"
    )
    assert broken_links(page) == ["gone/run1/x.log#top"]


def test_every_docs_page_is_in_the_nav() -> None:
    """Top-level pages and the measurement campaigns' READMEs (mkdocs --strict also warns about an omitted
    page; this says which without mkdocs installed)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [*DOCS.glob("*.md"), MEASUREMENTS / "index.md", *MEASUREMENTS.glob("*/README.md")]
    assert [str(p.relative_to(DOCS)) for p in pages if str(p.relative_to(DOCS)) not in nav] == []


def test_the_measurements_index_names_every_folder_and_file() -> None:
    """Every entry of docs/measurements/ and of each campaign folder is named in the index (a results store's
    inside is described once, as the store's layout)."""
    index = (MEASUREMENTS / "index.md").read_text()
    entries = [p for p in MEASUREMENTS.iterdir() if p.name != "index.md"]
    entries += [p for campaign in MEASUREMENTS.iterdir() if campaign.is_dir() for p in campaign.iterdir()]
    unnamed = [
        str(p.relative_to(MEASUREMENTS))
        for p in entries
        if f"`{p.name}{'/' if p.is_dir() else ''}`" not in index
    ]
    assert unnamed == []


def test_no_measurement_is_named_by_number_alone() -> None:
    """Run folders say what they hold after their number (``run3-audits-after-the-attention-fix``), estimate
    files are ``estimate-<model>-s<seq>-b<batch>...``, not ``est5-ckpt``."""
    bare = [
        str(p.relative_to(MEASUREMENTS))
        for p in MEASUREMENTS.rglob("*")
        if re.fullmatch(r"run\d+", p.name) or (p.name.startswith("est") and not p.name.startswith("estimate"))
    ]
    assert bare == []


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (as CI runs it): a broken link to a page or file, a page left out of the nav
    or a bad config is an error."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="the docs extra is not installed (pip install -e '.[docs]')")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "measurements" / "index.html").is_file()
