"""``ckpttool merge RUN OUT_ROOT --all``: the flags, one library call, the rendering."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import typer

from ckpttool.cli import failure
from ckpttool.cli.common import err, exit_codes, human_bytes, printable

if TYPE_CHECKING:  # not at import: --help stays light
    from ckpttool.core.merge.options import MergeOptions
    from ckpttool.core.merge.sweep import Outcome

def check_flags(*, all_: bool, given: dict[str, bool], dry_run: bool, watch: bool,
                shared: bool, then: str | None) -> None:
    """Flag combinations: the sweep's flags need --all, --all shares no single merge's
    sharing flags, and --watch never ends a dry run.

    Raises:
        typer.BadParameter: naming the flag (exit 2).
    """
    if not all_:
        for flag, used in given.items():
            if used:
                raise typer.BadParameter("applies to merge --all (every checkpoint of a run); "
                                         "add --all, with RUN and OUT_ROOT", param_hint=flag)
        return
    if shared:
        raise typer.BadParameter("--all merges each checkpoint in one process; share the run "
                                 "between array tasks with --task I/N instead",
                                 param_hint="--slice")
    if watch and dry_run:
        raise typer.BadParameter("a dry run looks once; leave out --watch",
                                 param_hint="--watch")
    if then is not None and dry_run:
        raise typer.BadParameter("a dry run runs nothing; leave out --then", param_hint="--then")


def sweep_command(run: str, out_root: str, options: MergeOptions, *, steps: str | None,
                  task: str | None, settle: float, watch: bool, poll: float, then: str | None,
                  json_output: bool, quiet: bool) -> None:
    """Run the sweep, printing each checkpoint's outcome as it comes (a JSON line with
    ``--json``), then the summary on stderr; exit with the sweep's status."""
    from ckpttool.core.merge import sweep

    dry_run = options.write.dry_run

    report: sweep.SweepReport | None = None
    outcomes: list[Outcome] = []

    def show(o: Outcome) -> None:
        outcomes.append(o)
        if json_output:
            failure.printed_document()  # the lines say what failed: no document after them
            sys.stdout.write(json.dumps(o.to_json(), separators=(",", ":")) + "\n")
            sys.stdout.flush()
        elif not quiet or o.status == sweep.FAILED:
            # Names come from the run directory: escaped as every command escapes them.
            print(printable(outcome_line(o)), flush=True)

    with exit_codes():
        try:
            report = sweep.sweep(
                run, out_root, options,
                steps=sweep.parse_steps(steps) if steps is not None else None,
                task=sweep.parse_task(task) if task is not None else None,
                settle=settle, watch=watch, poll=poll, then=then, on_outcome=show)
        finally:
            if not quiet and (report is not None or outcomes):
                for line in summary(outcomes, dry_run=dry_run, watch=watch).splitlines():
                    err(line)  # one call per line: err() escapes a line break in a line
    assert report is not None
    if report.exit_code:
        raise typer.Exit(report.exit_code)


def outcome_line(o: Outcome) -> str:
    """One line per checkpoint: what became of it, where, why."""
    what = {"merged": "merged", "done": "skipped", "changed": "left", "waiting": "waiting",
            "failed": "FAILED", "would merge": "would merge"}.get(o.status, o.status)
    line = f"{what:<11} {o.found.name}"
    written = _written(o)
    if o.status in ("merged", "would merge"):
        # The output's size where it is known (a merge drops optimizer state, casts, keeps
        # one tied copy: the source's size says little of it).
        size = (human_bytes(written) if written is not None
                else f"source {human_bytes(o.found.num_bytes)}")
        line += f" -> {o.out} ({size})"
    if o.status == "merged":
        line += f" in {o.seconds:.1f} s"
        if written and o.seconds > 0:
            line += f" ({human_bytes(int(written / o.seconds))}/s)"
        resumed = o.merge.resumed if o.merge is not None else None
        if resumed is not None and resumed.done_before:
            line += (f" (resumed: {resumed.done_before} of {resumed.pieces} pieces were "
                     "written already)")
    if o.reason:
        line += f": {o.reason}"
    return line


def _written(o: Outcome) -> int | None:
    """Bytes of the files a merge wrote (or would write); None without its report."""
    if o.merge is None:
        return None
    return sum(f.bytes for f in o.merge.files)


def summary(outcomes: list[Outcome], *, dry_run: bool, watch: bool) -> str:
    """The end of a sweep, in words: how many of each, which failed, and how fast. A
    checkpoint is counted once, as it ended (--watch reports one waiting, then merged)."""
    outcomes = list({o.found.name: o for o in outcomes}.values())
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    words = [("would merge", "would merge")] if dry_run else [("merged", "merged")]
    words += [("done", "skipped (done)"), ("changed", "left (changed; --overwrite)"),
              ("waiting", "waiting (still being written)"), ("failed", "failed")]
    parts = [f"{counts.get(status, 0)} {label}" for status, label in words
             if counts.get(status) or status in ("merged", "failed")]
    head = "merge --all" + (" (dry run)" if dry_run else "") + (" (watch ended)" if watch else "")
    if not outcomes:
        return f"{head}: no checkpoints found"
    lines = [f"{head}: {', '.join(parts)}"]
    merged = [o for o in outcomes if o.status == "merged"]
    written = sum(_written(o) or 0 for o in merged)
    seconds = sum(o.seconds for o in merged)
    if written and seconds > 0:
        lines[0] += (f"; {human_bytes(written)} written in {seconds:.1f} s "
                     f"({human_bytes(int(written / seconds))}/s)")
    failed = [o for o in outcomes if o.status == "failed"]
    lines += [f"  failed: {o.found.name} (exit {o.exit_code}): {o.reason}" for o in failed]
    if not dry_run and not failed and not counts.get("merged") and counts.get("done"):
        lines.append("  nothing to do: every complete checkpoint is merged already")
    return "\n".join(lines)
