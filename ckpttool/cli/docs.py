"""The tables in README.md and docs/ that come from the code, and the check that links work.

    python -m ckpttool.cli.docs           # rewrite every generated table in place
    python -m ckpttool.cli.docs --check   # exit 1 if a table is stale or a link is broken

A generated table sits between two markers in a page::

    <!-- BEGIN generated:options-merge -->
    ...
    <!-- END generated:options-merge -->

and is rewritten from its source: the option lists from the Typer app itself, the formats from
``formats/registry.py``, the verify codes from ``core/verify/codes.py``, the exit codes from
``cli/common.py``, the environment variables from ``settings.py``, the benchmark figures
(``figures-SECTION``, one block per section of docs/benchmarks.md) from
``benchmarks/figures.json``. tests/test_docs.py
fails when a committed page differs from what this writes,
so the documentation cannot drift from the code. ``make docs`` runs both.

Links: a relative link must name a file that exists (and a heading that exists, for
``#anchors`` into Markdown pages). README.md is also the package index's page, where relative
links are dead, so it links with absolute project URLs (:data:`PROJECT_URL`); those are checked
against the files here as well.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from ckpttool import settings

PROJECT_URL = "https://github.com/ckpttool/ckpttool"
# Where README's absolute links to files of this repository point (the default branch).
BLOB_URL = f"{PROJECT_URL}/blob/main/"
TREE_URL = f"{PROJECT_URL}/tree/main/"

ROOT = Path(__file__).resolve().parents[2]
# The one results file of the benchmarks: a claim per entry, its current figure.
FIGURES = ROOT / "benchmarks" / "figures.json"
COMMANDS = ("merge", "inspect", "verify", "reshard", "diff", "apply")

_BLOCK = re.compile(r"(<!-- BEGIN generated:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)"
                    r"(<!-- END generated:(?P=name) -->)", re.S)
# An inline link's target, or a reference definition's ("[name]: target").
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.M)
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def _cell(text: str) -> str:
    """Text as one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


# -- the tables


def options_table(command: str) -> str:
    """``ckpttool COMMAND``'s arguments and options, as its ``--help`` gives them."""
    from typer.main import get_command  # Typer's documented way to its command objects

    from ckpttool.cli import app

    cmd: Any = get_command(app).commands[command]  # type: ignore[attr-defined]
    rows = ["| argument / option | value | default | what it does |", "|---|---|---|---|"]
    for p in cmd.params:
        if p.param_type_name == "argument":
            name, value, default = f"`{p.metavar or p.name.upper()}`", "", "required"
        else:
            flags = [*p.opts, *p.secondary_opts]
            name = ", ".join(f"`{f}`" for f in sorted(flags, key=len, reverse=True))
            value = "" if p.is_flag else f"`{p.metavar or p.name.upper()}`"
            if isinstance(p.default, Enum):  # a choice: name them all
                value = "`" + "`, `".join(str(e.value) for e in type(p.default)) + "`"
            if p.is_flag or p.default is None:
                default = ""
            else:
                d = p.default.value if isinstance(p.default, Enum) else p.default
                default = f"`{d}`"
        rows.append(f"| {name} | {_cell(value)} | {_cell(default)} | {_cell(p.help or '')} |")
    return "\n".join(rows) + "\n"


def formats_table() -> str:
    """Every format in detection order, from formats/registry.py."""
    from ckpttool.formats.registry import formats

    rows = ["| format | what it looks like | written by |", "|---|---|---|"]
    rows += [f"| `{f.NAME}` | {_cell(f.SUMMARY)} | {_cell(f.WRITTEN_BY)} |" for f in formats()]
    return "\n".join(rows) + "\n"


def codes_table() -> str:
    """Every verify problem code, grouped by the check that reports it."""
    from ckpttool.core.verify.codes import CODES

    rows = ["| check | code | severity | what was found |", "|---|---|---|---|"]
    last = ""
    for c in CODES:
        check = c.check if c.check != last else ""
        last = c.check
        rows.append(f"| {check} | `{c.code}` | {c.severity} | {_cell(c.meaning)} |")
    return "\n".join(rows) + "\n"


def exit_codes_table() -> str:
    """The exit statuses every command uses, from cli/common.py."""
    from ckpttool.cli.common import EXIT_MEANINGS

    rows = ["| code | meaning |", "|---|---|"]
    rows += [f"| {code} | {_cell(meaning)} |" for code, meaning in EXIT_MEANINGS]
    return "\n".join(rows) + "\n"


def load_figures(path: Path = FIGURES) -> list[dict[str, Any]]:
    """The claims in ``benchmarks/figures.json`` (none where the file is absent: an installed
    package has no benchmarks)."""
    if not path.exists():
        return []
    claims: list[dict[str, Any]] = json.loads(path.read_text())["claims"]
    return claims


def section_slug(section: str) -> str:
    """A section's block name: ``figures-`` and its heading's first words, lower case."""
    return "figures-" + "-".join(re.findall(r"[a-z0-9]+", section.lower())[:3])


def format_ratio(ratio: float) -> str:
    """A ratio as the page writes it (``2.43x``); the docs check reads it back this way."""
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2f}x"


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return ""
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:g} {unit}"


def figures_table(section: str, path: Path = FIGURES) -> str:
    """One section's claims from ``benchmarks/figures.json``: figure, CPU, baseline and ratio,
    peak memory, target, when and at what load, and the command that measures each."""
    rows = ["| claim | figure | CPU | against | peak RSS | target | measured |",
            "|---|---|---|---|---|---|---|"]
    commands: list[str] = []
    for c in load_figures(path):
        if c["section"] != section:
            continue
        cmd = c["command"] + (f"` (at {c['commit']})" if c.get("commit") else "`")
        if cmd not in commands:
            commands.append(cmd)
        claim = c["claim"] + (f"; {c['note']}" if c.get("note") else "")
        against = c.get("baseline") or ""
        if c.get("ratio") is not None:
            against = f"**{format_ratio(c['ratio'])}**" + (f" ({against})" if against else "")
        target = c.get("target") or ""
        if target and c.get("met") is not None:
            target += ": met" if c["met"] else ": **missed**"
        when = c["date"] + (f", load {c['load']}" if c.get("load") else "")
        when += f" [{commands.index(cmd) + 1}]"
        rows.append("| " + " | ".join(_cell(x) for x in (
            claim, c["figure"], _number(c.get("cpu_s"), "s"), against,
            _number(c.get("peak_mb"), "MB"), target, when)) + " |")
    rows.append("")
    rows += [f"{i}. `{cmd}" for i, cmd in enumerate(commands, 1)]
    return "\n".join(rows) + "\n"


def generators() -> dict[str, Callable[[], str]]:
    """Each generated block's name -> the function that writes its body."""
    found: dict[str, Callable[[], str]] = {
        "formats": formats_table, "verify-codes": codes_table, "exit-codes": exit_codes_table,
        "environment": settings.table}
    for command in COMMANDS:
        found[f"options-{command}"] = lambda c=command: options_table(c)  # type: ignore[misc]
    for section in dict.fromkeys(c["section"] for c in load_figures()):
        found[section_slug(section)] = lambda s=section: figures_table(s)  # type: ignore[misc]
    return found


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def regenerate(text: str, where: str = "") -> str:
    """``text`` with every generated block's body rewritten from the code.

    Raises:
        KeyError: a block names no known table.
    """
    gens = generators()

    def body(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in gens:
            raise KeyError(f"{where}: unknown generated block '{name}' "
                           f"(known: {', '.join(sorted(gens))})")
        return m.group(1) + gens[name]() + m.group(4)

    return _BLOCK.sub(body, text)


# -- links


def _slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _CODE.sub("", page.read_text()) if page.suffix == ".md" else ""
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_links(root: Path = ROOT) -> list[str]:
    """One line per link in README.md or docs/ that leads nowhere here: a relative link to a
    missing file or heading, or a project URL to a missing file. (README.md's relative links
    are made absolute for the package index by the build: pyproject.toml's
    fancy-pypi-readme substitution.)"""
    found: list[str] = []
    for page in pages(root):
        text = _CODE.sub("", page.read_text())
        for m in _LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if target.startswith(("http://", "https://", "mailto:")):
                for prefix in (BLOB_URL, TREE_URL):
                    if target.startswith(prefix):
                        path, _, anchor = target[len(prefix):].partition("#")
                        problem = _check(root / path, anchor)
                        if problem:
                            found.append(f"{page.relative_to(root)}: {target}: {problem}")
                continue
            path, _, anchor = target.partition("#")
            problem = _check(page.parent / path if path else page, anchor)
            if problem:
                found.append(f"{page.relative_to(root)}: {target}: {problem}")
    return found


def _check(path: Path, anchor: str) -> str | None:
    if not path.exists():
        return "no such file"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"no heading '#{anchor}' in {path.name}"
    return None


def main(argv: list[str]) -> int:
    check = "--check" in argv
    problems: list[str] = []
    for page in pages():
        text = page.read_text()
        new = regenerate(text, str(page))
        if new != text:
            if check:
                problems.append(f"{page.relative_to(ROOT)}: generated tables are stale; run "
                                "python -m ckpttool.cli.docs")
            else:
                page.write_text(new)
                print(f"updated {page.relative_to(ROOT)}")
    problems += broken_links()
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
