"""Hugging Face hub ids as model and tokenizer sources: `org/name` or `org/name@revision`.

An id is turned into a local snapshot folder by huggingface_hub's own `snapshot_download`, so its cache
(HF_HUB_CACHE, HF_HOME), offline mode (HF_HUB_OFFLINE) and credentials behave as in every other Hugging
Face tool. Only configs, tokenizer files and safetensors weights are fetched: never pickles (*.bin, *.pt)
and never code (*.py); no remote code is ever run. A local folder of the same name wins over an id.
huggingface_hub is imported only when an id is resolved (`import dllm` stays light). The id syntax and
the local-folder-wins rule live in dllm.config.base (configs validate them without any I/O on the hub).
"""

from __future__ import annotations

from pathlib import Path

from dllm.config.base import parse_hub_id
from dllm.errors import ConfigError

ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.yaml")
"""What a snapshot may download: config.json, tokenizer files, weights in safetensors, a dllm model.yaml."""


def local_folder(source: Path | str, field: str) -> Path:
    """The folder a source names: a path as it is; a hub id through the hub cache (downloading what is
    missing unless offline). Every failure is one ConfigError naming `field` and what to do."""
    if isinstance(source, Path):
        return source
    parsed = parse_hub_id(source)
    if parsed is None:
        raise ConfigError(f"{field}: {source!r} is neither a local folder nor a hub id org/name[@revision]")
    repo, revision = parsed
    try:
        from huggingface_hub import constants, errors, snapshot_download
    except ImportError:
        raise ConfigError(f"{field}: the hub id {source} needs huggingface_hub: pip install 'dllm[hf]'") from None
    incomplete = getattr(errors, "IncompleteSnapshotError", errors.LocalEntryNotFoundError)  # newer hub versions
    not_cached = (errors.LocalEntryNotFoundError, incomplete)
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(ALLOW_PATTERNS)))
    except not_cached:
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise ConfigError(
            f"{field}: {source} is no local folder, and it is not (completely) in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} while {offline}; download it once with network access, or give a folder"
        ) from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{field}: {repo} has no revision {revision!r} on the hub") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError):
        raise ConfigError(
            f"{field}: {repo} is not a hub repository this machine can read (missing, private or gated: "
            "log in with `hf auth login`), and no local folder of that name exists"
        ) from None
    except errors.HFValidationError as e:
        raise ConfigError(f"{field}: {source!r} is not a valid hub id ({_first_line(e)})") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise ConfigError(f"{field}: downloading {source} failed ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
