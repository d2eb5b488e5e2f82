"""``ckpttool reshard SRC OUT``."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from ckpttool.cli.common import (
    FollowLinks,
    Iteration,
    JsonOutput,
    NoProgress,
    Phases,
    ProgressBar,
    ProgressMode,
    Verbose,
    Workers,
    count,
    epilog,
    err,
    exit_codes,
    human_bytes,
    print_json,
    printable,
    quiet_or_verbose,
    removes_new_dirs,
    size_option,
    verbose_lines,
)

EPILOG = epilog([
    "ckpttool reshard ckpt/pytorch_model_fsdp_0 ckpt8/pytorch_model_fsdp_0 --ranks 8",
    "ckpttool reshard merged/ resume/pytorch_model_fsdp_0 --to dcp --prefix model",
    "ckpttool reshard merged/ resplit/ --to safetensors --max-shard-size 2GB",
], "Exit codes: 0 ok, 2 usage, 3 bad input or output, 4 unsupported, 70 internal bug, "
   "130 interrupted (Ctrl-C; temporary files removed).")


class Target(str, Enum):
    dcp = "dcp"
    safetensors = "safetensors"


def reshard_command(
    src: Annotated[str, typer.Argument(
        metavar="SRC", help="A checkpoint in any format ckpttool reads: a DCP directory (or "
        "another training split) for --ranks, full weights (safetensors, .bin) for --to.")],
    out: Annotated[str, typer.Argument(metavar="OUT", help="Output directory.")],
    ranks: Annotated[int | None, typer.Option(
        min=1, metavar="M", help="Ranks of the DCP output, split on dim 0 as FSDP2 does "
        "(default 1 from full weights; required from DCP).")] = None,
    to: Annotated[Target, typer.Option(help="Output format.")] = Target.dcp,
    prefix: Annotated[str | None, typer.Option(
        metavar="KEY", help="With DCP output from full weights, nest under this key: 'model' "
        "makes a pytorch_model_fsdp_0 that accelerate's load_fsdp_model reads.")] = None,
    max_shard_size: Annotated[str, typer.Option(
        callback=size_option, metavar="SIZE",
        help="With --to safetensors: the largest shard (5GB, 500MB...).")] = "5GB",
    no_progress: NoProgress = False,
    progress_mode: ProgressMode = None,
    follow_links: FollowLinks = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a checkpoint already in OUT.")] = False,
    workers: Workers = None,
    iteration: Iteration = None,
    json_output: JsonOutput = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")
                     ] = False,
    verbose: Verbose = False,
) -> None:
    """Change how a checkpoint is split: ranks, shard size or format, byte for byte."""
    from ckpttool.core.reshard import reshard
    from ckpttool.core.runtime import leftovers

    quiet_or_verbose(quiet, verbose)
    phases = Phases(verbose)
    bar = ProgressBar("resharding", enabled=not quiet and not no_progress,
                      mode="none" if no_progress else progress_mode)
    on_start, progress = phases.callbacks(*bar.callbacks)
    with exit_codes(), removes_new_dirs(out):
        bar.begin()
        try:
            report = reshard(src, out, ranks=ranks, to=to.value, prefix=prefix,
                             max_shard_size=max_shard_size, overwrite=overwrite,
                             follow_links=follow_links, workers=workers, progress=progress,
                             iteration=iteration,
                             on_start=on_start)
        finally:
            bar.stop()
            for note in leftovers.removed_stale():  # a killed run's leftovers, now removed
                err(f"ckpttool: warning: {note}")
        if not quiet:
            for w in report.warnings:
                err(f"ckpttool: warning: {w}")
        if json_output:
            print_json(report.to_json())
        elif not quiet:
            layout = count(report.ranks, "rank") if report.ranks else "safetensors"
            print(printable(f"resharded {report.checkpoint} ({report.format_in}) -> "
                            f"{report.out} ({layout}) in {report.seconds:.1f} s"))
            if report.checkpoint != report.src:
                print(printable(f"  used {Path(report.checkpoint).name}, found in {report.src}"))
            print(f"  {count(report.num_tensors, 'tensor')}, {human_bytes(report.total_bytes)}"
                  + (f", {report.num_objects} non-tensor entries copied" if report.num_objects
                     else ""))
            for f in report.files:
                print(printable(f"  wrote {f.name}: {human_bytes(f.bytes)}"))
            if report.tied_copies:
                print(printable(f"  tied copies written again (the model's state dict holds "
                                f"them): {', '.join(report.tied_copies)}"))
            c = report.contract
            if c is not None and c.checked:
                print(printable(f"  contract: {c.consumer} takes it whole "
                                f"({count(c.expected, 'tensor')})"))
        if verbose:
            verbose_lines([f"read {report.checkpoint} ({report.format_in})",
                           f"plan: {count(report.num_tensors, 'tensor')}, "
                           f"{human_bytes(report.total_bytes)} into {len(report.files)} files",
                           phases.line("writing")])
