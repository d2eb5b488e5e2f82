"""``ckpttool verify PATH [--against OTHER]``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.cli.common import (
    EXIT_PROBLEMS,
    FollowLinks,
    Iteration,
    JsonOutput,
    NoProgress,
    Phases,
    ProgressBar,
    ProgressMode,
    Strict,
    Verbose,
    Workers,
    complete_dtype,
    complete_expect_dtype,
    count,
    dtype_choice,
    epilog,
    exit_codes,
    human_bytes,
    print_json,
    printable,
    quiet_or_verbose,
    strict_exit,
    verbose_lines,
)
from ckpttool.cli.merge import NAME_MAPS, names_choice

if TYPE_CHECKING:
    from ckpttool.core.verify.operation import VerifyReport

EPILOG = epilog([
    "ckpttool verify checkpoint-500",
    "ckpttool verify checkpoint-500 --against merged/ --allow-cast",
    "ckpttool verify checkpoint-500 --expect-dtype bf16 --json | jq '.problems'",
    "ckpttool verify merged/ --write-manifest merged.manifest.json",
    "ckpttool verify copy/ --check-manifest merged.manifest.json",
    "ckpttool verify merged/ --base Qwen2.5-0.5B/",
], "Exit codes: 0 nothing at error severity, 1 errors found (with --strict: or warnings), 2 "
   "usage, 3 PATH cannot be read, 4 unsupported, 70 internal bug, 130 interrupted (Ctrl-C).")

# Problems of one code shown before "... and N more" (all are in --json).
SHOWN_PER_CODE = 10


def verify_command(
    path: Annotated[str, typer.Argument(
        metavar="PATH", help="The checkpoint to check (any format inspect reads).")],
    against: Annotated[str | None, typer.Option(
        metavar="OTHER", help="Another checkpoint (any format) that must hold the same tensors "
        "under canonical names, bit for bit: e.g. the output of ckpttool merge.")] = None,
    base: Annotated[str | None, typer.Option(
        metavar="BASE", help="The checkpoint PATH was made from (the base model of a merge or "
        "LoRA fold, the step before): PATH identical to it, bit for bit, is a warning.")] = None,
    allow_cast: Annotated[bool, typer.Option(
        "--allow-cast", help="With --against: compare after the cast that --dtype would apply "
        "(NaN equals NaN after a cast).")] = False,
    dtype: Annotated[str | None, typer.Option(
        callback=dtype_choice, autocompletion=complete_dtype, metavar="DTYPE",
        help="With --allow-cast: the --dtype given to "
        "merge (default auto: config.json's torch_dtype).")] = None,
    expect_dtype: Annotated[str | None, typer.Option(
        callback=dtype_choice, autocompletion=complete_expect_dtype, metavar="DTYPE",
        help="Floating tensors of another dtype are "
        "errors (auto: config.json's torch_dtype; also spelled bfloat16, float16, float32). "
        "Float8, integer and bool tensors are reported apart.")
    ] = None,
    config: Annotated[Path | None, typer.Option(
        metavar="PATH",
        help="config.json (or its directory) to use instead of the one beside PATH.")] = None,
    adapter_config: Annotated[Path | None, typer.Option(
        metavar="PATH", help="PEFT's adapter_config.json (or its directory) for a LoRA "
        "checkpoint, or the adapter a merged model came from, where it is not beside "
        "PATH.")] = None,
    write_manifest: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Write a SHA-256 per tensor to FILE (a new file).")] = None,
    check_manifest: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Check every tensor against the SHA-256s in FILE (written by "
        "--write-manifest); a missing FILE is an error.")] = None,
    loader: Annotated[str | None, typer.Option(
        metavar="LOADER", help="Also hold the model against what LOADER builds from "
        "config.json (transformers: the class its architectures names, on the meta device, "
        "no weights): every tensor it expects there, in its shape.")] = None,
    names: Annotated[str | None, typer.Option(
        callback=names_choice, metavar="MAP", help="With --against: the --names map the "
        f"merge that made OTHER was given ({', '.join(NAME_MAPS)}); OTHER is held to what "
        "that map makes of PATH. A Megatron-Core model's map applies unasked, as in merge; "
        "none: compare the stored names.")] = None,
    lora_alpha: Annotated[float | None, typer.Option(
        metavar="N", min=0.0, help="With --against: the --lora-alpha the merge that made "
        "OTHER was given, where nothing beside PATH records it (the fold is made again to "
        "compare).")] = None,
    no_progress: NoProgress = False,
    progress_mode: ProgressMode = None,
    follow_links: FollowLinks = False,
    workers: Workers = None,
    iteration: Iteration = None,
    json_output: JsonOutput = False,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="Print only errors and the summary line.")] = False,
    verbose: Verbose = False,
    strict: Strict = False,
) -> None:
    """Check that a checkpoint is whole and sane; compare it with another."""
    from ckpttool.core.verify.operation import verify

    quiet_or_verbose(quiet, verbose)
    phases = Phases(verbose)
    if write_manifest is not None and check_manifest is not None:
        raise typer.BadParameter("pass one of --write-manifest and --check-manifest",
                                 param_hint="--write-manifest")
    if expect_dtype == "keep":
        raise typer.BadParameter("keep checks nothing; use auto, bf16, fp16 or fp32",
                                 param_hint="--expect-dtype")
    if dtype is not None and not allow_cast:
        raise typer.BadParameter("applies to the cast that --allow-cast allows; pass "
                                 "--allow-cast too", param_hint="--dtype")
    if allow_cast and against is None:
        raise typer.BadParameter("needs --against OTHER", param_hint="--allow-cast")
    for given, option in ((names, "--names"), (lora_alpha, "--lora-alpha")):
        if given is not None and against is None:
            raise typer.BadParameter("needs --against OTHER", param_hint=option)
    bar = ProgressBar("verifying", enabled=not quiet and not no_progress,
                      mode="none" if no_progress else progress_mode)
    on_start, progress = phases.callbacks(*bar.callbacks)
    with exit_codes():
        bar.begin()
        try:
            report = verify(path, against=against, base=base, allow_cast=allow_cast,
                            dtype=dtype,
                            expect_dtype=expect_dtype,
                            config=config, manifest=write_manifest or check_manifest,
                            manifest_action="write" if write_manifest else
                            "check" if check_manifest else None, workers=workers,
                            follow_links=follow_links, progress=progress, on_start=on_start,
                            iteration=iteration, adapter_config=adapter_config,
                            loader=loader, names=names, lora_alpha=lora_alpha)
        finally:
            bar.stop()
        if json_output:
            print_json(report.to_json())
        else:
            print(render(report, quiet=quiet))
        if verbose:
            verbose_lines([f"read {report.checkpoint} ({report.format})",
                           f"checks: {', '.join(report.checks)}",
                           phases.line("reading")])
        if not report.ok:
            raise typer.Exit(EXIT_PROBLEMS)
        strict_exit(strict, report.counts["warning"])


def render(r: VerifyReport, *, quiet: bool = False) -> str:
    """One line per problem (the first few of each code), then one summary line; every line
    escaped (:func:`printable`: names come from the checkpoint)."""
    lines: list[str] = []
    shown: dict[str, int] = {}
    hidden: dict[str, int] = {}
    for p in r.problems:
        if quiet and p.severity != "error":
            continue
        n = shown.get(p.code, 0)
        if n >= SHOWN_PER_CODE:
            hidden[p.code] = hidden.get(p.code, 0) + 1
            continue
        shown[p.code] = n + 1
        lines.append(f"{p.severity}: {p.code}: {p.message}")
    lines += [f"... and {n} more {code} (all in --json)" for code, n in hidden.items()]
    c = r.counts
    against = f" against {r.against['checkpoint']}" if r.against else ""
    if r.parts:
        against = f" (and {', '.join(p.path for p in r.parts)}){against}"
    manifest = ""
    if r.manifest is not None:
        manifest = f"; manifest {r.manifest.action}: {r.manifest.path}"
    from ckpttool.core.runtime.report import storage_note  # not at import: --help stays light

    note = storage_note(r.storage)
    if note:
        manifest += f"; {note}"
    verdict = "OK" if r.ok else "FAILED"
    counts = ", ".join(count(c[s], word) for s, word in (("error", "error"),
                                                          ("warning", "warning"),
                                                          ("info", "note")))
    lines.append(f"verify {verdict}: {r.checkpoint}{against}: {counts}; "
                 f"{count(r.num_tensors, 'tensor')}, {human_bytes(r.bytes_read)} read "
                 f"in {r.seconds:.1f} s{manifest}")
    lines = [printable(line) for line in lines]
    return "\n".join(lines)
