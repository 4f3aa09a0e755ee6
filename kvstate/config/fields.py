"""Typed reads from an HF config dict, with errors that name the file and the field.

Family adapters read every field through a `ConfigView`, so a missing, mistyped, zero or
negative field becomes one KvstateError line such as
    `model/config.json: field 'text_config.linear_num_value_heads': missing`.
Getters take several names where exports spell a field differently (Nemotron-H's
`ssm_state_size | mamba_state_dim | mamba_d_state`); the first present one wins. A field the
config leaves out is read with transformers' default for its model_type (kvstate.config.defaults)
before any default the caller gives: a config transformers loads is read the same way.
Sizes no real model has are refused by name before anything is built from them (`most`): a
config with 10**12 layers or a 10**30 head size is one error line, not an hour of planning.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvstate.config.defaults import defaults_for, sub_config_type
from kvstate.config.dtypes import canonical_dtype, known_dtypes
from kvstate.errors import ConfigFieldError

_MISSING: Any = object()
# the largest value a field may take, by a word in its name (first match); anything else: OTHER_MOST.
# Far past every published model (layers <= ~130, vocab <= ~260K, hidden <= ~25K, windows <= 10M):
# the bound keeps the planner's per-layer work and its figures finite, not a judgment of the model.
MOST = (("layer", 4096), ("vocab", 1 << 23), ("position", 1 << 28), ("window", 1 << 28), ("context", 1 << 28),
        ("seq_len", 1 << 28))
OTHER_MOST = 1 << 20  # widths, heads, head sizes, experts, kernel and chunk sizes
MOST_ENTRIES = 4096  # a list or string of per-layer entries (layer_types, hybrid_override_pattern)


def most(name: str) -> int:
    """The largest value the integer field `name` may take (see MOST)."""
    low = name.lower()
    return next((bound for word, bound in MOST if word in low), OTHER_MOST)


class ConfigView:
    """A read-only view of one (possibly nested) config dict plus where it came from."""

    def __init__(self, data: Mapping[str, Any], source: str, prefix: str = "",
                 defaults: Mapping[str, Any] | None = None) -> None:
        self.data = data
        self.source = source  # file path or bundled name, used in every message
        self.prefix = prefix  # "text_config." for a nested sub-config
        # transformers' defaults for fields left out (by the config's own model_type unless given)
        self.defaults = defaults_for(data.get("model_type")) if defaults is None else defaults

    # -- errors ---------------------------------------------------------------------------
    def error(self, names: str | tuple[str, ...], message: str) -> ConfigFieldError:
        if isinstance(names, str):
            names = (names,)
        shown = " | ".join(f"{self.prefix}{n}" for n in names)
        return ConfigFieldError(f"{self.source}: field '{shown}': {message}", f"{self.prefix}{names[0]}")

    # -- lookups --------------------------------------------------------------------------
    def has(self, *names: str) -> bool:
        return any(self.data.get(n) is not None for n in names)

    def raw(self, *names: str, default: Any = _MISSING) -> Any:
        """The first non-null value among `names`; else transformers' default for one of them;
        else `default` (KvstateError if there is none)."""
        for n in names:
            if self.data.get(n) is not None:
                return self.data[n]
        for n in names:
            if n in self.defaults:
                return self.defaults[n]
        if default is _MISSING:
            raise self.error(names, "missing")
        return default

    def _which(self, names: tuple[str, ...]) -> tuple[str, ...]:
        for n in names:
            if self.data.get(n) is not None:
                return (n,)
        return names

    def int(self, *names: str, default: Any = _MISSING, minimum: int = 1) -> int:
        """A whole number >= `minimum` (default: positive). Bools and fractions are rejected."""
        value = self.raw(*names, default=default)
        if value is default and default is not _MISSING:
            return value
        where = self._which(names)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(where, f"must be an integer, got {value!r}")
        if value < minimum:
            want = "positive" if minimum == 1 else f">= {minimum}"
            raise self.error(where, f"must be {want}, got {value}")
        if value > most(where[0]):
            raise self.error(where, f"must be at most {most(where[0])} (no real model is that large), got {value}")
        return value

    def bool(self, *names: str, default: Any = _MISSING) -> bool:
        value = self.raw(*names, default=default)
        if not isinstance(value, bool):
            raise self.error(self._which(names), f"must be true or false, got {value!r}")
        return value

    def str(self, *names: str, default: Any = _MISSING) -> str:
        value = self.raw(*names, default=default)
        if not isinstance(value, str):
            raise self.error(self._which(names), f"must be a string, got {value!r}")
        if len(value) > MOST_ENTRIES:
            raise self.error(self._which(names), f"must be at most {MOST_ENTRIES} characters, got {len(value)}")
        return value

    def list(self, *names: str, default: Any = _MISSING) -> list:
        value = self.raw(*names, default=default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list):
            raise self.error(self._which(names), f"must be a list, got {type(value).__name__}")
        if len(value) > MOST_ENTRIES:
            raise self.error(self._which(names), f"must have at most {MOST_ENTRIES} entries, got {len(value)}")
        return value

    def int_list(self, *names: str, minimum: int = 0) -> list[int]:
        values = self.list(*names)
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise self.error(self._which(names), f"must hold integers >= {minimum}, got {v!r}")
        return values

    def dtype(self, *names: str, default: Any = _MISSING) -> str:
        """A canonical dtype name (see kvstate.config.dtypes)."""
        value = self.raw(*names, default=default)
        canonical = canonical_dtype(value)
        if canonical is None:
            raise self.error(self._which(names), f"unknown dtype {value!r} (known: {', '.join(known_dtypes())})")
        return canonical

    def sub(self, name: str) -> "ConfigView":
        """The nested dict `name` as a view (e.g. Kimi's linear_attn_config)."""
        value = self.raw(name)
        if not isinstance(value, Mapping):
            raise self.error(name, f"must be an object, got {type(value).__name__}")
        # a nested config's defaults: by its own model_type, else the one transformers nests there
        sub_type = value.get("model_type") or sub_config_type(self.data.get("model_type"), name)
        return ConfigView(value, self.source, f"{self.prefix}{name}.", defaults_for(sub_type))

    def layer_count_check(self, names: tuple[str, ...], got: int, what: str) -> None:
        """Raise if `num_hidden_layers` (when present) disagrees with a layer list of length `got`."""
        n = self.int("num_hidden_layers", default=None)
        if n is not None and n != got:
            raise self.error(names, f"{what} has {got} entries but num_hidden_layers is {n}")
