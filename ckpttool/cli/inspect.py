"""``ckpttool inspect PATH``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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
    exit_codes,
    human_bytes,
    print_json,
    printable,
    quiet_or_verbose,
    verbose_lines,
)

if TYPE_CHECKING:
    from ckpttool.core.checkpoint.parts import Content
    from ckpttool.core.inspect import InspectReport, Summary, TensorRow

EPILOG = epilog([
    "ckpttool inspect checkpoint-500",
    "ckpttool inspect model.safetensors --filter '*embed*' --stats",
    "ckpttool inspect pytorch_model.bin --json | jq '.summary'",
    "ckpttool inspect checkpoint-500 -q && echo readable",
], "Reads only metadata and headers unless --stats is given.",
   "Exit codes: 0 ok, 2 usage, 3 bad input, 4 unsupported, 70 internal bug, 130 "
   "interrupted (Ctrl-C).")


def inspect_command(
    path: Annotated[str, typer.Argument(
        metavar="PATH", help="A checkpoint in any format ckpttool reads (a DCP directory, a "
        ".safetensors file or sharded directory, a torch.save .bin/.pt state dict...), or a "
        "training checkpoint directory (checkpoint-500/).")],
    filter: Annotated[str | None, typer.Option(
        "--filter", metavar="GLOB", help="Show only tensors whose name matches this glob "
        "(e.g. '*layers.0.*'); the summary still counts them all.")] = None,
    no_progress: NoProgress = False,
    progress_mode: ProgressMode = None,
    follow_links: FollowLinks = False,
    stats: Annotated[bool, typer.Option(
        "--stats", help="Read the data and add min, max, mean, abs-max, NaN and Inf counts "
        "per tensor.")] = False,
    config: Annotated[Path | None, typer.Option(
        metavar="PATH",
        help="config.json (or its directory) to use instead of the one beside PATH.")] = None,
    workers: Workers = None,
    iteration: Iteration = None,
    json_output: JsonOutput = False,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="Print nothing but errors: the exit code says whether PATH is a "
        "checkpoint ckpttool reads.")] = False,
    verbose: Verbose = False,
) -> None:
    """Show what a checkpoint holds: format, parts, tensors, dtypes, sizes, ties."""
    from ckpttool.core.inspect import inspect

    quiet_or_verbose(quiet, verbose)
    phases = Phases(verbose)
    bar = ProgressBar("reading", enabled=stats and not quiet and not no_progress,
                      mode="none" if no_progress else progress_mode)
    on_start, progress = phases.callbacks(*bar.callbacks)
    with exit_codes():
        bar.begin()
        try:
            report = inspect(path, filter=filter, stats=stats, config=config,
                             follow_links=follow_links, workers=workers, progress=progress,
                             iteration=iteration,
                             on_start=on_start)
        finally:
            bar.stop()
        if json_output:
            print_json(report.to_json())
        elif not quiet:
            print(render(report))
        if verbose:
            verbose_lines([f"read {report.checkpoint} ({report.format})",
                           phases.line("reading values")])


def render(r: InspectReport) -> str:
    """The human report: a summary block, then the tensor table. Names come from the
    checkpoint: every line is escaped (:func:`printable`)."""
    if r.format == "none":  # a directory of several checkpoints: none chosen
        lines = [f"{r.path}: a directory of several checkpoints (see the note)"]
    else:
        lines = [f"{r.format} checkpoint {r.checkpoint} ({r.kind})"]
    if r.checkpoint != r.path:
        lines[0] += f", found in {r.path}"
    if r.parts:
        lines.append("  parts:")
        for p in r.parts:
            note = f"; {p.note}" if p.note else ""
            lines.append(f"    {p.path}: {p.kind} ({p.format}{note})")
    if len(r.contents) > 1:  # a training checkpoint: model, optimizer, train state...
        lines.append("  contents:")
        lines += [_content_line(c, r.kind) for c in r.contents]
    if r.summary is not None:
        lines += _summary_lines(r.summary)
    # Optimizer hyper-parameters (one per parameter in torchtitan's layout) are counted, not
    # listed, beside a model; --json has them all.
    hidden = [o for o in r.non_tensor if o.part == "optimizer" and r.kind != "optimizer"]
    if hidden:
        lines.append(f"  non-tensor optimizer state: {len(hidden):,} entries (param groups; "
                     "listed in --json)")
    for o in r.non_tensor:
        if o.part == "optimizer" and r.kind != "optimizer":
            continue
        if o.readable:
            lines.append(f"  non-tensor {o.name} = {_short(o.value)}")
        else:
            lines.append(f"  non-tensor {o.name}: {o.note}")
    lines += [f"  note: {n}" for n in r.notes]
    lines = [printable(line) for line in lines]
    if r.tensors:
        lines.append("")
        parted = len({t.part for t in r.tensors}) > 1
        lines.append(_table(r.tensors, r.stats, parted))
    elif r.filter and r.summary is not None:
        lines.append(printable(f"  no tensor matches --filter {r.filter!r}"))
    return "\n".join(lines)


def _content_line(c: Content, kind: str) -> str:
    held = ", ".join(x for x in (
        f"{count(c.num_tensors, 'tensor')}, {human_bytes(c.bytes)}" if c.num_tensors else "",
        f"{c.num_non_tensor:,} non-tensor entr{'y' if c.num_non_tensor == 1 else 'ies'}"
        if c.num_non_tensor else "") if x)
    where = f" in {c.file}" if c.file else ""
    note = ("; not recognised, never merged" if c.part == "other" else
            "; merge writes it" if c.part == kind and not c.file else
            "; merge --part optimizer writes it" if c.part == "optimizer" and not c.file
            else "")
    return f"    {c.part}{where}: {held} (keys {', '.join(c.keys)}{note})"


def _summary_lines(s: Summary) -> list[str]:
    where = ", ".join(x for x in (
        count(s.num_ranks, "rank") if s.num_ranks is not None else "",
        count(s.num_files, "file")) if x)
    per_dtype = ", ".join(f"{k} {human_bytes(v)}" for k, v in s.bytes_per_dtype.items())
    lines = [f"  {where}; {count(s.num_tensors, 'tensor')}, {s.num_parameters:,} "
             f"parameters, {human_bytes(s.bytes)} ({per_dtype or 'no tensors'})"]
    from ckpttool.core.runtime.report import storage_note  # not at import: --help stays light

    stored = storage_note(s.storage)
    if stored:
        lines.append(f"  storage: {stored}")
    m = s.merged
    dedup = f", {m.deduplicated} written once" if m.deduplicated else ""
    lines.append(f"  merged with --dtype auto: {human_bytes(m.bytes)} in "
                 f"{m.dtype or 'the stored dtypes'} ({m.dtype_source}{dedup})")
    if s.wrappers:
        lines.append(f"  name wrappers: {', '.join(s.wrappers)} "
                     f"({s.num_renamed} names shown without them)")
    if s.tie:
        t = s.tie
        said = {True: "config ties them", False: "config unties them",
                None: "no config says"}[t.config_ties]
        lines.append(f"  tie candidates: {t.output} / {t.input} ({said})")
    if s.lora is not None:
        lines.append(f"  {s.lora.line()}")
    if s.quantization is not None:
        lines.append(f"  {s.quantization.line()}")
    return lines


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _table(rows: list[TensorRow], stats: bool, parted: bool = False) -> str:
    header = ["name", "shape", "dtype", "size", "chunks", "placement", "files"]
    if parted:
        header.insert(1, "part")
    if stats:
        header += ["min", "max", "mean", "abs max", "nan", "inf"]
    table = [header]
    for r in rows:
        files = printable(r.files[0]) if len(r.files) == 1 else f"{len(r.files)} files"
        row = [printable(r.name), "x".join(map(str, r.shape)) or "scalar", r.dtype,
               human_bytes(r.bytes), str(r.chunks), r.placement, files]
        if parted:
            row.insert(1, r.part or "")
        if stats:
            st = r.stats
            row += ["-"] * 6 if st is None else [
                _num(st.min), _num(st.max), _num(st.mean), _num(st.abs_max), str(st.nan),
                str(st.inf)]
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in table)


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.4g}"
