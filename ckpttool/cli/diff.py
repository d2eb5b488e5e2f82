"""``ckpttool diff A B [--write-delta DIR]``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.cli.common import (
    EXIT_PROBLEMS,
    FollowLinks,
    JsonOutput,
    NoProgress,
    ProgressBar,
    Workers,
    count,
    epilog,
    exit_codes,
    human_bytes,
    print_json,
    printable,
    removes_new_dirs,
)

if TYPE_CHECKING:
    from ckpttool.core.diff.operation import DiffReport

EPILOG = epilog([
    "ckpttool diff checkpoint-500 merged/",
    "ckpttool diff step-100/ step-200/ --filter '*layers.0.*'",
    "ckpttool diff step-100/ step-200/ --json | jq '.tensors[] | select(.status != \"identical\")'",
    "ckpttool diff step-100/ step-200/ --write-delta delta-200/",
    "ckpttool apply step-100/ delta-200/ step-200-rebuilt/",
], "Tensors are matched under canonical names, in any formats; a tied lm_head.weight stored "
   "once on one side is compared through its partner there. Identity is bitwise: a NaN whose "
   "payload changed, or 0.0 become -0.0, is a change.",
   "Exit codes: 0 identical, 1 different, 2 usage, 3 bad input or output, 4 unsupported, "
   "70 internal bug.")

# Rows shown for people (all are in --json).
SHOWN = 50


def diff_command(
    a: Annotated[str, typer.Argument(
        metavar="A", help="The first checkpoint (any format ckpttool reads).")],
    b: Annotated[str, typer.Argument(
        metavar="B", help="The second checkpoint (any format ckpttool reads).")],
    filter: Annotated[str | None, typer.Option(
        "--filter", metavar="GLOB", help="Compare only tensors whose name matches this glob "
        "(e.g. '*layers.0.*').")] = None,
    write_delta: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Write a delta into DIR that rebuilds B from A (ckpttool apply): "
        "the changed elements where that is smaller, else whole tensors.")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="With --write-delta: replace a delta already in DIR.")] = False,
    no_progress: NoProgress = False,
    follow_links: FollowLinks = False,
    workers: Workers = None,
    json_output: JsonOutput = False,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="Print only the summary line.")] = False,
) -> None:
    """Show which tensors differ between two checkpoints, and by how much."""
    from ckpttool.core.diff.operation import diff

    if write_delta is not None and filter is not None:
        raise typer.BadParameter("a delta rebuilds all of B; leave out --filter",
                                 param_hint="--write-delta")
    if overwrite and write_delta is None:
        raise typer.BadParameter("needs --write-delta DIR", param_hint="--overwrite")
    bar = ProgressBar("comparing", enabled=not quiet and not no_progress)
    on_start, progress = bar.callbacks
    with exit_codes():
        bar.begin()
        try:
            if write_delta is not None:
                with removes_new_dirs(str(write_delta)):
                    report = diff(a, b, filter=filter, write_delta=write_delta,
                                  overwrite=overwrite, workers=workers,
                                  follow_links=follow_links, progress=progress,
                                  on_start=on_start)
            else:
                report = diff(a, b, filter=filter, workers=workers, follow_links=follow_links,
                              progress=progress, on_start=on_start)
        finally:
            bar.stop()
        if json_output:
            print_json(report.to_json())
        else:
            print(render(report, quiet=quiet))
        if not report.identical:
            raise typer.Exit(EXIT_PROBLEMS)


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def render(r: DiffReport, *, quiet: bool = False) -> str:
    """A line per tensor that is not identical (the first :data:`SHOWN`), the ties compared
    through a partner, then the summary; every line escaped (names come from checkpoints)."""
    lines: list[str] = []
    if not quiet:
        rows = [t for t in r.tensors if t.status != "identical"]
        for t in rows[:SHOWN]:
            if t.changed_elements is None:
                lines.append(f"{t.status:<13} {t.name}")
            else:
                lines.append(f"{t.status:<13} {t.name}: {count(t.changed_elements, 'element')}, "
                             f"max |B-A| {_number(t.max_abs_diff)}, "
                             f"rel L2 {_number(t.rel_l2)}")
        if len(rows) > SHOWN:
            lines.append(f"... and {len(rows) - SHOWN} more (all in --json)")
        for tie in r.tied:
            lines.append(f"note: '{tie.name}' is stored once in {tie.side.upper()} (tied to "
                         f"'{tie.partner}'), compared through it")
    s = r.summary
    verdict = "identical" if r.identical else "different"
    counts = ""
    if s is not None:
        parts = [f"{n} {word}" for n, word in (
            (s.identical, "identical"), (s.changed, "changed"), (s.added, "added"),
            (s.removed, "removed"), (s.reshaped, "reshaped"), (s.dtype_changed,
                                                                "dtype-changed")) if n]
        counts = (f": {count(len(r.tensors), 'tensor')} ({', '.join(parts) or 'none'}); "
                  f"{human_bytes(s.bytes_changed)} changed")
    where = f" (--filter {r.filter!r})" if r.filter else ""
    lines.append(f"diff {verdict}{where}: {r.a} -> {r.b}{counts}; {human_bytes(r.bytes_read)} "
                 f"read in {r.seconds:.1f} s")
    if r.delta is not None:
        d = r.delta
        lines.append(f"delta written: {d.path} ({human_bytes(d.bytes)}: {d.from_base} from A, "
                     f"{d.sparse} sparse, {d.whole} whole)")
    return "\n".join(printable(line) for line in lines)
