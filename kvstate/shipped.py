"""The models shipped inside the package, by name (no torch).

Two tiny Qwen3.5-architecture checkpoints trained here by `kvstate recall train-default`
(kvstate/data/models/<name>/: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template, and a model card, README.md). They are the same size
and training; the hybrid alternates Gated DeltaNet and full attention (GAGA), the linear one is
Gated DeltaNet only (GGGG):

    kvstate.model_path("kvstate-phonebook-hybrid")   -> Path of its checkpoint directory

Every command that takes a checkpoint or a config takes these names (kvstate.hub resolves them;
the memory table and the explorer list them with the bundled configs).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvstate.errors import KvstateError

SHIPPED: tuple[str, ...] = ("kvstate-phonebook-hybrid", "kvstate-phonebook-linear")
DEFAULT_MODEL = "kvstate-phonebook-hybrid"  # `kvstate generate` and `kvstate serve` without --model


def models_dir() -> Path:
    return Path(str(resources.files("kvstate") / "data" / "models"))


def is_trained(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def shipped_path(name: str) -> Path | None:
    """The directory of a shipped model's name (case-insensitive) when it is in the package, else None."""
    key = str(name).strip().lower()
    if key not in SHIPPED:
        return None
    path = models_dir() / key
    return path if is_trained(path) else None


def available() -> list[str]:
    """The shipped models present in this installation, in SHIPPED order."""
    return [name for name in SHIPPED if shipped_path(name) is not None]


def model_path(name: str) -> Path:
    """A shipped model's checkpoint directory; one KvstateError line for an unknown or missing one."""
    key = str(name).strip().lower()
    if key not in SHIPPED:
        raise KvstateError(f"{name}: not a shipped model (shipped: {', '.join(SHIPPED)})")
    path = shipped_path(key)
    if path is None:
        raise KvstateError(f"{name}: not in this installation; train it with `kvstate recall train-default`")
    return path
