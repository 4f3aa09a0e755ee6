"""Imports run one way (shared/DESIGN.md): an AST walk over every module under kvstate/, lazy
imports inside functions included, since a lazy import upward is a hidden cycle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvstate"

# The floors, top to bottom, as docs/architecture.md draws them (`test_the_docs_draw_these_floors`):
# a module imports its own floor or lower ones, never a higher one, and no import chain comes back
# to where it started. "x/" is the package kvstate.x, "x.py" the module kvstate.x, "__init__.py"
# kvstate itself.
FLOORS = (
    ("cli.py", "__main__.py", "__init__.py", "commands/"),
    ("server/", "bench/", "recall/", "eval/", "data/"),
    ("terminal/", "memory_plot.py"),
    ("llm.py",),
    ("parallel/",),
    ("engine/",),
    ("models/",),
    ("families/",),
    ("layers/",),
    ("ops/",),
    ("memory.py",),
    ("cache/",),
    ("kernels/",),
    ("config/",),
    ("hub.py", "shipped.py", "gguf/"),
    ("errors.py", "profiling.py"),
)
FLOOR = {name.removesuffix("/").removesuffix(".py").removesuffix("__init__"): len(FLOORS) - i
         for i, names in enumerate(FLOORS) for name in names}


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


def _graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}; `from package import name` counts as the module
    package.name where that is one."""
    modules = {module: path for path, module in _modules()}
    graph = {}
    for module, path in modules.items():
        graph[module] = edges = {}
        for target, name, line in _imports(path, module):
            full = f"{target}.{name}" if name else target
            target = full if full in modules else target
            if target in modules and target != module:
                edges.setdefault(target, line)
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _violations() -> list[str]:
    found = []
    for path, module in _modules():
        here = _package(module)
        if here not in FLOOR:
            found.append(f"{path.relative_to(ROOT.parent)}: {here or '__init__'} has no floor in FLOORS")
            continue
        top_level = module.count(".") == 1 and path.name != "__init__.py"  # kvstate/cli.py, kvstate/llm.py, ...
        for target, name, line in _imports(path, module):
            if not target.startswith("kvstate"):
                continue
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            full = f"{target}.{name}" if name else target
            if (full.startswith("kvstate.commands") or target.startswith("kvstate.commands")) \
                    and here != "commands" and module != "kvstate.cli":
                found.append(f"{where}: imports {full} (only cli.py and commands/ may)")
            there = _package(target) if target != "kvstate" else name if name in FLOOR else ""  # kvstate.x or kvstate
            if FLOOR.get(there, 0) > FLOOR[here]:
                found.append(f"{where}: {here or '__init__'} imports {full}, a floor higher")
            private = name is not None and name.startswith("_") and not name.startswith("__")
            private_module = any(p.startswith("_") and not p.startswith("__") for p in target.split(".")[1:])
            crosses = there != here or top_level
            if crosses and there and (private or private_module):
                found.append(f"{where}: imports the private {full} from another package")
    found += [f"an import circle: {' -> '.join(group)}" for group in _circles(_graph())]
    return found


def test_imports_run_one_way():
    assert _violations() == []


def test_the_walk_finds_what_it_forbids(tmp_path, monkeypatch):
    """The checker itself: a planted upward import, a CLI import, a private name, a circle and a
    package without a floor are all caught."""
    pkg = tmp_path / "kvstate"
    for sub in ("config", "server", "models", "kernels", "newpkg"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "reader.py").write_text("def f():\n    from kvstate.families import read_plan\n")
    (pkg / "server" / "x.py").write_text("from kvstate.commands.memory import run\n")
    (pkg / "models" / "y.py").write_text("from kvstate.kernels.dispatch import _choice\nfrom ..kernels import _ext\n")
    (pkg / "kernels" / "_ext.py").write_text("def load():\n    from kvstate.kernels import dispatch\n")
    (pkg / "kernels" / "dispatch.py").write_text("from kvstate.kernels import _ext\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    found = "\n".join(_violations())
    assert "config imports kvstate.families.read_plan, a floor higher" in found
    assert "an import circle: kvstate.kernels._ext -> kvstate.kernels.dispatch" in found
    assert "newpkg has no floor in FLOORS" in found
    assert "imports kvstate.commands.memory.run (only cli.py" in found
    assert "private kvstate.kernels.dispatch._choice" in found
    assert "private kvstate.kernels._ext" in found


def test_the_docs_draw_these_floors():
    """docs/architecture.md's floor diagram names the same floors in the same order."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    block = text.split("## Floors", 1)[1].split("```", 2)[1]
    drawn = []
    for row in block.strip().splitlines():
        names = row.split("  ", 1)[0].strip()
        if names:  # a row's first column; an indented row continues the one above
            drawn.append(tuple(n.strip() for n in names.split(",") if n.strip() != "engine/speculative/"))
    assert tuple(drawn) == FLOORS
