"""README's and the docs pages' code blocks work as printed: a user copies them, so a moved module, a renamed
argument or a misspelt option must fail here, not in their hands.

The pages are README.md and docs/*.md (the site's pages; docs/measurements/ holds records of runs, kept as
they came back). Each python block is run verbatim where it can run on a CPU, or named in
:data:`FRAGMENTS` with the reason it cannot; every `vramguard` command line of a shell or text block is
parsed by the real argument parser; every `vramguard.`-dotted name in the prose resolves."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))

#: python blocks that are not run, by their first line, with the reason; they are parsed and their vramguard
#: imports resolve like every other block's
FRAGMENTS = {
    "from vramguard.measure.ledger import SavedTensorLedger": "measures the reader's own model and batch, on cuda",
    '@pytest.mark.vram_budget("1.5 GiB")                       # peak live bytes above the start': (
        "a test's decorators; tests/test_plugin_markers.py runs the markers"
    ),
}


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(page: Path, lang: str = "python") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(), re.DOTALL)


def _all_blocks(lang: str = "python") -> list[tuple[Path, str]]:
    return [(page, block) for page in PAGES for block in _blocks(page, lang)]


def _block(first_line: str, page: str) -> str:
    found = [b for b in _blocks(ROOT / page) if b.startswith(first_line)]
    assert len(found) == 1, f"{page} has {len(found)} python blocks starting {first_line!r}"
    return found[0]


def _run(first_line: str, page: str, scope: dict | None = None) -> dict:
    scope = {} if scope is None else scope
    exec(compile(_block(first_line, page), f"{page}:{first_line.splitlines()[0]}", "exec"), scope)  # noqa: S102
    return scope


#: the python blocks the tests below run, by page and first line
RUN = {
    ("docs/trainer.md", "import torch\nfrom datasets import Dataset"),
    ("docs/trainer.md", "from tokenizers import Tokenizer, models"),
    ("docs/case-studies.md", "import torch\nfrom trl.kernels import ChunkedLogProbFunction"),
    ("docs/case-studies.md", "from vramguard.grad import patches"),
    ("docs/grad-equivalence.md", "# mypkg/patches.py"),
    ("docs/architecture.md", "from vramguard.estimate.techniques import BUILT_IN, offloading"),
}


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return False
    return True


def test_every_vramguard_import_in_the_pages_resolves() -> None:
    """Each ``from vramguard... import name`` / ``import vramguard...`` of every python block of every page."""
    missing = []
    for page, block in _all_blocks():
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vramguard"):
                module = importlib.import_module(node.module)
                for a in node.names:
                    if not hasattr(module, a.name) and not _is_module(f"{node.module}.{a.name}"):
                        missing.append(f"{_name(page)}: {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("vramguard"):
                        importlib.import_module(a.name)
    assert not missing, missing


def test_every_python_block_is_run_or_a_named_fragment() -> None:
    """A new example is run by a test here, or said to be a fragment, with the reason; the lists name no
    block that is gone."""
    blocks = _all_blocks()
    untested = [
        f"{_name(page)}: {block.splitlines()[0]!r}"
        for page, block in blocks
        if not any(_name(page) == p and block.startswith(first) for p, first in RUN)
        and block.splitlines()[0] not in FRAGMENTS
        and not (page == README and any(block == b for p, b in blocks if p != README))
    ]
    assert untested == [], untested
    gone = [first for p, first in RUN if not any(_name(q) == p and b.startswith(first) for q, b in blocks)]
    gone += [first for first in FRAGMENTS if not any(b.splitlines()[0] == first for _, b in blocks)]
    assert gone == [], gone


def test_the_readmes_examples_are_the_docs_own() -> None:
    """README shows copies: each python block is, verbatim, a block of a docs page (which the tests run), and
    its quick start is the docs home page's."""
    docs = [b for p, b in _all_blocks() if p != README]
    assert [b for b in _blocks(README) if b not in docs] == []
    assert _blocks(README, "bash")[0] == _blocks(ROOT / "docs/index.md", "bash")[0]


def test_the_trainer_and_sft_examples_run(tmp_path, monkeypatch) -> None:
    """The Trainer / TRL page's scripts, verbatim: Trainer, then SFTTrainer with the same callback; each writes
    the report and leaves it in ``cb.report``."""
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    scope = _run("import torch\nfrom datasets import Dataset", "docs/trainer.md")
    report = scope["cb"].report
    assert report is not None and report.config["trainer"] == "Trainer" and len(report.steps) == 3
    assert (tmp_path / "trainer.json").is_file()
    _run("from tokenizers import Tokenizer, models", "docs/trainer.md", scope)
    report = scope["cb"].report
    assert report is not None and report.config["trainer"] == "SFTTrainer" and len(report.steps) == 3


def test_the_chunked_logprob_reproducer_runs(capsys) -> None:
    """The TRL reproducer prints the two peaks it claims (the wide one far above the narrow one)."""
    pytest.importorskip("trl")
    _run("import torch\nfrom trl.kernels import ChunkedLogProbFunction", "docs/case-studies.md")
    peaks = dict(line.split() for line in capsys.readouterr().out.strip().splitlines())
    assert set(peaks) == {"32768", "512"} and int(peaks["32768"]) > 4 * int(peaks["512"]), peaks


def test_the_check_a_patch_example_runs(capsys) -> None:
    """ "Check a patch in five lines": the 8-bit no_grad patch applies and, as the page says, saves 0 B."""
    _run("from vramguard.grad import patches", "docs/case-studies.md")
    out = capsys.readouterr().out
    assert out.startswith("Applicability(ok=True") and "\n0 B saved; " in out, out[:500]


def test_the_own_patch_example_makes_a_patch() -> None:
    from vramguard.grad.patches import Patch

    patch = _run("# mypkg/patches.py", "docs/grad-equivalence.md")["make"]()
    assert isinstance(patch, Patch) and patch.name == "my-no-grad" and patch.applies()


# -- the vramguard command lines of shell and text blocks ---------------------------------------------------


def command_lines(text: str, prompt: str = "") -> list[list[str]]:
    """Each ``vramguard ...`` command of a block (after ``prompt``, e.g. ``$ `` in a block of printed output;
    ``\\`` continuations and pipes handled) as its arguments; synopses with ``[optional]`` parts or ``...``
    are left out."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line.startswith(prompt + "vramguard ") or "[" in line or "..." in line:
            continue
        line = line.removeprefix(prompt)
        args = shlex.split(line.split(" | ")[0].split(" && ")[0], comments=True)
        found.append(args[1:])
    return found


def test_every_vramguard_command_in_the_pages_parses() -> None:
    """Options that do not exist, or a subcommand that is gone, fail here (argparse's error becomes
    UsageError)."""
    from vramguard.cli.app import build_parser

    commands = [
        (page, args)
        for lang, prompt in (("bash", ""), ("text", "$ "))
        for page, b in _all_blocks(lang)
        for args in command_lines(b, prompt)
    ]
    assert len(commands) >= 8, commands  # the extractor finds them
    for page, args in commands:
        build_parser().parse_args(args)  # raises on an unknown option or subcommand


def test_a_misspelt_option_is_caught() -> None:
    from vramguard.cli.app import build_parser
    from vramguard.errors import UsageError

    (args,) = command_lines("$ vramguard estimate --model tiny-llama --seq-lenght 64 \\\n  --quiet\n", "$ ")
    with pytest.raises(UsageError):
        build_parser().parse_args(args)


# -- dotted names in the prose ------------------------------------------------------------------------------

DOTTED = re.compile(r"(?<![\w./-])vramguard(?:\.[A-Za-z_]\w*)+")


def unresolved(text: str) -> list[str]:
    """The ``vramguard.``-dotted names in ``text`` that are neither a module nor an attribute of one (the
    longest importable prefix, then getattr for the rest); the entry-point groups of patches and of techniques
    are names too."""
    from vramguard.estimate import techniques
    from vramguard.grad.patches import ENTRY_POINT_GROUP

    stale = []
    for name in sorted(set(DOTTED.findall(text)) - {ENTRY_POINT_GROUP, techniques.ENTRY_POINT_GROUP}):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            if _is_module(".".join(parts[:cut])):
                obj = importlib.import_module(".".join(parts[:cut]))
                break
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            stale.append(name)
    return stale


def test_every_dotted_name_in_the_pages_resolves() -> None:
    stale = {_name(page): unresolved(page.read_text()) for page in PAGES}
    assert {page: names for page, names in stale.items() if names} == {}


def test_a_stale_dotted_name_is_found() -> None:
    """The names that were stale in the README before the docs site, a module and an attribute."""
    text = "see `vramguard.report.AuditReport` and `vramguard.capabilities`, not `vramguard.step.report.AuditReport`"
    assert unresolved(text) == ["vramguard.capabilities", "vramguard.report.AuditReport"]
    assert unresolved("`vramguard.measure.ledger.NoSuchThing`") == ["vramguard.measure.ledger.NoSuchThing"]
    assert unresolved("machine_info.vramguard.packages, docs/vramguard.json, vramguard.patches") == []


def test_the_technique_walk_through_runs() -> None:
    """docs/architecture.md's technique is the registry's own value, field by field."""
    scope = _run("from vramguard.estimate.techniques import BUILT_IN, offloading", "docs/architecture.md")
    assert scope["TECHNIQUE"].name == "offload_activations"
