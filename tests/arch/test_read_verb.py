"""``core`` reads checkpoint data through one verb, ``Reader.read(request)``: no module of
``core`` (or ``cli``) calls any other data method of a format's reader (docs/design.md,
"Reading"). What remains callable besides ``read`` is metadata about the bytes and
whole-checkpoint checks, listed here; a format's fast paths and fallbacks are its own."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from ckpttool.formats import registry
from ckpttool.formats.base import Reader

ROOT = Path(__file__).resolve().parents[2] / "ckpttool"

# Not data reads: what the bytes are and where (messages, planning), the reader's life, a
# non-tensor entry's value, and verify's checks of bytes no chunk covers.
NOT_DATA = {"capabilities", "path", "where", "plan_reads", "open_files", "close",
            "read_object", "object_record", "check_copies", "other_checksums",
            "check_file_digests", "info", "store", "detail"}


def _reader_classes() -> list[type[Reader]]:
    list(registry.formats())  # every format's module imported: its reader defined
    found: list[type[Reader]] = []
    todo: list[type[Reader]] = [Reader]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return [c for c in found if c.__module__.startswith("ckpttool.formats")]


def data_methods() -> set[str]:
    members = {n for cls in _reader_classes() for n, v in inspect.getmembers(cls)
               if not n.startswith("__") and (callable(v) or isinstance(v, property))}
    return members - NOT_DATA - {"read"}


def _module_names(tree: ast.Module) -> set[str]:
    """Names a module binds by importing a module (``tensors``, ``np``...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if (ROOT.parent / (full.replace(".", "/") + ".py")).exists() or \
                        (ROOT.parent / full.replace(".", "/")).is_dir():
                    names.add(a.asname or a.name)
    return names


def calls_outside_the_verb() -> list[str]:
    data = data_methods()
    wrong = []
    for path in sorted([*(ROOT / "core").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        modules = _module_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if node.func.attr in data and not (isinstance(owner, ast.Name)
                                                and owner.id in modules):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                             f"{ast.unparse(node.func)}()")
    return wrong


def test_the_data_methods_are_known() -> None:
    # The check below means something: the steps and DCP's fast paths are data methods.
    assert {"payload", "payloads", "read_chunk", "read_exact", "copy_to", "readv", "blocks",
            "fill_rows", "elements", "checked_elements"} <= data_methods()


def test_core_reads_data_through_read_alone() -> None:
    wrong = calls_outside_the_verb()
    assert not wrong, "core calls reader data methods other than read():\n" + "\n".join(wrong)
