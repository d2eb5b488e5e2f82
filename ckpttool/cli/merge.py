"""``ckpttool merge SRC OUT``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpttool.cli.common import (
    DTYPE_CHOICES,
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
    completer,
    count,
    dtype_choice,
    epilog,
    err,
    exit_codes,
    human_bytes,
    print_json,
    printable,
    quiet_or_verbose,
    removes_new_dirs,
    size_option,
    strict_exit,
    verbose_lines,
)

if TYPE_CHECKING:
    from ckpttool.core.merge.report import MergeReport, PlannedTensor
    from ckpttool.core.transforms.lora.report import LoraMerge

EPILOG = epilog([
    "ckpttool merge checkpoint-500/pytorch_model_fsdp_0 out/",
    "ckpttool merge checkpoint-500 out/ --dtype bf16 --max-shard-size 2GB",
    "ckpttool merge checkpoint-500 out/ --dry-run --json | jq '.tensors[] | [.name, .dtype]'",
    "ckpttool merge ckpt out/ --json | jq .files",
    "ckpttool merge lora-checkpoint out/ --lora adapter",
    "ckpttool merge base-model/ out/ --adapter my-adapter/",
    "ckpttool merge checkpoint/step-1000 optim/ --part optimizer",
    "ckpttool merge s3://bucket/run/checkpoint-500 s3://bucket/merged/",
    "ckpttool merge outputs/checkpoint/step-1000 out/ --names torchtitan-llama3 --config hf/",
    "ckpttool merge megatron-run/ out/ --config hf-config.json",
    "ckpttool merge run/ merged/ --all --steps 'every 1000' --dtype bf16",
    "ckpttool merge run/ merged/ --all --watch --then 'lm_eval --model_args "
    "pretrained=\"$CKPTTOOL_OUT\"'",
    "ckpttool merge run/ merged/ --all --task $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT",
], "Exit codes: 0 ok, 1 a warning with --strict, 2 usage, 3 bad input or output, 4 "
   "unsupported, 70 internal bug, 130 interrupted (Ctrl-C: nothing incomplete is put in place; "
   "the same command resumes a large merge). --all: 0 when no checkpoint failed, else the "
   "most serious failure's (70, 3, 4); which failed is in the summary.")


# The name maps of ckpttool.core.transforms.maps (NAMES), spelled here so that --help
# imports no core.
NAME_MAPS = ("megatron-llama", "megatron-qwen2", "megatron-qwen3", "megatron-qwen3_moe",
             "megatron-mixtral", "megatron-deepseek_v3", "megatron-gpt_oss",
             "torchtitan-llama3", "torchtitan-qwen3",
             "torchtitan-deepseek-v3", "torchtitan-gpt-oss", "torchtune-llama",
             "torchtune-qwen2")


def names_choice(value: str | None) -> str | None:
    """Typer callback for ``--names``: one of :data:`NAME_MAPS` (else a usage error)."""
    if value is not None and value not in (*NAME_MAPS, "none"):
        raise typer.BadParameter(f"'{value}' is not one of {', '.join(NAME_MAPS)}, none")
    return value


def merge_command(
    src: Annotated[str, typer.Argument(
        metavar="SRC", help="A checkpoint in any format inspect reads (DCP directory, per-rank "
        "files, a .bin/.pt or safetensors model, sharded or not), or a training checkpoint "
        "directory holding one (checkpoint-500/).")],
    out: Annotated[str, typer.Argument(
        metavar="OUT", help="Output directory for the safetensors files (not SRC, nor inside "
        "it).")],
    dtype: Annotated[str, typer.Option(
        callback=dtype_choice, autocompletion=complete_dtype, metavar="DTYPE",
        help=f"Dtype of floating tensors: "
        f"{DTYPE_CHOICES}, also spelled bfloat16, float16, float32 (auto: config.json's "
        "torch_dtype). Float8, integer and bool tensors are never cast.")
    ] = "auto",
    max_shard_size: Annotated[str, typer.Option(
        callback=size_option, metavar="SIZE",
        help="Largest output shard (5GB, 500MB, 2GiB); one file if everything fits.")] = "5GB",
    config: Annotated[Path | None, typer.Option(
        metavar="PATH",
        help="config.json (or its directory) to use instead of the one beside SRC.")] = None,
    weights_only: Annotated[bool, typer.Option(
        "--weights-only", help="Write the weights without a config.json and without the "
        "check that the model config.json names takes them whole (exit 0 then promises the "
        "bytes only).")] = False,
    keep_tied: Annotated[bool, typer.Option(
        "--keep-tied", help="Write both tied embedding copies even when identical.")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace model weights already in OUT.")] = False,
    lora: _LoraOption = None,
    lora_alpha: Annotated[float | None, typer.Option(
        metavar="N", min=0.0, help="A LoRA checkpoint's lora_alpha where no "
        "adapter_config.json (nor verl's lora_train_meta.json) records it: the value training "
        "used (PEFT scales the update by alpha / r). Never guessed.")] = None,
    adapter: _AdapterOption = None,
    adapter_config: _AdapterConfigOption = None,
    part: _PartOption = None,
    no_progress: NoProgress = False,
    progress_mode: ProgressMode = None,
    follow_links: FollowLinks = False,
    names: _NamesOption = None,
    layout: _LayoutOption = "hub",
    workers: Workers = None,
    iteration: Iteration = None,
    dry_run: _DryRunOption = False,
    dequantize: _DequantizeOption = False,
    quantize: _QuantizeOption = None,
    quantize_ignore: _QuantizeIgnoreOption = None,
    no_check_crc: _NoCheckCrcOption = False,
    slice_: _SliceOption = None,
    finish: _FinishOption = False,
    all_: _AllOption = False,
    steps: _StepsOption = None,
    watch: _WatchOption = False,
    poll: _PollOption = 30.0,
    then: _ThenOption = None,
    task: _TaskOption = None,
    settle: _SettleOption = 5.0,
    json_output: JsonOutput = False,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="Print nothing but errors.")] = False,
    verbose: Verbose = False,
    strict: Strict = False,
) -> None:
    """Merge a sharded checkpoint (any format) into Hugging Face safetensors, exact to the bit.
    With --all, every checkpoint of a training run."""
    from ckpttool.cli import sweep

    quiet_or_verbose(quiet, verbose)
    if dequantize and quantize is not None:
        raise typer.BadParameter("decodes quantized weights, --quantize encodes them: pass "
                                 "one", param_hint="--dequantize")
    if quantize_ignore and quantize is None:
        raise typer.BadParameter("names modules --quantize keeps; pass --quantize fp8-block "
                                 "too", param_hint="--quantize-ignore")
    if all_ and verbose:
        raise typer.BadParameter("applies to one checkpoint; with --all each line already says "
                                 "what was merged, where and in how long", param_hint="--verbose")
    sweep.check_flags(all_=all_, given={"--steps": steps is not None, "--watch": watch,
                                        "--poll": poll != 30.0, "--then": then is not None,
                                        "--task": task is not None, "--settle": settle != 5.0},
                      dry_run=dry_run, watch=watch, shared=slice_ is not None or finish,
                      then=then)
    if all_ and strict:
        raise typer.BadParameter("applies to one checkpoint; with --all a warning does not "
                                 "fail it", param_hint="--strict")
    if all_ and iteration is not None:
        raise typer.BadParameter("picks one iteration; --all merges every checkpoint of the "
                                 "run", param_hint="--iteration")
    from ckpttool.core.merge.options import (  # light: no torch, no engine
        CastOptions,
        MergeOptions,
        ReadOptions,
        ShareOptions,
        WriteOptions,
    )

    options = MergeOptions(
        ReadOptions(config=config, part=part, iteration=iteration, lora=lora, adapter=adapter,
                    adapter_config=adapter_config, lora_alpha=lora_alpha,
                    follow_links=follow_links, check_crc=not no_check_crc),
        CastOptions(dtype=dtype, names=names, layout=layout, keep_tied=keep_tied,
                    dequantize=dequantize, quantize=quantize,
                    quantize_ignore=tuple(quantize_ignore or ())),
        WriteOptions(max_shard_size=max_shard_size, overwrite=overwrite, dry_run=dry_run,
                     weights_only=weights_only),
        ShareOptions(workers=workers))
    if all_:
        sweep.sweep_command(src, out, options, steps=steps, task=task, settle=settle,
                            watch=watch, poll=poll, then=then, json_output=json_output,
                            quiet=quiet)
        return
    from ckpttool.core.merge.operation import merge

    phases = Phases(verbose)
    if slice_ is not None and finish:
        raise typer.BadParameter("--slice writes one share, --finish commits them all: run "
                                 "each slice, then --finish once", param_hint="--finish")
    from ckpttool.core.runtime import leftovers, urls  # not at import: --help loads no core

    with exit_codes():  # before a launcher's processes join: each would refuse it alone
        urls.check_location(src, what="source")
        urls.check_location(out, what="output")
    with exit_codes(), removes_new_dirs(out), _shared(slice_, finish) as shared:
        # Under torchrun, rank 0 speaks for all; the others print only their errors.
        speaks = shared is None or shared.first
        quiet = quiet or not speaks
        bar = ProgressBar("merging", enabled=not quiet and not no_progress and not dry_run,
                          mode="none" if no_progress else progress_mode)
        on_start, progress = phases.callbacks(*bar.callbacks)
        bar.begin()
        try:
            share = replace(options.share, shared=shared)  # this process's part
            report = merge(src, out, replace(options, share=share), progress=progress,
                           on_start=on_start)
        finally:
            bar.stop()
            for note in leftovers.removed_stale():  # a killed run's leftovers, now removed
                err(f"ckpttool: warning: {note}")
        if json_output and speaks:
            print_json(report.to_json())
        elif not quiet:
            _print_human(report)
        if not quiet:
            for w in report.warnings:
                err(f"ckpttool: warning: {w}")
        if verbose and speaks:
            verbose_lines(_verbose(report, phases))
        strict_exit(strict, len(report.warnings))


@contextmanager
def _shared(slice_: str | None, finish: bool) -> Iterator[Any]:
    """How this process shares the merge: --slice, --finish, a torchrun job (from the
    launcher's variables), or not at all (None)."""
    from ckpttool.core.merge import multihost

    if slice_ is not None:
        yield multihost.Slice(*multihost.parse_slice(slice_))
    elif finish:
        yield multihost.Finish()
    else:
        team = multihost.team_from_env()
        try:
            yield team
        finally:
            if team is not None:
                team.close()


def _lora_choice(value: str | None) -> str | None:
    if value is None or value in ("fuse", "adapter"):
        return value
    raise typer.BadParameter(f"'{value}' is not one of: fuse, adapter")


def _layout_choice(value: str) -> str:
    if value not in ("hub", "stored"):
        raise typer.BadParameter(f"'{value}': choose hub or stored", param_hint="--layout")
    return value


def _part_choice(value: str | None) -> str | None:
    """``--part``: model or optimizer (a usage error otherwise, exit 2)."""
    if value is None or value in ("model", "optimizer"):
        return value
    raise typer.BadParameter(f"{value!r} is not one of model, optimizer")


def _print_human(r: object) -> None:
    from ckpttool.core.merge.report import MergeReport

    assert isinstance(r, MergeReport)
    lines = _head_lines(r) + _size_lines(r) + _name_lines(r) + _tie_lines(r)
    if r.lora:
        lines += _lora_lines(r.lora)
    lines += _rest_lines(r) + _contract_lines(r)
    lines = [printable(line) for line in lines]  # names from the checkpoint: never raw
    if r.dry_run:
        lines += ["", _plan_table(r.tensors)]
    print("\n".join(lines))




def _contract_lines(r: MergeReport) -> list[str]:
    """Whether the model config.json names takes the output whole (core.contract)."""
    c = r.contract
    if c is None:
        return []
    if not c.checked:
        return [f"  contract: not checked ({c.reason})"]
    ignored = f", {len(c.ignored)} it ignores" if c.ignored else ""
    extra = f", {len(c.extra)} it does not take" if c.extra else ""
    return [f"  contract: {c.consumer} takes it whole ({count(c.expected, 'tensor')}"
            f"{ignored}{extra})"]


def _head_lines(r: MergeReport) -> list[str]:
    """What was merged where, how it was shared or resumed, which directory was used."""
    what = ("optimizer state" if r.kind == "optimizer"
            else "LoRA adapter" if r.lora and r.lora.mode == "adapter" else "model")
    lines = ([f"dry run: would merge {what} {r.checkpoint} -> {r.out} (nothing written)"]
             if r.dry_run else [f"merged {what} {r.checkpoint} -> {r.out} in {r.seconds:.1f} s"])
    if r.distributed:
        d = r.distributed
        how = {"torchrun": "processes (torchrun)", "slices": "slices",
               "slice": "slices; this is slice"}[d.mode]
        which = f" {d.slice}" if d.mode == "slice" else ""
        lines.append(f"  shared by {d.processes} {how}{which}: "
                     f"{human_bytes(max(d.bytes))} at most each, balance "
                     f"{d.balance:.3f} (largest / mean)")
        if d.mode == "slice" and r.dry_run:
            lines[0] = (f"dry run: slice {d.slice}/{d.processes} of {r.checkpoint} -> "
                        f"{r.out} (nothing written); its tensors are listed below")
        elif d.mode == "slice":
            lines[0] = f"wrote slice {d.slice}/{d.processes} of {r.checkpoint} -> {r.out}"
            lines.append("  when every slice is done, run the same command with --finish "
                         "instead of --slice")
    if r.resumed and r.resumed.done_before:
        lines.append(f"  resumed a cut merge: {r.resumed.done_before} of "
                     f"{r.resumed.pieces} pieces were written already "
                     f"({human_bytes(r.resumed.bytes_skipped)} not written again)")
    if r.checkpoint != r.src:
        skipped = "".join(f"; skipped {Path(s.path).name} ({s.kind})" for s in r.skipped)
        lines.append(f"  used {Path(r.checkpoint).name}, found in {r.src}{skipped}")
    from ckpttool.core.runtime.report import storage_note

    note = storage_note(r.storage)
    if note:
        lines.append(f"  source: {r.format}, {note}")
    return lines


def _size_lines(r: MergeReport) -> list[str]:
    """The files written, counts, and bytes per dtype."""
    did = "would write" if r.dry_run else "wrote"
    lines: list[str] = []
    for f in r.files:
        tensors = f" ({count(f.tensors, 'tensor')})" if f.tensors else ""
        if f.final is not None:  # --slice: its share, in a temporary file --finish puts in place
            lines.append(f"  {did} {f.name}: {human_bytes(f.bytes)}{tensors}, its "
                         f"share of {f.final}")
        elif f.written_by is not None:  # --finish: the slices wrote it, the finish commits it
            how = ("was in place (an earlier --finish)" if f.placed_before
                   else "put in place")
            lines.append(f"  {how} {f.name}: {human_bytes(f.bytes)}{tensors}, written "
                         "by the slices")
        else:
            lines.append(f"  {did} {f.name}: {human_bytes(f.bytes)}{tensors}")
    whole = ("the whole merge: " if r.distributed and r.distributed.mode == "slice"
             and not r.dry_run else "")
    lines.append(f"  {whole}{count(r.num_tensors, 'tensor')}, {r.num_parameters:,} parameters, "
                 f"{human_bytes(r.total_bytes)}")
    before = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(r.bytes_before.items()))
    after = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(r.bytes_after.items()))
    if r.dtype.target:
        lines.append(f"  dtype {r.dtype.target} ({r.dtype.source}): {before} -> {after}")
    else:  # nothing cast: one figure (a tied copy written once is said on its own line)
        why = r.dtype.source.removesuffix(", dtypes kept")
        lines.append(f"  dtypes kept as stored ({why}): {before}")
    return lines


def _name_lines(r: MergeReport) -> list[str]:
    """Renames, the name map, where config.json came from, the hub layout."""
    lines: list[str] = []
    if r.renames and r.lora:
        lines.append(f"  renamed to the base model's names ({len(r.renames)} stored names; "
                     "PEFT's base_model.model. and .base_layer removed; all in --json)")
    elif r.renames and r.wrappers_removed:
        # One line says it: the renames differ only by the wrapper taken out.
        removed = ", ".join(f"'{w}'" for w in r.wrappers_removed)
        lines.append(f"  removed wrapper{'s' if len(r.wrappers_removed) > 1 else ''} "
                     f"{removed} from {count(len(r.renames), 'name')} (every rename is in "
                     "--json)")
    elif r.renames:
        lines.append(f"  renamed {count(len(r.renames), 'tensor')}:")
        shown = r.renames if len(r.renames) <= 8 else r.renames[:5]
        lines += [f"    {x.stored} -> {x.written}" for x in shown]
        if len(shown) < len(r.renames):
            lines.append(f"    ... and {len(r.renames) - len(shown)} more (every rename is in "
                         "--json)")
    if r.derived_config:
        d = r.derived_config
        lines.append(f"  config.json derived from Megatron's args: family {d.family} "
                     f"({d.why}); pass --config to use the model's own")
        lines += [f"    {note}" for note in d.notes]
    if r.name_map:
        counts = ", ".join(f"{n} {op}" for op, n in r.name_map.counts().items())
        lines.append(f"  names ({r.name_map.map}): {counts}")
        by_note: dict[str, list[str]] = {}
        for name, _, note in r.name_map.dropped:
            by_note.setdefault(note, []).append(name)
        for note, dropped in by_note.items():
            more = f" and {len(dropped) - 1} more" if len(dropped) > 1 else ""
            lines.append(f"    dropped {dropped[0]}{more}: {note}")
    if r.config and r.config.found_in:
        lines.append(f"  config.json from {r.config.found_in}: {r.config.path}")
    if r.layout:
        lay = r.layout
        lines.append(f"  layout of save_pretrained ({', '.join(lay.families)}): "
                     f"{len(lay.split)} fused tensors split into per-expert tensors, "
                     f"{len(lay.renamed)} renamed (--layout stored keeps them as stored)")
    return lines


def _tie_lines(r: MergeReport) -> list[str]:
    lines: list[str] = []
    if r.tie and r.tie.config_ties is not False:  # config.json unties them: nothing to say
        t = r.tie
        if t.action == "deduplicated":
            lines.append(f"  tied: {t.output} is identical to {t.input}; written once, "
                         "as transformers does")
        elif t.identical is None:
            lines.append(f"  tied: {t.output} / {t.input}: {t.action}")
        else:
            state = "identical" if t.identical else "different"
            lines.append(f"  tie candidates {t.output} / {t.input}: {state}; both written")
    return lines


def _rest_lines(r: MergeReport) -> list[str]:
    """Non-tensor entries, the parts left out, the side files copied, config changes."""
    lines: list[str] = []
    written = [o for o in r.non_tensor if o.part == r.kind]
    if r.kind == "optimizer" and written:
        lines.append(f"  {len(written)} non-tensor entries (param groups...) written to "
                     "optimizer.json")
    for c in r.left_out:
        size = f", {human_bytes(c.bytes)}" if c.num_tensors else ""
        held = ", ".join(x for x in (
            f"{count(c.num_tensors, 'tensor')}{size}" if c.num_tensors else "",
            f"{c.num_non_tensor:,} non-tensor entr{'y' if c.num_non_tensor == 1 else 'ies'}"
            if c.num_non_tensor else "") if x)
        where = f" in {c.file}" if c.file else ""
        how = (" (merge it with --part optimizer)" if c.part == "optimizer"
               and r.kind != "optimizer" and c.num_tensors else
               " (not recognised; check what it is with ckpttool inspect)"
               if c.part == "other" else "")
        lines.append(f"  left out {c.part}{where}: {held}; keys "
                     f"{', '.join(c.keys)}{how}")
    for o in written if r.kind == "model" else ():
        if o.readable:
            lines.append(f"  non-tensor entry {o.name} = {o.value!r} (not written)")
        else:
            lines.append(f"  non-tensor entry {o.name}: {o.note}")
    if r.copied:
        lines.append(f"  {'would copy' if r.dry_run else 'copied'} {', '.join(r.copied)}")
    for change in r.config_changes:
        lines.append(f"  config.json: {change}")
    return lines


def _verbose(r: MergeReport, phases: Phases) -> list[str]:
    """--verbose: what was read, the plan, the time each phase took."""
    note = ""
    from ckpttool.core.runtime.report import storage_note

    if storage_note(r.storage):
        note = f"; {storage_note(r.storage)}"
    lines = [f"read {r.checkpoint} ({r.format}{note})"]
    if r.copied:
        lines.append(f"side files: {', '.join(r.copied)}")
    lines.append(f"dtype: {r.dtype.source}")
    planned = ", ".join(f"{f.name} ({human_bytes(f.bytes)})" for f in r.files)
    lines.append(f"plan: {count(r.num_tensors, 'tensor')}, {human_bytes(r.total_bytes)} into "
                 f"{planned or 'nothing'}")
    if r.distributed:
        d = r.distributed
        lines.append(f"shared: {d.mode}, {d.processes} processes, "
                     f"{human_bytes(max(d.bytes))} at most each")
    lines.append(phases.line("writing", "a dry run: nothing written"))
    return lines


def _plan_table(rows: list[PlannedTensor]) -> str:
    """A dry run's tensors, one per line, as they would be written (names escaped)."""
    table = [["name", "shape", "dtype", "from", "size", "file"]]
    table += [[printable(t.name), "x".join(map(str, t.shape)) or "scalar", t.dtype,
               t.source_dtype, human_bytes(t.bytes), printable(t.file)] for t in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in table)


def _lora_lines(lo: LoraMerge) -> list[str]:
    done = (f"folded into {lo.fused} tensors" if lo.mode == "fuse"
            else "written for PEFT (adapter_model.safetensors)")
    lines = [f"  {lo.summary.line()}: {done}", f"  adapter config: {lo.summary.config}"]
    if lo.other:
        lines.append(f"  ({lo.other})")
    return lines


# merge's longer options, declared once here so that the command's signature stays a list
# (after the callbacks they name; the annotations are read when the app runs).
_LoraOption = Annotated[str | None, typer.Option(
        "--lora", metavar="[fuse|adapter]", callback=_lora_choice,
        autocompletion=completer(("fuse", "fold the adapter into the weights"),
                                 ("adapter", "write the adapter alone, for PEFT")),
        help="For a checkpoint with a LoRA adapter: fuse (fold W + scale * B @ A into the "
        "weights; the default when the base weights are there) or adapter (a PEFT adapter "
        "directory). alpha comes from adapter_config.json.")]

_AdapterOption = Annotated[Path | None, typer.Option(
        metavar="DIR", help="A PEFT adapter directory (adapter_model.safetensors + "
        "adapter_config.json) to fold into SRC, a model with full weights.")]

_AdapterConfigOption = Annotated[Path | None, typer.Option(
        metavar="PATH", help="PEFT's adapter_config.json (or its directory), where it is not "
        "beside the checkpoint or the adapter.")]

_PartOption = Annotated[str | None, typer.Option(
        "--part", metavar="PART", callback=_part_choice,
        autocompletion=completer(("model", "model.safetensors"),
                                 ("optimizer", "optimizer.safetensors + optimizer.json")),
        help="What to write of a checkpoint that holds more than the model (optimizer, lr "
        "scheduler, dataloader...): model (model.safetensors) or optimizer "
        "(optimizer.safetensors + optimizer.json). Default: the model; the rest is reported.")
    ]

_NamesOption = Annotated[str | None, typer.Option(
        callback=names_choice, metavar="MAP",
        autocompletion=completer(*((m, f"{m.split('-')[0]} names to Hugging Face's")
                                 for m in NAME_MAPS), ("none", "keep the stored names")),
        help=f"Map a training framework's names and "
        f"layouts to a Hugging Face model family's: {', '.join(NAME_MAPS)} (renames, RoPE "
        "permutation, "
        "fused wqkv and grouped-expert splits). Needs the model's config.json (--config). A "
        "Megatron-Core model gets its family's map (megatron-*) unasked; none keeps the "
        "stored names.")
    ]

_LayoutOption = Annotated[str, typer.Option(
        "--layout", metavar="[hub|stored]", callback=_layout_choice,
        autocompletion=completer(("hub", "what save_pretrained writes"),
                                 ("stored", "as stored (transformers 5's runtime names)")),
        help="hub: write what save_pretrained writes for config.json's model family "
        "(experts one tensor each, vision-language models' hub names), as every loader "
        "reads it; stored: transformers 5's runtime names and fused experts as stored.")
    ]


def _quantize_choice(value: str | None) -> str | None:
    if value is not None and value not in ("fp8-block",):
        raise typer.BadParameter(f"{value!r} is not a scheme ckpttool writes; use fp8-block")
    return value


_DequantizeOption = Annotated[bool, typer.Option(
        "--dequantize", help="Decode quantized weights (block FP8 as DeepSeek-V3 stores it, "
        "MXFP4 as gpt-oss does, compressed-tensors NVFP4 and FP8) to bf16 (or --dtype); "
        "quantization_config is dropped from config.json. See docs/quantization.md.")]

_QuantizeOption = Annotated[str | None, typer.Option(
        "--quantize", metavar="fp8-block", callback=_quantize_choice,
        help="Write the decoder layers' Linear weights as float8_e4m3fn per 128x128 block "
        "with float32 weight_scale_inv (data-free); embeddings, norms, router gates and "
        "lm_head are kept.")]

_QuantizeIgnoreOption = Annotated[list[str] | None, typer.Option(
        "--quantize-ignore", metavar="PATTERN",
        help="With --quantize: keep the modules PATTERN matches (transformers' "
        "modules_to_not_convert rule: a regex from the name's start, or its suffix); "
        "repeatable.")]
_NoCheckCrcOption = Annotated[bool, typer.Option(
        "--no-check-crc", help="Copy stored records without checking the CRC-32 each one "
        "carries (checked by default: a damaged record stops the merge with exit 3, naming "
        "the tensor, file and byte, and nothing is written).")]

_DryRunOption = Annotated[bool, typer.Option(
        "--dry-run", help="Show what would be written (files, sizes, every tensor's name, "
        "dtype and shape) after every check a merge makes, and write nothing: OUT is not "
        "created.")]

_SliceOption = Annotated[str | None, typer.Option(
        "--slice", metavar="I/N", help="Without a launcher (array jobs): write share I of N "
        "(0 <= I < N) into OUT's temporary files; then run once with --finish. Under torchrun "
        "the work is shared without it.")]

_FinishOption = Annotated[bool, typer.Option(
        "--finish", help="After every --slice I/N of this merge: check and put the output in "
        "place (same SRC, OUT and options).")]

_AllOption = Annotated[bool, typer.Option(
        "--all", help="SRC is a training run directory: merge every complete checkpoint in "
        "it (checkpoint-N/, global_stepN/, step-N/... whatever the format), in step order, "
        "each into OUT/<its name>/ with a receipt; those merged already are skipped.")
    ]

_StepsOption = Annotated[str | None, typer.Option(
        metavar="STEPS", autocompletion=completer(("latest", "the last complete checkpoint")),
        help="With --all: which checkpoints, by step: 1000-5000, 500,1500, "
        "'every 1000', latest, joined by commas.")]

_WatchOption = Annotated[bool, typer.Option(
        "--watch", help="With --all: keep going, merging each new checkpoint once it is "
        "complete, until Ctrl-C.")]

_PollOption = Annotated[float, typer.Option(
        metavar="SECONDS", min=0.0, help="With --watch: seconds between looks at RUN.")
    ]

_ThenOption = Annotated[str | None, typer.Option(
        metavar="CMD", help="With --all: a shell command to run after each merge, with "
        "CKPTTOOL_OUT, CKPTTOOL_SRC, CKPTTOOL_STEP and CKPTTOOL_NAME in its environment "
        "(write \"$CKPTTOOL_OUT\"; nothing is spliced into the command). A non-zero exit "
        "fails the checkpoint."
    )]

_TaskOption = Annotated[str | None, typer.Option(
        metavar="I/N", help="With --all: merge only task I's share of N (array jobs), "
        "balanced by bytes; every task computes the same shares.")]

_SettleOption = Annotated[float, typer.Option(
        metavar="SECONDS", min=0.0, help="With --all: a checkpoint whose files changed less "
        "than this long ago is still being written: --all waits until they have stayed "
        "unchanged this long, then merges it (--watch and --dry-run report it waiting).")]
