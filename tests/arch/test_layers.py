"""The package's layers, checked on its source (AST): imports flow
``cli -> core -> formats -> storage -> settings/errors``, never back, and no module imports
itself through a circle.

Imports under ``if TYPE_CHECKING:`` are left out (they never run); imports inside functions
count (a lazy import still ties the layers together).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "ckpttool"
# What each layer may import from ckpttool (itself included).
ALLOWED = {
    "errors": set(),
    "settings": {"errors"},
    "storage": {"storage", "settings", "errors"},
    "formats": {"formats", "storage", "settings", "errors"},
    "core": {"core", "formats", "storage", "settings", "errors", "__init__"},  # __version__
    "cli": {"cli", "core", "formats", "storage", "settings", "errors", "__init__"},
    "__init__": {"core", "errors"},
    "__main__": {"cli"},
}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """ckpttool modules imported by ``path``, outside ``TYPE_CHECKING`` blocks."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ckpttool")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("ckpttool"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if (ROOT.parent / (full.replace(".", "/") + ".py")).exists()
                          or (ROOT.parent / full.replace(".", "/")).is_dir() else node.module)
    return found


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}
GRAPH = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_down(module: str) -> None:
    layer = _layer(module)
    wrong = sorted(i for i in GRAPH[module] if _layer(i) not in ALLOWED[layer])
    assert not wrong, f"{module} ({layer}) imports {wrong}: layers flow " \
                      "cli -> core -> formats -> storage -> settings/errors"


def test_storage_names_no_format() -> None:
    # Format file names belong to the formats: a store moves bytes.
    words = (".distcp", ".metadata", "safetensors")
    for path in (ROOT / "storage").rglob("*.py"):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef,
                                  ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)}
        named = sorted({node.value for node in ast.walk(tree)
                        if isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and id(node) not in docs and any(w in node.value for w in words)})
        assert not named, f"{path.name} names a format: {named}"


def test_no_import_circle() -> None:
    seen: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            # A package's __init__ importing its own submodules is not a circle of the kind
            # that breaks imports; there are none here, but keep the rule strict.
            if seen.get(n) == 1:
                circle = stack[stack.index(n):] + [n]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if n not in seen:
                visit(n)
        stack.pop()
        seen[m] = 2

    for m in sorted(GRAPH):
        if m not in seen:
            visit(m)
