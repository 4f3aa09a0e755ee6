"""Imports run one way (shared/DESIGN.md): an AST walk over every module under kvstate/, lazy
imports inside functions included, since a lazy import upward is a hidden cycle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvstate"

# importing package -> packages it may never import
FORBIDDEN = {
    "config": ("kvstate.families", "kvstate.engine", "kvstate.models", "kvstate.layers", "kvstate.ops"),
    "cache": ("kvstate.engine", "kvstate.models", "kvstate.families"),
    "ops": ("kvstate.engine", "kvstate.layers", "kvstate.models"),
    "layers": ("kvstate.engine", "kvstate.models"),
    "kernels": ("kvstate.engine", "kvstate.models", "kvstate.layers"),
    "engine": ("kvstate.parallel", "kvstate.llm", "kvstate.server", "kvstate.bench", "kvstate.recall"),
    "parallel": ("kvstate.llm", "kvstate.server", "kvstate.bench", "kvstate.recall"),
    "gguf": ("kvstate.families", "kvstate.engine", "kvstate.models", "kvstate.layers", "kvstate.config"),
    "terminal": ("kvstate.bench", "kvstate.recall", "kvstate.server"),
}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield path, ".".join(parts)


def _imports(path: Path, module: str):
    """(imported module, imported name or None, line) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield base, alias.name, node.lineno


def _package(module: str) -> str:
    """kvstate.engine.core -> "engine"; kvstate.llm -> "llm"; kvstate -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _violations() -> list[str]:
    found = []
    for path, module in _modules():
        here = _package(module)
        top_level = module.count(".") == 1 and path.name != "__init__.py"  # kvstate/cli.py, kvstate/llm.py, ...
        for target, name, line in _imports(path, module):
            if not target.startswith("kvstate"):
                continue
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            full = f"{target}.{name}" if name else target
            if (full.startswith("kvstate.commands") or target.startswith("kvstate.commands")) \
                    and here != "commands" and module != "kvstate.cli":
                found.append(f"{where}: imports {full} (only cli.py and commands/ may)")
            for banned in FORBIDDEN.get(here, ()):
                if full == banned or full.startswith(banned + "."):
                    found.append(f"{where}: {here}/ imports {full}")
            there = _package(target) if target != "kvstate" else ""
            private = name is not None and name.startswith("_") and not name.startswith("__")
            private_module = any(p.startswith("_") and not p.startswith("__") for p in target.split(".")[1:])
            crosses = there != here or top_level
            if crosses and there and (private or private_module):
                found.append(f"{where}: imports the private {full} from another package")
    return found


def test_imports_run_one_way():
    assert _violations() == []


def test_the_walk_finds_what_it_forbids(tmp_path, monkeypatch):
    """The checker itself: a planted upward import, a CLI import and a private name are all caught."""
    pkg = tmp_path / "kvstate"
    for sub in ("config", "server", "models"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "reader.py").write_text("def f():\n    from kvstate.families import read_plan\n")
    (pkg / "server" / "x.py").write_text("from kvstate.commands.memory import run\n")
    (pkg / "models" / "y.py").write_text("from kvstate.kernels.dispatch import _choice\nfrom ..kernels import _ext\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    found = "\n".join(_violations())
    assert "config/ imports kvstate.families.read_plan" in found
    assert "imports kvstate.commands.memory.run (only cli.py" in found
    assert "private kvstate.kernels.dispatch._choice" in found
    assert "private kvstate.kernels._ext" in found
