"""Checkpoints and configs named by a local path or a Hugging Face hub id.

    resolve_checkpoint("Qwen/Qwen3.5-0.8B") -> Path of the cached snapshot directory
    resolve_config("Qwen/Qwen3.5-0.8B")     -> Path of its config.json (only that file is fetched)

An existing local file or directory is used as is (a GGUF file: the checkpoint folder standing
for it, kvstate.gguf); a shipped model's name
(`kvstate-phonebook-hybrid`, kvstate.shipped) is its directory in the package. Anything else is looked up through
`huggingface_hub`, as transformers does: the local cache when offline (HF_HUB_OFFLINE=1 or no
network), a download into that cache when online. Every failure is one KvstateError line.
No torch; huggingface_hub is imported only when a hub id is actually resolved.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstate.errors import KvstateError
from kvstate.gguf import is_gguf

# What a checkpoint needs: config, weights (+ index), tokenizer and chat template files.
# "*.json" covers config.json, generation_config.json, tokenizer(_config).json and the index.
CHECKPOINT_PATTERNS: tuple[str, ...] = ("*.json", "*.safetensors", "*.jinja", "tokenizer*")


def looks_like_repo_id(text: str) -> bool:
    """True for "org/name" as the hub accepts it (not "./x", "a/b/c", "x.json", a bare "name").

    Bare names (legacy ids such as "gpt2") are left out so a mistyped path or bundled short
    name gets a local error, not a hub lookup."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.count("/") != 1 or text.startswith((".", "/", "~")) or text.endswith(".json"):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def resolve_checkpoint(name_or_path: str | os.PathLike, gguf_file: str | None = None) -> Path:
    """A checkpoint directory: the path itself, or the cached (or downloaded) hub snapshot.

    A GGUF file (a path, "org/name/file.gguf", or a hub id with `gguf_file`, as transformers takes it)
    gives the folder standing for it (kvstate.gguf.checkpoint)."""
    if gguf_file is not None:
        name_or_path = f"{os.fspath(name_or_path).rstrip('/')}/{gguf_file}"
    path = Path(name_or_path)
    if is_gguf(path):
        from kvstate.gguf.checkpoint import checkpoint_dir

        return checkpoint_dir(path if path.is_file() else resolve_gguf(os.fspath(path)))
    if path.exists():
        return path
    if (shipped := _shipped(name_or_path)) is not None:
        return shipped
    repo_id = _repo_id(os.fspath(name_or_path))
    from huggingface_hub import snapshot_download

    return Path(_call_hub(repo_id, lambda: snapshot_download(repo_id, allow_patterns=list(CHECKPOINT_PATTERNS))))


def resolve_config(name_or_path: str | os.PathLike) -> Path:
    """A config source: the path itself, or the hub repo's config.json (fetched alone)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    if (shipped := _shipped(name_or_path)) is not None:
        return shipped / "config.json"
    repo_id = _repo_id(os.fspath(name_or_path))
    from huggingface_hub import hf_hub_download

    return Path(_call_hub(repo_id, lambda: hf_hub_download(repo_id, "config.json")))


def split_gguf_id(text: str) -> tuple[str, str] | None:
    """("org/name", "path/in/repo.gguf") for "org/name/path/in/repo.gguf", else None."""
    parts = text.split("/")
    if len(parts) < 3 or not is_gguf(text) or not looks_like_repo_id("/".join(parts[:2])):
        return None
    return "/".join(parts[:2]), "/".join(parts[2:])


def resolve_gguf(text: str) -> Path:
    """A GGUF file: the path itself, or "org/name/file.gguf" from the hub cache (or downloaded)."""
    path = Path(text)
    if path.is_file():
        return path
    split = split_gguf_id(text)
    if split is None:
        raise KvstateError(f"{text}: no such file, and not a Hugging Face repo and file (org/name/file.gguf)")
    repo_id, filename = split
    from huggingface_hub import hf_hub_download

    return Path(_call_hub(repo_id, lambda: hf_hub_download(repo_id, filename), filename))


def _shipped(name: str | os.PathLike) -> Path | None:
    """A shipped model's directory; its name without its weights is one line saying how to get them."""
    from kvstate.shipped import SHIPPED, model_path

    if os.fspath(name).strip().lower() not in SHIPPED:
        return None
    return model_path(os.fspath(name))


def _repo_id(text: str) -> str:
    if not looks_like_repo_id(text):
        raise KvstateError(f"{text}: no such file or directory")
    return text


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _call_hub(repo_id: str, fetch, filename: str = "config.json"):
    """Run a huggingface_hub fetch, turning each of its failures into one line."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = f"{repo_id}: no such file or directory, and"
    try:
        return fetch()
    except GatedRepoError:
        raise KvstateError(f"{where} a gated Hugging Face repo: accept its terms and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise KvstateError(f"{where} no Hugging Face repo of that name (or it is private: log in)") from None
    except RevisionNotFoundError:
        raise KvstateError(f"{where} the Hugging Face repo has no such revision") from None
    except LocalEntryNotFoundError:
        if _offline():
            raise KvstateError(f"{where} not in the Hugging Face cache (HF_HUB_OFFLINE is set, "
                               "so nothing is downloaded)") from None
        raise KvstateError(f"{where} not in the Hugging Face cache, and the hub cannot be reached") from None
    except EntryNotFoundError:
        raise KvstateError(f"{where} the Hugging Face repo has no {filename}") from None
    except HfHubHTTPError as exc:
        raise KvstateError(f"{where} the Hugging Face hub answered: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise KvstateError(f"{repo_id}: cannot write to the Hugging Face cache: {exc.strerror or exc}") from None
