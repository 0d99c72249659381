"""A Hugging Face Hub id as a model reference: its ``config.json`` only, through ``huggingface_hub``.

``hf_hub_download`` reads its cache first, honours ``HF_HUB_OFFLINE`` (and ``HF_HUB_CACHE`` / ``HF_HOME``, read
when the config is fetched, not when the library was imported) and sends the user's token (gated models). Its
errors become one line (:class:`~vramguard.errors.UsageError`). No weights are ever fetched.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from vramguard.errors import UsageError, first_line

HUB_ID = re.compile(
    r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9_.\-]+)(?:@(?P<revision>[A-Za-z0-9_.\-/]+))?"
)
"""``org/name`` or ``org/name@revision`` (a branch, tag or commit)."""

Fetch = Callable[[str, "str | None"], Path]
"""``(repo_id, revision) -> the local path of its config.json``, inside a snapshot folder named by the commit
(the Hub cache's layout: ``models--org--name/snapshots/<sha>/config.json``)."""


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cache_dir() -> str | None:
    """The Hub cache the environment names now (``HF_HUB_CACHE``, else ``HF_HOME``/hub), None for the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def hub_config(repo_id: str, revision: str | None) -> Path:
    """The default :data:`Fetch`: ``hf_hub_download(repo_id, "config.json", revision=...)``, offline when
    ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hub_logging

    offline = _truthy("HF_HUB_OFFLINE") or _truthy("TRANSFORMERS_OFFLINE")
    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # its retry warnings: a failure is said once, in fetch_config's one line
    try:
        return Path(
            hf_hub_download(
                repo_id, "config.json", revision=revision, cache_dir=cache_dir(), local_files_only=offline
            )
        )
    finally:
        hub_logging.set_verbosity(verbosity)


def fetch_config(ref: str, fetch: Fetch) -> tuple[Path, str | None]:
    """(the local config.json, the commit it was read at) of the Hub id ``ref``; one line on any failure."""
    from huggingface_hub import errors
    from huggingface_hub.constants import HF_HUB_CACHE

    m = HUB_ID.fullmatch(ref)
    assert m is not None, ref
    repo, revision = m["repo"], m["revision"]
    where = f"{repo}@{revision}" if revision else repo
    try:
        path = fetch(repo, revision)
    except errors.GatedRepoError:
        raise UsageError(
            f"model {where} is gated on the Hugging Face Hub: accept its terms on its page and log in "
            "(hf auth login, or HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise UsageError(f"model {where}: revision {revision!r} not found on the Hugging Face Hub") from None
    except errors.RepositoryNotFoundError:
        raise UsageError(
            f"model {where} not found on the Hugging Face Hub (or private: log in with hf auth login, or HF_TOKEN)"
        ) from None
    except errors.LocalEntryNotFoundError:
        raise UsageError(
            f"model {where}: its config.json is not in the Hugging Face cache ({cache_dir() or HF_HUB_CACHE}) and "
            "the Hub cannot be reached (HF_HUB_OFFLINE is set, or no network)"
        ) from None
    except errors.EntryNotFoundError:
        raise UsageError(f"model {where} has no config.json on the Hugging Face Hub") from None
    except (errors.HfHubHTTPError, errors.HFValidationError, OSError, ValueError) as exc:
        raise UsageError(f"model {where}: cannot fetch its config.json: {first_line(exc)}") from None
    commit = path.parent.name if path.parent.parent.name == "snapshots" else revision
    return path, commit
