"""The pages of one run (``audit --html``, ``estimate --html``) and of two (``compare A B --html``) in the
headless Chromium of ``tests/test_report_browser.py``: no console message of level error or warning, no
exception, no request but the page itself, every plot present and non-blank, the peak ringed in the plot
and the "at the peak" table present. The last test plants one fault per check into a real page and sees
each check fail."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_report_browser import Browser, ink, load, pytestmark  # noqa: F401 (pytestmark: the same skip rule)

from vramguard.cli.app import main

TINY = ["--model", "tiny-llama", "--seq-len", "16", "--batch", "1", "--steps", "2"]


def check(browser: Browser, page: Path) -> dict[str, Any]:
    """What the page did and shows: requests, problems, each plot's ink, the peak marks and the peak table."""
    seen = load(browser, page)
    return {
        "requests": [r for r in seen["requests"] if r != seen["url"]],
        "problems": seen["problems"],
        "inks": [
            ink(browser, box) if box["svg"] == 1 and box["w"] > 100 and box["h"] > 100 else 0.0
            for box in seen["plots"]
        ],
        "peaks": browser.evaluate("[...document.querySelectorAll('svg [id^=peak]')].map(e => e.id)"),
        "peak_table": browser.evaluate("document.querySelectorAll('table.at-peak tr').length"),
    }


def clean(result: dict[str, Any], plots: int, peaks: list[str], table: bool = True) -> None:
    assert result["requests"] == [], result["requests"]
    assert result["problems"] == [], result["problems"]
    assert len(result["inks"]) == plots and all(i > 0.01 for i in result["inks"]), result["inks"]
    assert result["peaks"] == peaks
    assert (result["peak_table"] > 2) is table


@pytest.fixture
def chromium(tmp_path: Path):
    b = Browser(tmp_path / "profile")
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("pages")
    paths = {name: out / f"{name}.html" for name in ("audit", "estimate", "compare", "estimate-seq")}
    docs = {name: out / f"{name}.json" for name in ("audit", "estimate", "estimate-seq")}
    assert main(["audit", *TINY, "--html", str(paths["audit"]), "--json", str(docs["audit"]), "--quiet"]) == 0
    assert (
        main(
            ["estimate", *TINY, "--html", str(paths["estimate"]), "--json", str(docs["estimate"]), "--quiet"]
        )
        == 0
    )
    longer = ["--seq-len", "48"]
    argv = [
        "estimate",
        *TINY,
        *longer,
        "--html",
        str(paths["estimate-seq"]),
        "--json",
        str(docs["estimate-seq"]),
    ]
    assert main([*argv, "--quiet"]) == 0
    paths["estimate-json"], paths["estimate-seq-json"] = docs["estimate"], docs["estimate-seq"]
    return paths


def test_the_audit_and_estimate_pages_load_clean_with_the_peak_marked(
    chromium: Browser, pages: dict[str, Path]
) -> None:
    for name in ("audit", "estimate"):
        clean(check(chromium, pages[name]), plots=2, peaks=["peak-run"])


def test_the_compare_page_shows_both_runs_and_their_peaks(
    chromium: Browser, pages: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pages["estimate-json"], pages["estimate-seq-json"]
    assert main(["compare", str(a), str(b), "--html", str(pages["compare"])]) == 0
    clean(check(chromium, pages["compare"]), plots=2, peaks=["peak-a", "peak-b"], table=False)
    text = pages["compare"].read_text()
    peak_a = json.loads(a.read_text())["timeline"]["peak_bytes"]
    peak_b = json.loads(b.read_text())["timeline"]["peak_bytes"]
    assert peak_b > peak_a  # a longer sequence keeps more: the table's difference is positive
    assert "class='num problem'" in text


def test_each_check_can_fail_on_a_real_page(
    chromium: Browser, pages: dict[str, Path], tmp_path: Path
) -> None:
    """Faults planted into a copy of the audit page: an external image (a request), a console error, a blanked
    plot, the peak mark and the peak table removed. Each is caught by its check."""
    text = pages["audit"].read_text()
    faults = {
        "request": text.replace("<body>", "<body><img src='http://198.51.100.1/x.png'>", 1),
        "console": text.replace("<body>", "<body><script>console.error('boom')</script>", 1),
        "blank": re.sub(
            r"(<figure class='plot layers'>)<svg.*?</svg>",
            r"\1<svg width='800' height='300'></svg>",
            text,
            count=1,
            flags=re.DOTALL,
        ),
        "no peak": re.sub(r'id="peak-run"', 'id="gone"', text).replace("class='at-peak'", "class='gone'"),
    }
    results = {}
    for name, page in faults.items():
        path = tmp_path / f"{name.replace(' ', '-')}.html"
        path.write_text(page)
        results[name] = check(chromium, path)
    assert results["request"]["requests"] == ["http://198.51.100.1/x.png"]
    assert any(p.get("type") == "error" for p in results["console"]["problems"])
    assert results["blank"]["inks"][1] == 0.0 and results["blank"]["inks"][0] > 0.01
    assert results["no peak"]["peaks"] == [] and results["no peak"]["peak_table"] == 0
    for name, result in results.items():
        with pytest.raises(AssertionError):
            clean(result, plots=2, peaks=["peak-run"])


def test_the_store_report_links_a_runs_page_where_one_exists(
    chromium: Browser, pages: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    from test_trend_report import MiB, doc

    from vramguard.history.store import ResultStore

    store = ResultStore(tmp_path / "store")
    store.add(doc("0.49.0", 100 * MiB))
    second = store.add(doc("0.50.0", 100 * MiB))
    shutil.copy(pages["audit"], second.parent / "audit.html")
    report = tmp_path / "out" / "report.html"
    assert main(["report", str(store.root), "-o", str(report)]) == 0
    seen = check(chromium, report)
    assert seen["requests"] == [] and seen["problems"] == []
    links = chromium.evaluate("[...document.querySelectorAll('a.run-page')].map(a => a.href)")
    assert len(links) == 1 and links[0].endswith("/audit.html")  # the second run's; the first has none
    linked = Path(links[0].removeprefix("file://"))
    assert linked.resolve() == (second.parent / "audit.html").resolve()
    clean(check(chromium, linked), plots=2, peaks=["peak-run"])
