"""docs/design.md's tree of the package is true: every module it names exists, and every
module of the package is named in it (a new room is one line there)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tree() -> str:
    """The package part of design.md's first code block (up to ``examples/``)."""
    block = (ROOT / "docs" / "design.md").read_text().split("```")[1]
    return block.split("\nexamples/")[0]


def test_design_names_every_module() -> None:
    named = set(re.findall(r"\b([A-Za-z_][A-Za-z_0-9]*\.py)\b", _tree()))
    files = {p.name for p in (ROOT / "ckpttool").rglob("*.py")} - {"__init__.py"}
    assert not files - named, f"modules docs/design.md does not name: {sorted(files - named)}"
    assert not named - files - {"__init__.py"}, \
        f"docs/design.md names modules that do not exist: {sorted(named - files)}"


def test_design_names_every_package() -> None:
    tree = _tree()
    dirs = {p.parent.name for p in (ROOT / "ckpttool").rglob("__init__.py")} - {"ckpttool"}
    missing = sorted(d for d in dirs if f"{d}/" not in tree)
    assert not missing, f"packages docs/design.md does not name: {missing}"
