"""The version matrix: run the suites against each release of one library, as ``vramguard bisect`` does.

Why: the suites promise a true verdict on every release in the declared range. The matrix workflow
(``.github/workflows/version-matrix.yml``) needs three small steps that bisect already has the parts
for: the releases in range (the package index, as bisect lists them), one overlay per release from the
*same* cache (``vramguard.bisect.overlay``: installed once, then reused by bisect and by later matrix runs), and
a release x suite table from the suites' JUnit XML files.

    python -m vramguard.bisect.matrix releases bitsandbytes ">=0.46"          # JSON list, for a CI matrix
    python -m vramguard.bisect.matrix overlay bitsandbytes 0.47.0             # prints the overlay dir
    python -m vramguard.bisect.matrix table results/                          # results/<label>/<suite>.xml

Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from vramguard.bisect.overlay import InstallError, OverlayCache, default_cache_dir
from vramguard.bisect.pkgindex import IndexOptions, available_versions
from vramguard.errors import UsageError
from vramguard.units import parse_size

OUTCOMES = ("passed", "skipped", "xfailed", "xpassed", "failed", "error")


def releases(package: str, spec: str, options: IndexOptions | None = None) -> list[str]:
    """Final releases of ``package`` that satisfy ``spec`` (e.g. ``>=0.46``), oldest first."""
    try:
        want = SpecifierSet(spec)
    except InvalidSpecifier:
        raise UsageError(f"not a version specifier: {spec!r}") from None
    return [str(v) for v in available_versions(package, options or IndexOptions()) if v in want]


@dataclass
class SuiteResult:
    """One suite on one release in the matrix: pytest's outcome counts (from JUnit XML), its time and what
    went wrong reading it."""

    counts: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    #: the ``processor`` property the run recorded (the root conftest writes it), "" when absent
    processor: str = ""

    def ok(self) -> bool:
        """Whether the suite is green: no failure, no error and no unexpected pass of a known defect
        (xpassed)."""
        return not (self.counts["failed"] or self.counts["error"] or self.counts["xpassed"])

    def cell(self) -> str:
        """The table cell: the non-zero outcome counts and the seconds, e.g. ``12 passed, 1 skipped (40 s)``."""
        parts = [f"{self.counts[o]} {o}" for o in OUTCOMES if self.counts[o]]
        return (", ".join(parts) or "nothing ran") + f" ({self.seconds:.0f} s)"


def read_junit(path: Path) -> SuiteResult:
    """Outcome counts of a pytest ``--junitxml`` file (xfail / strict XPASS told apart)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise UsageError(f"{path}: not a JUnit XML file ({exc})") from None
    res = SuiteResult()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise UsageError(f"{path}: no <testsuite> element")
    for suite in suites:
        res.seconds += float(suite.get("time", 0) or 0)
        for prop in suite.iter("property"):
            if prop.get("name") == "processor" and not res.processor:
                res.processor = prop.get("value", "")
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
            if error is not None:
                res.counts["error"] += 1
                res.problems.append(f"{name}: {error.get('message', '')[:200]}")
            elif failure is not None:
                strict_xpass = "XPASS(strict)" in (failure.get("message") or "")
                res.counts["xpassed" if strict_xpass else "failed"] += 1
                res.problems.append(f"{name}: {(failure.get('message') or '')[:200]}")
            elif skipped is not None:
                res.counts["xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"] += 1
            else:
                res.counts["passed"] += 1
    return res


def table(root: Path) -> tuple[str, bool]:
    """Markdown table of ``root/<label>/<suite>.xml``; and whether every suite is green."""
    if not root.is_dir():
        raise UsageError(f"{root}: no such directory")
    rows: dict[str, dict[str, SuiteResult]] = {}
    for xml in sorted(root.glob("*/*.xml")):
        rows.setdefault(xml.parent.name, {})[xml.stem] = read_junit(xml)
    if not rows:
        raise UsageError(f"{root}: no <label>/<suite>.xml files")
    suites = sorted({s for r in rows.values() for s in r})
    lines = ["| release | processor | " + " | ".join(suites) + " |", "|---|---|" + "---|" * len(suites)]
    green = True
    problems = []
    for label in sorted(rows, key=_label_key):
        cells = []
        for s in suites:
            r = rows[label].get(s)
            if r is None:
                cells.append("**missing**")
                green = False
                continue
            green &= r.ok()
            cells.append(r.cell() if r.ok() else f"**{r.cell()}**")
            problems += [f"{label} {s}: {p}" for p in r.problems]
        cpus = sorted({r.processor for r in rows[label].values()})
        cpu = " / ".join(c or "not recorded" for c in cpus)
        lines.append(f"| {label} | {cpu} | " + " | ".join(cells) + " |")
    if problems:
        lines += ["", "Failures:", *[f"* {p}" for p in problems[:50]]]
    return "\n".join(lines), green


def _label_key(label: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    name, _, ver = label.rpartition("-")
    try:
        return (name, Version(ver))
    except InvalidVersion:
        return (label, Version("0"))


def main(argv: list[str] | None = None) -> int:
    """``python -m vramguard.bisect.matrix``: the three steps of the matrix workflow (``releases``,
    ``overlay``, ``table``, see the module docstring); bad input is one line and exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(args) == 3 and args[0] == "releases":
            print(json.dumps(releases(args[1], args[2])))
            return 0
        if len(args) in (3, 4) and args[0] == "overlay":
            cache = OverlayCache(default_cache_dir(), parse_size(args[3] if len(args) == 4 else "10 GiB"))
            t = time.monotonic()
            try:
                ov = cache.get(args[1], args[2], IndexOptions().pip_args())
            except InstallError as exc:
                raise UsageError(f"cannot install {args[1]}=={args[2]}: {exc}") from None
            how = (
                f"installed in {time.monotonic() - t:.1f} s"
                if ov.installed_now
                else "cached: installed nothing"
            )
            print(f"{args[1]} {args[2]}: {how} ({ov.path})", file=sys.stderr)
            print(ov.path)
            return 0
        if len(args) == 2 and args[0] == "table":
            text, green = table(Path(args[1]))
            print(text)
            return 0 if green else 1
    except UsageError as exc:
        print(f"vramguard matrix: error: {exc}", file=sys.stderr)
        return 2
    print(
        "usage: python -m vramguard.bisect.matrix releases PKG SPEC | overlay PKG VERSION [CACHE_MAX] | table DIR",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
