"""Read an HF config.json (a file, a checkpoint directory or a bundled short name) into a plan.

`load_config(source) -> dict` finds and parses the JSON; `read_config(source)` also gives the label
and display name that `kvstate.families.read_plan` dispatches on `model_type` with (the families
import this package, never the other way). Every bad input is one
KvstateError that names the file and, where there is one, the field. No torch, no transformers.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from kvstate.errors import KvstateError

# Bundled configs (kvstate/data/configs/<name>.json, real values), in the order of the tables
# in the spec documents.
BUNDLED: tuple[str, ...] = (
    "llama-3.1-8b",
    "qwen3.5-0.8b",
    "qwen3.5-35b-a3b",
    "qwen3.5-397b-a17b",
    "qwen3-next-80b-a3b",
    "kimi-linear-48b-a3b",
    "jamba-v0.1",
    "nemotron-h-8b-base-8k",
    "nemotron-nano-9b-v2",
)


def bundled_names() -> list[str]:
    """The bundled configs, then the shipped trained models present (kvstate.shipped)."""
    from kvstate.shipped import available

    return list(BUNDLED) + available()


def bundled_path(name: str) -> Path | None:
    """The bundled config (or a shipped model's config.json) for a short name (case-insensitive), or None."""
    key = name.strip().lower()
    if key not in BUNDLED:
        from kvstate.shipped import shipped_path

        shipped = shipped_path(key)
        return None if shipped is None else shipped / "config.json"
    return Path(str(resources.files("kvstate") / "data" / "configs" / f"{key}.json"))


def resolve(source: str | os.PathLike) -> tuple[Path, str | None]:
    """(path of the config.json, display name or None) for a file, a directory, a bundled short
    name (its name) or a Hugging Face hub id (the id; only config.json is fetched, see kvstate.hub)."""
    text = os.fspath(source)
    path = Path(text)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise KvstateError(f"{path}: directory has no config.json")
        return config, None
    if path.exists():
        return path, None
    bundled = bundled_path(text)
    if bundled is not None:
        return bundled, text.strip().lower()
    from kvstate.hub import looks_like_repo_id, resolve_config, resolve_gguf, split_gguf_id  # lazy: huggingface_hub

    if split_gguf_id(text):  # org/name/file.gguf: the file from the hub cache
        return resolve_gguf(text), text
    if looks_like_repo_id(text):
        return resolve_config(text), text
    raise KvstateError(f"{text}: no such file or directory, and not a bundled model "
                       f"(bundled: {', '.join(BUNDLED)}) or a Hugging Face hub id (org/name)")


def _parse(path: Path, label: str) -> dict[str, Any]:
    from kvstate.gguf import is_gguf

    if is_gguf(path) and path.is_file():  # the config its metadata stands for (kvstate.gguf)
        from kvstate.gguf.metadata import hf_config

        return hf_config(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KvstateError(f"{label}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:  # e.g. model.safetensors given where its directory was meant
        raise KvstateError(f"{label}: cannot read: not a UTF-8 text file (expected a config.json or a checkpoint "
                           "directory)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvstateError(f"{label}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise KvstateError(f"{label}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def load_config(source: str | os.PathLike) -> dict[str, Any]:
    """The config dict of a config.json path, a checkpoint directory or a bundled short name."""
    path, name = resolve(source)
    return _parse(path, _label(path, name))


def _label(path: Path, name: str | None) -> str:
    """How errors name the config: a bundled short name, or the file (a hub id with its file)."""
    if name is None:
        return str(path)
    return name if name in bundled_names() else f"{name}/{path.name}"


def _default_name(path: Path, resolved_name: str | None, data: Mapping[str, Any]) -> str:
    if resolved_name:  # a bundled short name or a hub id
        return resolved_name
    name = data.get("_name_or_path")
    if isinstance(name, str) and name.strip():
        return name.strip()
    if path.name == "config.json" and path.parent.name:
        parent = path.parent.absolute()
        # a hub cache snapshot, .../models--org--name/snapshots/<commit>/: the repo id, not the commit
        if parent.parent.name == "snapshots" and parent.parent.parent.name.startswith("models--"):
            return parent.parent.parent.name.removeprefix("models--").replace("--", "/")
        return parent.resolve().name
    return path.stem


def read_config(source: str | os.PathLike | Mapping[str, Any], name: str | None = None) -> tuple[dict, str, str]:
    """(the config dict, its label for error messages, its display name) of any `read_plan` source."""
    if isinstance(source, Mapping):
        data, label = dict(source), name or "<config>"
        default = name or str(data.get("_name_or_path") or data.get("model_type") or "model")
    else:
        path, resolved_name = resolve(source)
        label = _label(path, resolved_name)
        data = _parse(path, label)
        default = _default_name(path, resolved_name, data)
    return data, label, name or default
