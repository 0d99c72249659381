"""Helpers of the tests that hold a typed docs table to the run it reports (imported by the test modules)."""

from __future__ import annotations

from pathlib import Path

DISTRIBUTED = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"


def typed_figures(page: Path, heading: str) -> dict[str, str]:
    """The first two columns (term, figure) of the Markdown table that follows ``heading`` on ``page`` (the
    table is the first block after the heading's paragraph)."""
    table = page.read_text().split(heading, 1)[1].split("\n\n", 2)[1]
    typed = {}
    for line in table.splitlines()[2:]:
        term, figure = (c.strip() for c in line.strip("|").split("|")[:2])
        typed[term] = figure
    return typed


def assert_figures(typed: dict[str, str], measured: dict[str, str]) -> None:
    """Each measured term's figure is the one typed for the row whose term starts with its name (one row each)."""
    for term, value in measured.items():
        [figure] = [f for name, f in typed.items() if name.startswith(term)]
        assert figure == value, (term, figure, value)
