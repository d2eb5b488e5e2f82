"""The documentation against the code: generated tables current, links alive, README small,
every problem code a check can emit documented (and none documented that nothing emits)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ckpttool.cli import docs
from ckpttool.core.verify.codes import CODES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("page", docs.pages(ROOT), ids=lambda p: p.name)
def test_generated_tables_match_the_code(page: Path) -> None:
    text = page.read_text()
    assert docs.regenerate(text, str(page)) == text, (
        f"{page.relative_to(ROOT)} is stale: run python -m ckpttool.cli.docs (or make docs)")


def test_no_link_is_broken() -> None:
    assert docs.broken_links(ROOT) == []


def test_the_link_check_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Two words\n")
    (tmp_path / "README.md").write_text(
        f"[ok]({docs.BLOB_URL}docs/a.md#two-words) [gone]({docs.BLOB_URL}docs/b.md)\n"
        "[rel](docs/a.md)\n")
    (tmp_path / "docs" / "index.md").write_text(
        "[ok](a.md#two-words) [anchor](a.md#three) [file](c.md) `[code](x.md)`\n"
        "[ref]: ../README.md\n[bad]: nope.md\n")
    assert docs.broken_links(tmp_path) == [
        f"README.md: {docs.BLOB_URL}docs/b.md: no such file",
        "docs/index.md: a.md#three: no heading '#three' in a.md",
        "docs/index.md: c.md: no such file",
        "docs/index.md: nope.md: no such file",
    ]


def test_a_stale_table_is_found() -> None:
    page = "<!-- BEGIN generated:exit-codes -->\nold\n<!-- END generated:exit-codes -->\n"
    new = docs.regenerate(page)
    assert "old" not in new and "| 70 |" in new
    with pytest.raises(KeyError, match="unknown generated block 'nope'"):
        docs.regenerate("<!-- BEGIN generated:nope -->\n<!-- END generated:nope -->\n")


def test_readme_is_short_and_every_docs_page_is_reachable_from_it() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 8500
    assert "make demo" in readme and "make test" in readme
    index = (ROOT / "docs" / "index.md").read_text()
    assert "docs/index.md" in readme
    for page in (ROOT / "docs").glob("*.md"):
        assert page.name == "index.md" or f"({page.name}" in index, page.name


def _emitted_codes() -> set[str]:
    """Every problem code written in ckpttool's source: the first argument of error(),
    warning() and info(), and codes chosen by a helper (returned string constants of the
    kebab form next to them)."""
    found: set[str] = set()
    for path in (ROOT / "ckpttool").rglob("*.py"):
        if path.name == "codes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = (fn.id if isinstance(fn, ast.Name)
                        else fn.attr if isinstance(fn, ast.Attribute) else "")
                if name in ("error", "warning", "info", "make") and node.args:
                    arg = node.args[0]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.add(arg.value)
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_code"):
                found |= {r.value.value for r in ast.walk(node) if isinstance(r, ast.Return)
                          and isinstance(r.value, ast.Constant)
                          and isinstance(r.value.value, str)}
    # f"{kind}-tensors" in dtype_policy.check: one per kind of tensor never cast
    found |= {f"{kind}-tensors" for kind in ("float8", "int", "bool")}
    return {c for c in found if re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", c)}


def test_every_problem_code_is_documented_and_every_documented_code_is_emitted() -> None:
    documented = {c.code for c in CODES}
    assert len(documented) == len(CODES)
    emitted = _emitted_codes()
    assert emitted - documented == set(), "add these to ckpttool/core/verify/codes.py"
    assert documented - emitted == set(), "no check emits these any more"


def test_every_environment_variable_read_is_documented() -> None:
    from ckpttool import settings

    used = set()
    for path in (ROOT / "ckpttool").rglob("*.py"):
        used |= set(re.findall(r"\bCKPTTOOL_[A-Z][A-Z_]*[A-Z]\b", path.read_text()))
    # _CKPTTOOL_COMPLETE is the shell-completion hook, not a knob
    used -= {"CKPTTOOL_COMPLETE", "CKPTTOOL_TEST"}
    # merge --all --then's environment: set for the command, never read
    from ckpttool.core.merge.sweep import THEN_VARIABLES

    used -= set(THEN_VARIABLES.values())
    assert used - {k.name for k in settings.KNOBS} == set()
