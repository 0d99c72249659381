"""A model reference resolved once (issue 43, item 1): a preset, a config.json, a model directory or a Hugging Face
Hub id read from a real, hand-laid Hub cache (never the network), into one :class:`ModelSpec` that the run passes on."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from vramguard.cli.app import main
from vramguard.errors import UsageError
from vramguard.workload import families
from vramguard.workload.models import ModelSpec, QLoRAConfig, presets

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-qwen2"
FAST = ["--target", "cpu", "--seq-len", "16", "--steps", "1"]


def hub_cache(root: Path, repo: str = REPO, source: Path | None = None) -> Path:
    """A Hugging Face cache holding only ``repo``'s config.json, laid out as ``huggingface_hub`` lays it out."""
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    shutil.copy(source or presets()["tiny-qwen2"], snapshot / "config.json")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(SHA)
    return root


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def test_a_hub_id_reads_config_json_from_the_cache_with_its_commit(offline_cache: Path) -> None:
    by_path = ModelSpec.load(str(presets()["tiny-qwen2"]))
    for ref in (REPO, f"{REPO}@main", f"{REPO}@{SHA}"):
        spec = ModelSpec.load(ref)
        assert (spec.origin, spec.revision, spec.ref, spec.name) == ("hub", SHA, ref, ref)
        assert (spec.fields, spec.model_type, spec.hf) == (by_path.fields, by_path.model_type, by_path.hf)


def test_estimate_of_a_hub_id_is_the_estimate_of_its_config_json(
    offline_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # unwrapped: the two references are of different lengths
    path = str(offline_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / SHA / "config.json")
    outputs = []
    for ref in (REPO, path):
        out = tmp_path / "est.json"
        assert main(["estimate", "--model", ref, *FAST, "--json", str(out)]) == 0
        text = capsys.readouterr().out
        doc = json.loads(out.read_text())
        assert doc["config"]["model"] == ref
        doc["config"]["model"] = "M"
        outputs.append((re.sub(r"steps in [0-9.]+ s", "", text.replace(ref, "M")), doc))
    (hub_text, hub_doc), (path_text, path_doc) = outputs
    assert hub_doc["config"].pop("model_revision") == SHA  # the commit the config was read at
    assert hub_text == path_text
    for doc in (hub_doc, path_doc):
        doc.pop("elapsed_s")  # wall time
    assert json.dumps(hub_doc, indent=2) == json.dumps(path_doc, indent=2)


def test_a_model_directory_and_a_hub_id_in_model_name_or_path_work_the_same(
    offline_cache: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "tiny-qwen2"
    directory.mkdir()
    shutil.copy(presets()["tiny-qwen2"], directory / "config.json")
    assert ModelSpec.load(str(directory)).origin == "directory"
    codes = []
    for ref in (str(directory), REPO):
        path = tmp_path / "run.yaml"
        path.write_text(f"model_name_or_path: {ref}\nuse_peft: true\nload_in_4bit: true\nmax_length: 16\n")
        codes.append(main(["estimate", "--config", str(path), "--target", "cpu", "--steps", "1", "--quiet"]))
    assert codes == [0, 0]


def test_a_preset_name_in_model_name_or_path_is_the_preset_as_with_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``model_name_or_path: tiny-llama`` names the preset, as ``--model tiny-llama`` does (one rule: origin_of);
    it was refused with "pass --model"."""
    docs = []
    for ref in ("tiny-llama", presets()["tiny-llama"]):
        (tmp_path / "run.yaml").write_text(f"model_name_or_path: {ref}\nuse_peft: true\nmax_length: 16\n")
        out = tmp_path / "out.json"
        code = main(["estimate", "--config", str(tmp_path / "run.yaml"), *FAST, "--quiet", "--json", str(out)])
        assert code == 0, capsys.readouterr().err
        docs.append(json.loads(out.read_text()))
    assert [d["config"]["model"] for d in docs] == ["tiny-llama", str(presets()["tiny-llama"])]
    assert docs[0]["totals"] == docs[1]["totals"]


def test_a_hub_id_not_in_the_cache_offline_is_one_line_and_exit_2(
    offline_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", "--model", "other-org/absent", *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "other-org/absent: its config.json is not in the Hugging Face cache" in err


def _http_error(kind: str) -> Exception:
    """``huggingface_hub``'s own exception class ``kind`` (made without the HTTP response its __init__ reads)."""
    from huggingface_hub import errors

    cls = getattr(errors, kind)
    exc = cls.__new__(cls)
    Exception.__init__(exc, "refused")
    return exc


@pytest.mark.parametrize(
    ("raised", "needle"),
    [
        (lambda: _http_error("GatedRepoError"), "is gated on the Hugging Face Hub"),
        (lambda: _http_error("RepositoryNotFoundError"), "not found on the Hugging Face Hub"),
        (lambda: _http_error("RevisionNotFoundError"), "revision 'v9' not found"),
        (lambda: ConnectionError("Connection refused"), "cannot fetch its config.json: Connection refused"),
    ],
)
def test_hub_errors_are_one_line(raised: Any, needle: str) -> None:
    def fetch(repo: str, revision: str | None) -> Path:
        assert (repo, revision) == ("org/name", "v9")
        raise raised()

    with pytest.raises(UsageError, match=needle) as info:
        ModelSpec.load("org/name@v9", fetch=fetch)
    assert "\n" not in str(info.value)


def test_a_near_miss_suggests_the_preset() -> None:
    with pytest.raises(UsageError, match="did you mean qwen2.5-7b[?]"):
        ModelSpec.load("qwen2.5-7B")


def test_a_model_directory_without_config_json_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="has no config.json"):
        ModelSpec.load(str(tmp_path))


def test_remote_code_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    data = {**json.loads(presets()["tiny-qwen2"].read_text()), "model_type": "my_own_lm"}
    path.write_text(json.dumps({**data, "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}))
    with pytest.raises(UsageError, match="needs trust_remote_code") as info:
        ModelSpec.load(str(path))
    assert "\n" not in str(info.value)


def count_model_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often a Hugging Face config is validated (``spec_from_hf``) and a transformers config built."""
    counts = {"validated": 0, "built": 0}

    def counting(name: str, key: str) -> None:
        real = getattr(families, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(families, name, wrapper)
        import vramguard.workload.models as models

        if hasattr(models, name):
            monkeypatch.setattr(models, name, wrapper)

    counting("spec_from_hf", "validated")
    counting("transformers_config", "built")
    return counts


@pytest.mark.parametrize("fit", [[], ["--fit", "1MiB"]], ids=["estimate", "fit"])
def test_the_model_is_validated_and_built_once_per_run(
    fit: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = count_model_reads(monkeypatch)
    code = main(["estimate", "--model", "tiny-qwen2", *FAST, "--quiet", *fit])
    assert code in (0, 1), capsys.readouterr().err
    assert counts == {"validated": 1, "built": 1}


def test_a_resolved_config_keeps_its_model_through_replace() -> None:
    import dataclasses

    config = QLoRAConfig(model="tiny-qwen2").resolved()
    probe = dataclasses.replace(config, batch=7)
    assert probe.model is config.model and probe.spec is config.spec
    assert probe.to_dict()["model"] == "tiny-qwen2" and "model_revision" not in probe.to_dict()


def test_the_hubs_retry_warnings_stay_out_of_the_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a network huggingface_hub retries its HEAD request five times, warning each time on stderr through
    its logger: the user sees only vramguard's one line (and the library's verbosity is put back)."""
    import huggingface_hub
    from huggingface_hub import errors
    from huggingface_hub.utils import logging as hub_logging

    def download(*args: Any, **kwargs: Any) -> str:
        hub_logging.get_logger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise errors.LocalEntryNotFoundError("cannot find the requested files in the disk cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    before = hub_logging.get_verbosity()
    assert main(["estimate", "--model", "org/unreachable", *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Retrying" not in err, err
    assert hub_logging.get_verbosity() == before
