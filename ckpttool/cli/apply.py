"""``ckpttool apply BASE DELTA OUT``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckpttool.cli.common import (
    FollowLinks,
    JsonOutput,
    NoProgress,
    ProgressBar,
    count,
    epilog,
    exit_codes,
    human_bytes,
    print_json,
    printable,
    removes_new_dirs,
    size_option,
)

EPILOG = epilog([
    "ckpttool diff step-100/ step-200/ --write-delta delta-200/",
    "ckpttool apply step-100/ delta-200/ step-200/",
    "ckpttool apply step-100.safetensors delta-200/ out/ --json",
], "BASE may be in any format, as long as it holds the tensors of the delta's A (checked by "
   "SHA-256 first); OUT is written as Hugging Face safetensors, each tensor checked against "
   "B's SHA-256 before anything is put in place.",
   "Exit codes: 0 ok, 2 usage, 3 BASE is not the delta's A, a damaged delta, or OUT cannot "
   "be written, 4 unsupported, 70 internal bug.")


def apply_command(
    base: Annotated[str, typer.Argument(
        metavar="BASE", help="The checkpoint the delta was made from (A), in any format.")],
    delta: Annotated[Path, typer.Argument(
        metavar="DELTA", help="The directory ckpttool diff A B --write-delta wrote.")],
    out: Annotated[Path, typer.Argument(
        metavar="OUT", help="Output directory for B, as safetensors.")],
    max_shard_size: Annotated[str, typer.Option(
        callback=size_option, metavar="SIZE",
        help="Largest output shard (5GB, 500MB, 2GiB); one file if everything fits.")] = "5GB",
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace model weights already in OUT.")] = False,
    no_progress: NoProgress = False,
    follow_links: FollowLinks = False,
    json_output: JsonOutput = False,
) -> None:
    """Rebuild B, bit for bit, from A and a delta of ckpttool diff."""
    from ckpttool.core.diff.apply import apply

    bar = ProgressBar("applying", enabled=not no_progress)
    on_start, progress = bar.callbacks
    with exit_codes(), removes_new_dirs(str(out)):
        bar.begin()
        try:
            report = apply(base, delta, out, max_shard_size=max_shard_size,
                           overwrite=overwrite, follow_links=follow_links, progress=progress,
                           on_start=on_start)
        finally:
            bar.stop()
        if json_output:
            print_json(report.to_json())
        else:
            print(printable(
                f"applied {report.delta} to {report.base}: {report.out} "
                f"({count(report.num_tensors, 'tensor')}: {report.from_base} from BASE, "
                f"{report.sparse} patched, {report.whole} whole; "
                f"{human_bytes(report.bytes_written)} in {report.seconds:.1f} s)"))
