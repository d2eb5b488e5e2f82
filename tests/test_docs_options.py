"""Every option the docs name exists (issue 38: docs/lora.md named a ``verify
--adapter-config`` that did not).

A ``ckpttool COMMAND ...`` line (a code block or a code span) may use only that command's
options, read from its ``--help``; an option in any other code span is one of ckpttool's, or
one of the other programs' that the docs talk about (listed here, with whose it is)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from typer.testing import CliRunner

from ckpttool.cli import app

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("merge", "inspect", "verify", "reshard", "diff", "apply")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND_LINE = re.compile(r"ckpttool (" + "|".join(COMMANDS) + r")\b([^|&;`]*)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")

# Options of other programs that the docs name in passing.
FOREIGN = {
    "--index-url": "pip", "--user": "pip", "--revision": "hf upload",
    "--ckpt-format": "Megatron-LM", "--save": "Megatron-LM", "--moe-layer-freq": "Megatron-LM",
    "--mtp-num-layers": "Megatron-LM", "--rope-type": "Megatron-LM",
    "--pipeline-model-parallel-layout": "Megatron-LM", "--norm-epsilon": "Megatron-LM",
    "--vocab-size": "Megatron-LM", "--no-save-optim": "Megatron-LM",
    "--no-save-rng": "Megatron-LM", "--dist-ckpt-optim-fully-reshardable": "Megatron-LM",
    "--transformer-impl": "Megatron-LM", "--v-head-dim": "Megatron-LM",
    "--qk-head-dim": "Megatron-LM", "--qk-pos-emb-head-dim": "Megatron-LM",
    "--kv-channels": "Megatron-LM",
    "--moe": "benchmarks/megatron_merge.py", "--array": "sbatch",
}


@cache
def options(*command: str) -> frozenset[str]:
    r = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "1000"})
    assert r.exit_code == 0, r.output
    return frozenset(OPTION.findall(r.stdout))


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def unknown(page: Path) -> list[str]:
    ours = options().union(*(options(c) for c in COMMANDS))
    found = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        for m in COMMAND_LINE.finditer(line):
            found += [f"{page.name}:{n}: ckpttool {m[1]} has no {o}"
                      for o in OPTION.findall(m[2]) if o not in options(m[1])]
        if page.name == "benchmarks.md":
            continue  # the benchmark scripts' own flags
        for span in CODE_SPAN.findall(line):
            if "benchmarks/" in span:
                continue
            found += [f"{page.name}:{n}: {o} is no option of ckpttool" for o in
                      OPTION.findall(span) if o not in ours and o not in FOREIGN]
    return found


def test_every_option_the_docs_name_exists() -> None:
    assert [x for page in pages() for x in unknown(page)] == []


def test_the_check_finds_an_option_that_is_not_there(tmp_path: Path) -> None:
    page = tmp_path / "lora.md"
    page.write_text("    ckpttool verify merged/ --adapter-configs a/\n"
                    "Pass `--no-such-option` to ...\n"
                    "`ckpttool inspect x --stats` and `--index-url URL` (pip's)\n")
    assert unknown(page) == ["lora.md:1: ckpttool verify has no --adapter-configs",
                             "lora.md:2: --no-such-option is no option of ckpttool"]
