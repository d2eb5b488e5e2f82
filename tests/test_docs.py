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


# -- the benchmark figures: one results file, one current figure per claim

# A measured ratio as the pages write it ("2.43x"); a target ("<= 1.5x", "the 1.5x target") and
# the end of a range ("2.2-2.5x") are not figures.
_RATIO = re.compile(r"(?<![\d.\-])(?<![<>]= )(?<!< )(\d+\.\d+)x\b(?! target)")
_CLAIM_KEYS = {"id", "section", "claim", "target", "met", "figure", "cpu_s", "baseline", "ratio",
               "peak_mb", "command", "date", "load", "commit", "note"}


def test_every_claim_is_complete_and_measured_by_a_script_here() -> None:
    claims = docs.load_figures()
    assert claims and len({c["id"] for c in claims}) == len(claims)
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for c in claims:
        assert set(c) >= _CLAIM_KEYS, (c["id"], _CLAIM_KEYS - set(c))
        script = c["command"].split()[0]
        assert (ROOT / script).is_file(), (c["id"], script)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d( \d\d:\d\d UTC)?", c["date"]), c["id"]
        # every section's table is on the page, under its own heading
        assert f"## {c['section']}\n\n<!-- BEGIN generated:{docs.section_slug(c['section'])}" \
            in page, c["section"]


def test_no_page_quotes_a_ratio_the_results_file_does_not_have() -> None:
    """docs/benchmarks.md is generated from benchmarks/figures.json; any other page that
    quotes a measured ratio must quote the current one (or link to the claim)."""
    ratios = set()
    for c in docs.load_figures():
        if c["ratio"] is not None:  # as given, and as the generated table rounds it
            ratios |= {format(c["ratio"], ".2f"),
                       format(float(docs.format_ratio(c["ratio"])[:-1]), ".2f")}
    found = []
    for page in docs.pages(ROOT):
        text = docs._CODE.sub("", page.read_text())
        found += [f"{page.name}: {m.group(0)}" for m in _RATIO.finditer(text)
                  if format(float(m.group(1)), ".2f") not in ratios]
    assert found == [], "quote the figure from benchmarks/figures.json, or link to it"


def test_the_ratio_check_reads_figures_not_targets() -> None:
    text = "2.43x, <= 1.5x, the 1.5x target, 2.2-2.5x, 0.91x at load 9, 4x"
    assert [m.group(1) for m in _RATIO.finditer(text)] == ["2.43", "0.91"]


def test_a_recorded_figure_replaces_its_claims_and_reaches_the_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse
    import json
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _measure as M

    figures = tmp_path / "figures.json"
    figures.write_text((ROOT / "benchmarks" / "figures.json").read_text())
    parser = argparse.ArgumentParser()
    M.add_record_args(parser)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "diff.py"), "--size-gb", "0.1",
                                      "--figures", str(figures)])
    # without --record or --figures nothing is written
    assert not M.record_figure(parser.parse_args([]), "diff-same", figure="1 s")
    assert figures.read_text() == (ROOT / "benchmarks" / "figures.json").read_text()
    # nor with --record by a run at another size than the claim's
    assert not M.record_figure(parser.parse_args(["--record"]), "diff-same", figure="1 s",
                               full_size=False)
    args = parser.parse_args(["--figures", str(figures)])
    assert M.record_figure(args, "diff-same", figure="4.56 s", ratio=1.234, cpu_s=1.0,
                           baseline="`cmp` 3.70 s", met=True, peak_mb=99.6,
                           load=M.load_span([2.04, 1.96, float("nan")]))
    with pytest.raises(KeyError, match="no claim 'nope'"):
        M.record_figure(args, "nope", figure="1 s")
    M.record_figure(args, "diff-new", figure="2 s",
                    new={"section": "diff", "claim": "a claim added by a script"})
    data = json.loads(figures.read_text())
    claims = {c["id"]: c for c in data["claims"]}
    same = claims["diff-same"]
    assert same["figure"] == "4.56 s" and same["ratio"] == 1.23 and same["peak_mb"] == 100
    assert same["command"] == "benchmarks/diff.py --size-gb 0.1" and same["load"] == "2.0"
    assert same["claim"].startswith("`diff A A2`")  # what is claimed stays as written
    order = [c["id"] for c in data["claims"]]
    assert order.index("diff-new") == order.index("diff-apply") + 1  # after its section
    table = docs.figures_table("diff", figures)
    assert "| 4.56 s | 1 s | **1.23x** (`cmp` 3.70 s) | 100 MB |" in table
    assert "a claim added by a script" in table
    assert "benchmarks/diff.py --size-gb 0.1" in table
    assert "recorded diff-same" in capsys.readouterr().out
