"""Rewrite kvstate/data/config_defaults.json from transformers' own config classes, for every
model_type a family adapter reads: `python -m kvstate.families.defaults_table` (transformers
installed). tests/test_config_defaults.py checks the stored table still equals them."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from kvstate.config.defaults import TABLE, generate
from kvstate.families import supported_model_types


def main() -> None:
    path = Path(str(resources.files("kvstate") / "data" / TABLE))
    path.write_text(json.dumps(generate(supported_model_types()), indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
