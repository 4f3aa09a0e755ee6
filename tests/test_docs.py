"""docs/architecture.md names every package under kvstate/ (a directory with __init__.py, as
`engine/speculative/`) and every top-level module (as `llm.py`): a package added without a word
in the architecture page fails here. The docs' relative links point at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def unnamed(package_root: Path, doc: str) -> list[str]:
    """Packages (`engine/speculative/`) and top-level modules (`llm.py`) of `package_root` that the
    doc text does not name in backquotes or in its floor diagram."""
    names = [f"{p.parent.relative_to(package_root).as_posix()}/" for p in sorted(package_root.rglob("__init__.py"))
             if p.parent != package_root]
    names += [p.name for p in sorted(package_root.glob("*.py")) if p.name not in ("__init__.py", "__main__.py")]
    return [n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", doc)]


def test_architecture_names_every_package():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert unnamed(ROOT / "kvstate", doc) == []


def test_a_new_package_is_caught(tmp_path):
    for sub in ("engine", "engine/speculative", "newpart"):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / sub / "__init__.py").write_text("")
    (tmp_path / "llm.py").write_text("")
    doc = "`engine/` and `engine/speculative/`, `llm.py`; a `kvstate/newpart` mention without its slash"
    assert unnamed(tmp_path, doc) == ["newpart/"]
    assert unnamed(tmp_path, doc + ", `newpart/`") == []


def test_relative_links_resolve():
    for md in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if not md.exists():
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (md.parent / target).exists(), f"{md.relative_to(ROOT)} links to missing {target}"
