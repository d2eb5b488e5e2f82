"""``merge``: a checkpoint of any format to Hugging Face safetensors, as a list of steps.

Recognise the checkpoint (:mod:`~ckpttool.core.checkpoint.discover`), check it whole
(:mod:`~ckpttool.core.checkpoint.structure`), choose what is written (the part, a LoRA
adapter: :mod:`~ckpttool.core.transforms.lora`, a name map:
:mod:`~ckpttool.core.transforms.namemaps`, the dtype policy, the tie:
:mod:`~ckpttool.core.ties`), plan every byte (:mod:`~ckpttool.core.merge.plan`, pure), write
it (:mod:`~ckpttool.core.merge.engine`; shared between processes by
:mod:`~ckpttool.core.merge.multihost`) and report.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool import units
from ckpttool._gc import gc_paused
from ckpttool.core import contract, dtype_policy, quantization, ties
from ckpttool.core.checkpoint import architecture, hf, non_tensor, structure
from ckpttool.core.checkpoint.copies import model_copies
from ckpttool.core.checkpoint.discover import Checkpoint, discover, open_reader, select
from ckpttool.core.checkpoint.names import detected_wrappers
from ckpttool.core.checkpoint.parts import MERGEABLE
from ckpttool.core.dtype_policy import DTypePolicy
from ckpttool.core.merge import guards, megatron_buckets, megatron_optimizer, resume
from ckpttool.core.merge.checked import checked
from ckpttool.core.merge.engine import check_existing, commit_outputs, write
from ckpttool.core.merge.optimizer import OPTIMIZER_JSON, optimizer_json
from ckpttool.core.merge.options import (
    CastOptions,
    MergeOptions,
    ReadOptions,
    Shared,
    ShareOptions,
    WriteOptions,
)
from ckpttool.core.merge.plan import MergePlan, OutputFile, Source, plan_merge
from ckpttool.core.merge.report import (
    ConfigUsed,
    DTypeChoice,
    MergeReport,
    OtherCheckpoint,
    PlannedTensor,
    Rename,
)
from ckpttool.core.runtime import urls
from ckpttool.core.runtime.report import Progress
from ckpttool.core.runtime.torch_threads import default_workers
from ckpttool.core.transforms import hub_layout, maps, megatron_config, namemaps, quantize
from ckpttool.core.transforms.lora.layout import ADAPTER_FILE
from ckpttool.core.transforms.lora.plan import plan_for_merge
from ckpttool.core.transforms.lora.report import assumed_warning
from ckpttool.errors import InputError, UnsupportedError, UsageError
from ckpttool.formats import megatron, registry
from ckpttool.formats.base import Reader, UnreadableObject
from ckpttool.storage.outputs import check_apart, check_space
from ckpttool.storage.store import LOCAL, Stores

CONFIG_JSON = "config.json"  # written beside the weights when derived (megatron_config)

if TYPE_CHECKING:
    from ckpttool.core.merge.sharing import Sharing
    from ckpttool.core.transforms.lora.plan import Adapted
    from ckpttool.core.transforms.namemaps import Mapped


def merge(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: MergeOptions | None = None,
    *,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    config: str | os.PathLike[str] | None = None,
    keep_tied: bool = False,
    overwrite: bool = False,
    workers: int | None = None,
    follow_links: bool = False,
    lora: str | None = None,
    adapter: str | os.PathLike[str] | None = None,
    adapter_config: str | os.PathLike[str] | None = None,
    part: str | None = None,
    names: str | None = None,
    layout: str = "hub",
    dry_run: bool = False,
    shared: Shared | None = None,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    stores: Stores = LOCAL,
    iteration: int | None = None,
    weights_only: bool = False,
    lora_alpha: float | None = None,
    dequantize: bool = False,
    quantize: str | None = None,
    quantize_ignore: tuple[str, ...] = (),
    check_crc: bool = True,
) -> MergeReport:
    """Merge the checkpoint at ``src`` into Hugging Face safetensors in ``out``.

    Args:
        src: any checkpoint ckpttool reads (a DCP directory, per-rank files, safetensors, a
            torch.save file), or a training checkpoint directory holding one model.
        out: output directory (created if missing).
        options: every option below, in its group
            (:class:`~ckpttool.core.merge.options.MergeOptions`, as the CLI builds them once);
            the keywords are then left out. None: the keywords build them.
        dtype: ``auto`` (from config.json), ``keep``, ``bf16``, ``fp16`` or ``fp32``.
        max_shard_size: largest shard, e.g. ``"5GB"``; a single file if everything fits.
        config: a config.json (or its directory) to use instead of the one beside ``src``.
        keep_tied: write both copies of tied embeddings even when they are identical.
        overwrite: replace model weights already in ``out``.
        workers: parallel copy threads (default: the CPUs this process may use).
        follow_links: read data files that are links out of the checkpoint directory
            (shared-storage layouts); refused otherwise.
        lora: for a checkpoint holding a LoRA adapter: ``"fuse"`` (default when the base
            weights are there: fold ``W + scale * B @ A`` into a plain model) or ``"adapter"``
            (a PEFT adapter directory: ``adapter_model.safetensors`` + ``adapter_config.json``).
        adapter: a PEFT adapter (directory or ``adapter_model.safetensors``) to fold into
            ``src``, a model with full weights.
        adapter_config: PEFT's ``adapter_config.json`` (or its directory), where it is not
            beside the checkpoint or the adapter.
        part: what to write of a checkpoint that holds more than the model (optimizer,
            lr scheduler, dataloader...): ``"model"`` (model.safetensors) or ``"optimizer"``
            (optimizer.safetensors and optimizer.json). Default: the model, or the optimizer
            state of a checkpoint that holds nothing else. The rest is reported, not written.
        names: a name map (``namemaps.NAMES``, e.g. ``"torchtitan-llama3"``) from the
            training framework's names and layouts to the Hugging Face model family's.
            Default: the map a Megatron-Core model needs (``namemaps.implied``), else none;
            ``"none"`` keeps the stored names always.
        check_crc: check each stored record's CRC-32 as it is read or copied (a damaged
            record is an InputError naming the tensor, file and offset, nothing published);
            False skips it (``--no-check-crc``).
        iteration: of a Megatron-Core run directory, this iteration instead of the one
            ``latest_checkpointed_iteration.txt`` names.
        layout: ``"hub"`` (default): where config.json names a family whose transformers 5
            runtime layout differs from what ``save_pretrained`` writes (fused experts,
            nested vision-language models), write save_pretrained's; ``"stored"``: the names
            and fused tensors as stored.
        dry_run: plan the merge and report it (files, sizes, every tensor's name, dtype,
            shape and place: ``report.tensors``) without writing or creating anything. Every
            check a merge makes before writing is made (a tie is decided by reading both
            embeddings), except free space.
        shared: this process's part in a merge that several processes share
            (:mod:`ckpttool.core.merge.multihost`: a torchrun ``Team``, a ``Slice``, a ``Finish``);
            every process calls ``merge`` with the same arguments. None: this process alone.
        dequantize: decode quantized weights (block FP8, MXFP4, compressed-tensors NVFP4
            and FP8) to bf16 (or ``dtype``); quantization_config dropped
            (:mod:`ckpttool.core.transforms.quantize`).
        quantize: ``"fp8-block"``: the decoder layers' Linear weights to float8_e4m3fn per
            128 x 128 block with float32 ``weight_scale_inv`` (data-free).
        quantize_ignore: with ``quantize``, modules kept unquantized (transformers'
            ``modules_to_not_convert`` patterns).
        progress: called with bytes written, as the merge goes.
        on_start: called once with the total bytes to write, before any are written.
        weights_only: write the weights without the contract (:mod:`ckpttool.core.contract`)
            and without needing a config.json. Otherwise a model's merge needs a config, and
            its planned tensors are held against the model class the config names before
            anything is written.
        lora_alpha: a LoRA checkpoint's ``lora_alpha`` where no file records it (an
            adapter_config.json or verl's lora_train_meta.json records it otherwise; it is
            never guessed: without it such an adapter is neither folded nor written).

    Returns:
        A :class:`MergeReport`.

    Raises:
        InputError: ``src`` is not a readable checkpoint, or is damaged; no config.json (and
            no ``weights_only``); a tensor the config's model expects is missing or
            misshapen in the output (nothing is written).
        UnsupportedError: the checkpoint uses something ckpttool cannot merge yet.
        OutputError: ``out`` holds weights already (without ``overwrite``), or lacks space.
        UsageError: both ``options`` and keywords given.
    """
    keywords = MergeOptions(
        ReadOptions(config=config, part=part, iteration=iteration, lora=lora, adapter=adapter,
                    adapter_config=adapter_config, lora_alpha=lora_alpha,
                    follow_links=follow_links, check_crc=check_crc),
        CastOptions(dtype=dtype, names=names, layout=layout, keep_tied=keep_tied,
                    dequantize=dequantize, quantize=quantize, quantize_ignore=quantize_ignore),
        WriteOptions(max_shard_size=max_shard_size, overwrite=overwrite, dry_run=dry_run,
                     weights_only=weights_only),
        ShareOptions(workers=workers, shared=shared))
    if options is None:
        options = keywords
    elif keywords != MergeOptions():
        raise UsageError("merge() takes its options as MergeOptions or as keywords, not both")
    r = options.read
    return _located(src, out, options=options, config=r.config, adapter=r.adapter,
                    adapter_config=r.adapter_config, overwrite=options.write.overwrite,
                    shared=options.share.shared, stores=stores, progress=progress,
                    on_start=on_start)


@urls.urls(sources=("src",), output="out")
def _located(src: str | os.PathLike[str], out: str | os.PathLike[str], *,
             options: MergeOptions, config: str | os.PathLike[str] | None,
             adapter: str | os.PathLike[str] | None,
             adapter_config: str | os.PathLike[str] | None, overwrite: bool,
             shared: Shared | None, stores: Stores, progress: Progress | None,
             on_start: Callable[[int], None] | None) -> MergeReport:
    """The merge, once :func:`~ckpttool.core.runtime.urls.urls` has read and set what it
    needs by name: the local paths given (``config``, the adapter's) refused as URLs, an
    object-storage ``src`` seen through ``stores``, ``out`` claimed (``overwrite``) and
    staged, ``shared`` writing into it."""
    del config, adapter, adapter_config, overwrite  # read by the decorator, in options too
    if shared is not options.share.shared:
        options = replace(options, share=replace(options.share, shared=shared))
    return _merge(src, out, options, stores=stores, progress=progress, on_start=on_start)


def _merge(src: str | os.PathLike[str], out: str | os.PathLike[str], options: MergeOptions,
           *, stores: Stores, progress: Progress | None,
           on_start: Callable[[int], None] | None) -> MergeReport:
    """:func:`merge`'s steps: recognise, choose, plan, check, write, report."""
    started = time.perf_counter()
    read, cast, writing, share = options.read, options.cast, options.write, options.share
    src_path, out_path = Path(src), Path(out)
    shard_limit = units.parse_size(str(writing.max_shard_size))
    whole, ckpt = _recognise(src_path, out_path, read, cast.layout, stores)
    files, optimizer = ckpt.hf, ckpt.kind == "optimizer"
    named = [(t.name, t.tensor) for t in ckpt.tensors]
    if optimizer and megatron_buckets.holds(named):
        named = _unbucketed(ckpt, named, follow_links=read.follow_links)
    files, derived = _derived(ckpt, named, cast.names, files, optimizer=optimizer,
                              command=f"ckpttool merge {src} {out}")
    adapted = (None if optimizer else
               plan_for_merge(ckpt, named, read.lora, read.adapter, read.adapter_config,
                              lora_alpha=read.lora_alpha))
    mode = adapted.mode if adapted is not None else None
    policy, stem, files = _policy(cast.dtype, files, optimizer=optimizer, mode=mode)
    mapped = _mapped(cast.names, ckpt, named, files, optimizer=optimizer, adapted=adapted)
    sources: list[tuple[str, Source]] = (
        list(mapped.tensors) if mapped is not None
        else list(named) if adapted is None else adapted.sources)
    report = _start_report(src_path, out_path, whole, ckpt, policy, files, adapted, mapped,
                           model=not optimizer and mode != "adapter")
    report.derived_config = derived
    _require_config(src_path, out_path, ckpt, files, weights_only=writing.weights_only,
                    model=not optimizer and mode != "adapter")
    _fail_fast(out_path, files, optimizer=optimizer, mode=mode, derived=derived is not None,
               overwrite=writing.overwrite, stem=stem, shared=share.shared)
    with _readers(ckpt, adapted, follow_links=read.follow_links,
                  check_crc=read.check_crc) as reader:
        decide = functools.partial(_decide, reader, sources, files.config, report.warnings,
                                   keep_tied=cast.keep_tied,
                                   ties_apply=not optimizer and mode != "adapter", mapped=mapped)
        drop = _decided(report, decide() if share.shared is None else share.shared.once(decide))
        sources, drop = _output_layout(sources, drop, files, cast.layout,
                                       report, stored=mapped is None and mode != "adapter"
                                       and not optimizer)
        sources, files, policy, recoded = _recode(
            sources, files, policy, report, cast, plain=not optimizer and mode != "adapter")
        plan = plan_merge(sources, policy=policy,
                          max_shard_size=shard_limit if mode != "adapter" else 1 << 62,
                          drop=drop, stem=stem)
        extra = _side_files(report, whole, ckpt, reader, files, adapted, plan, sources,
                            recoded)
        pending = None
        if not optimizer and mode != "adapter":
            held = functools.partial(_contract, plan, files, report, out_path,
                                     weights_only=writing.weights_only)
            # Where it imports the consumer, beside the streaming, joined before publishing;
            # first where the output is written in resumable pieces (a broken contract
            # must leave none behind) or shared
            if (writing.dry_run or share.shared is not None or writing.weights_only
                    or resume.wanted(plan) or not contract.built_here(files.config)):
                report.contract = held()
            else:
                pending = contract.Beside(held)
        # A dry run stops here: the plan it reports is the one a merge would write.
        if not writing.dry_run:
            with (guards.before_publish(pending.wait) if pending is not None
                  else contextlib.nullcontext()):
                report.distributed, report.resumed = _write(
                    plan, reader, out_path, extra, stem, writing, share, progress=progress,
                    on_start=on_start)
        if pending is not None:
            report.contract = pending.join()
    _summarise(report, ckpt, plan, dict(extra).get(OPTIMIZER_JSON), dry_run=writing.dry_run,
               shared=share.shared)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def _require_config(src: Path, out: Path, ckpt: Checkpoint, files: hf.HfFiles, *,
                    weights_only: bool, model: bool) -> None:
    """A model's merge needs the config.json that names its consumer, unless asked for
    weights only."""
    if not model or weights_only or files.config is not None:
        return
    assert ckpt.info is not None
    raise InputError(hf.no_config_error(ckpt.info.root, src, out, stores=ckpt.stores))


def _contract(plan: MergePlan, files: hf.HfFiles, report: MergeReport, out: Path, *,
              weights_only: bool) -> contract.Contract:
    """The planned model held against the class config.json names, before anything is
    written (:mod:`ckpttool.core.contract`): a missing or misshapen tensor stops the merge."""
    if weights_only:
        return contract.skipped("--weights-only")
    planned = {t.name: t.slot.shape for f in plan.files for t in f.tensors}
    result = contract.check(planned, files.config)
    foreign = report.foreign_names
    step = ("Merge the checkpoint the config belongs to, pass the right --config, or "
            "--weights-only for weights without that promise")
    if foreign is not None and foreign.maps:  # a framework's own names: the map is the fix
        whose = f"{foreign.framework}'s" if foreign.framework else "a framework's"
        step = (f"{foreign.count} of {foreign.total} names are {whose} own: merge with "
                f"--names {' or '.join(foreign.maps)}; or " + step[0].lower() + step[1:])
    result.raise_if_broken(str(out), next_step=step)
    if not result.checked:
        report.warnings.append(result.not_checked(str(out)))
    elif result.extra:
        report.warnings.append(result.extra_message(str(out)))
    return result


def _unbucketed(ckpt: Checkpoint, named: list[tuple[str, Any]], *, follow_links: bool
                ) -> list[tuple[str, Any]]:
    """Megatron-Core's dp_reshardable optimizer buckets as per-parameter tensors
    (:mod:`ckpttool.core.merge.megatron_buckets`)."""
    assert ckpt.info is not None
    args = ckpt.info.values.get("args")
    with open_reader(ckpt, follow_links=follow_links) as reader:
        return list(megatron_buckets.unbucketed(
            megatron_buckets.model_tensors(ckpt.info.tensors), named,
            args if isinstance(args, dict) else None, reader))


def _derived(ckpt: Checkpoint, named: list[tuple[str, Any]], names: str | None,
             files: hf.HfFiles, *, optimizer: bool, command: str
             ) -> tuple[hf.HfFiles, megatron_config.DerivedConfig | None]:
    """Without a config.json, a Megatron-Core model's config derived from its args (the
    files with it), else the files as they are."""
    if files.config is not None or names == maps.KEEP:
        return files, None
    if optimizer:  # a Megatron-Core model's state is mapped as its weights are
        groups = megatron_optimizer.model_view(named)
        if groups is None:
            return files, None
        named = next(iter(groups.values()))
    derived = _derive_config(ckpt, named, names, command)
    return (files, None) if derived is None else (replace(files, config=derived.config),
                                                  derived)


def _recode(sources: list[tuple[str, Source]], files: hf.HfFiles, policy: DTypePolicy,
            report: MergeReport, cast: CastOptions, *, plain: bool
            ) -> tuple[list[tuple[str, Source]], hf.HfFiles, DTypePolicy, list[str]]:
    """``--dequantize`` or ``--quantize`` applied to ``sources``
    (:mod:`ckpttool.core.transforms.quantize`), config.json with them; the dtype policy
    keeping every scale of a quantized weight as stored; the config changes to report."""
    changes: list[str] = []
    if cast.dequantize or cast.quantize is not None:
        if not plain:
            raise UnsupportedError("--dequantize and --quantize apply to a model's weights, "
                                   "not to optimizer state or a LoRA adapter written apart")
        name = str(files.config_path) if files.config_path else "config.json"
        done = (quantize.dequantize(sources, files.config, target=policy.target,
                                    config_name=name) if cast.dequantize
                else quantize.quantize(sources, files.config, scheme=str(cast.quantize),
                                       ignore=cast.quantize_ignore))
        sources, changes = done.sources, done.changes
        report.warnings += done.warnings
        if files.config is not None:
            files = replace(files, config=done.config)
    keep = quantization.kept_names(((n, s.dtype) for n, s in sources), files.config)
    return sources, files, replace(policy, keep=keep), changes


def _fail_fast(out: Path, files: hf.HfFiles, *, optimizer: bool, mode: str | None,
               derived: bool, overwrite: bool, stem: str, shared: Shared | None) -> None:
    """Before reading any tensor data (the tie check reads both embeddings): OUT holds none
    of the files this merge writes, unless overwritten. A ``--finish`` knows which of them
    are its own and checks them itself."""
    if shared is not None and shared.commits_slices:
        return
    check_existing(out, [name for name, _ in files.named()] + (
        [OPTIMIZER_JSON] if optimizer else [hf.ADAPTER_CONFIG] if mode == "adapter" else [])
        + ([CONFIG_JSON] if derived else []), overwrite, stem)


def _decided(report: MergeReport, decided: dict[str, Any]) -> frozenset[str]:
    """What :func:`_decide` found (JSON, from whichever process decided), into ``report``;
    the names to leave out."""
    report.tie = None if decided["tie"] is None else ties.Tie(**decided["tie"])
    report.warnings = list(decided["warnings"])
    return frozenset(decided["drop"])


@contextlib.contextmanager
def _readers(ckpt: Checkpoint, adapted: Adapted | None, *, follow_links: bool,
             check_crc: bool = True) -> Iterator[Reader]:
    """The checkpoint's reader, with the adapter's own (``--adapter``) open beside it and
    closed with it. No cyclic collection while they live: millions of chunk objects are no
    garbage, and each collection would walk them all."""
    adapter_reader = adapted.reader if adapted is not None else None
    with (open_reader(ckpt, follow_links=follow_links) as reader,
          adapter_reader if adapter_reader is not None else contextlib.nullcontext(),
          gc_paused()):
        if adapter_reader is not None:
            adapter_reader.open_files()
        yield checked(reader, check_crc=check_crc)


def _decide(reader: Reader, sources: list[tuple[str, Source]], config: dict[str, Any] | None,
            warnings: list[str], *, keep_tied: bool, ties_apply: bool,
            mapped: Mapped | None) -> dict[str, Any]:
    """What reads tensor data before the plan (done once when processes share a merge): the
    tie, and the checks of stored copies and of what a name map drops."""
    # Chunks several ranks stored (use_collectives=False) must agree before one is used.
    structure.raise_first(reader.check_copies())
    tie = ties.decide(reader, sources, config, keep_tied) if ties_apply else ties.TieDecision()
    warnings = warnings + tie.warnings
    if mapped is not None:
        warnings += namemaps.check_dropped(reader, mapped)
    # JSON: sent to every process that shares the merge
    return {"drop": sorted(tie.drop), "tie": tie.tie.to_json() if tie.tie else None,
            "warnings": warnings}


def _write(plan: MergePlan, reader: Reader, out: Path, extra: list[tuple[str, bytes]],
           stem: str, write_options: WriteOptions, share: ShareOptions, *,
           progress: Progress | None, on_start: Callable[[int], None] | None
           ) -> tuple[Sharing | None, resume.Resumed | None]:
    """Write the plan: alone, this process's share of it, or in pieces that a cut merge
    leaves for the next run to finish (:mod:`ckpttool.core.merge.resume`). The report's
    ``distributed`` and ``resumed`` sections."""
    shared, overwrite, workers = share.shared, write_options.overwrite, share.workers
    if not getattr(shared, "remote", False):  # into object storage: about one part locally
        check_space(out, plan.file_bytes + sum(len(data) for _, data in extra))
    if shared is not None:  # this process writes its share (core.merge.multihost)
        return shared.write(plan, reader, out, extra, stem, write_options, share,
                            progress=progress, on_start=on_start), None
    if on_start is not None:
        on_start(plan.total_bytes)
    workers = workers or default_workers()
    if resume.wanted(plan):
        # Under the output's lock, OUT is looked at again: another run may have written it.
        return None, resume.write(
            plan, reader, out, workers=workers, progress=progress,
            check=lambda: check_existing(out, [name for name, _ in extra], overwrite, stem),
            commit=lambda outputs: commit_outputs(outputs, plan, extra, overwrite=overwrite,
                                                  stem=stem))
    write(plan, reader, out, extra, stem=stem, overwrite=overwrite, workers=workers,
          progress=progress)
    return None, None


def _recognise(src: Path, out: Path, read: ReadOptions, layout: str, stores: Stores
               ) -> tuple[Checkpoint, Checkpoint]:
    """The checkpoint at ``src`` (whole) and the part of it a merge writes, checked whole.

    Raises:
        InputError: not a checkpoint, damaged, only optimizer state where none was asked for,
            no tensors, or OUT inside SRC.
    """
    part = read.part
    if layout not in hub_layout.CHOICES:
        raise InputError(f"unknown layout {layout!r}; choose one of "
                         f"{', '.join(hub_layout.CHOICES)}")
    if part not in (None, *MERGEABLE):
        raise InputError(f"part {part!r} cannot be merged; choose one of {', '.join(MERGEABLE)}")
    ckpt = discover(src, config=read.config, command="merge", prefer=part, stores=stores,
                    iteration=read.iteration)
    if ckpt.chosen is not None and ckpt.kind == "optimizer" and part is None:
        raise InputError(
            f"{src}: holds only optimizer state ({ckpt.chosen}), no model checkpoint; to "
            f"merge the optimizer state, pass its directory: ckpttool merge "
            f"{src / ckpt.chosen} OUT")
    assert ckpt.info is not None  # discover(require=True) chose one
    info = ckpt.info
    refused = info.storage.get("unsupported_parts", {}).get(part or ckpt.kind)
    if refused:  # a part of a layout the format names but does not read
        raise UnsupportedError(refused)
    check_apart(out, src, info.root)
    structure.raise_first(structure.check(info, ckpt.canonical()))
    whole, ckpt = ckpt, select(ckpt, part or ckpt.kind)  # one part; the rest is reported
    given = whole.hf
    if read.config is not None and ckpt.hf.config is None and given.config is not None:
        # --config holds for any part: an optimizer's names are mapped as its model's
        ckpt = replace(ckpt, hf=hf.HfFiles(
            given.config, given.config_path,
            (given.config_path,) if given.config_path is not None else (),
            config_data=given.config_data))
    if not ckpt.tensors:
        # An empty model file is worse than an error: say what is there instead.
        held = f"only {len(ckpt.objects)} non-tensor entries" if ckpt.objects else "nothing"
        raise InputError(f"{info.root}: holds no tensors ({held}); there is no model to merge. "
                         f"See what it holds with: ckpttool inspect {src}")
    return whole, ckpt


def _policy(dtype: str, files: hf.HfFiles, *, optimizer: bool, mode: str | None
            ) -> tuple[DTypePolicy, str, hf.HfFiles]:
    """The dtype policy, the output file stem, and the side files that go with them."""
    if optimizer:
        # Optimizer state: keep its dtypes unless asked; no config, tokenizer or ties.
        return (DTypePolicy("auto", None, "optimizer state keeps its dtypes")
                if dtype == "auto" else dtype_policy.resolve(dtype, None)), "optimizer", files
    if mode == "adapter":
        # An adapter keeps the dtypes it trained in, as save_pretrained does, unless asked.
        policy = (DTypePolicy("auto", None, "a LoRA adapter keeps its dtypes")
                  if dtype == "auto" else dtype_policy.resolve(dtype, None))
        return (policy, ADAPTER_FILE.removesuffix(".safetensors"),
                hf.HfFiles(None, None, ()))
    policy = dtype_policy.resolve(dtype, files.config, str(files.config_path)
                                  if files.config_path else "config.json")
    return policy, "model", files


def _derive_config(ckpt: Checkpoint, named: list[tuple[str, Any]], names: str | None,
                   command: str) -> megatron_config.DerivedConfig | None:
    """A Megatron-Core model without a config.json: the config its args describe, where
    they name one family (else the error says which ``--config`` command to run); None for
    every other checkpoint."""
    if names is not None and not names.startswith("megatron-"):
        return None
    if not namemaps.is_megatron(named):
        return None
    assert ckpt.info is not None
    args = ckpt.info.values.get("args")
    if not isinstance(args, dict):
        for label, value in ckpt.info.values.items():
            if not isinstance(value, UnreadableObject):
                continue
            where = f"{ckpt.info.root}/{label}"
            code = megatron.runs_code(value)
            if code is not None:
                raise InputError(
                    f"{where}: refused to read the run's args: the pickle asks for '{code}', "
                    "which runs code; the file may be malicious (nothing was executed)")
            raise UnsupportedError(
                f"{where}: the run's args are there but not read ({value.why}), so no "
                f"config.json can be derived; pass the model's config.json: {command} "
                "--config path/to/config.json")
    return megatron_config.derive(args if isinstance(args, dict) else None, command=command)


def _mapped(names: str | None, ckpt: Checkpoint, named: list[tuple[str, Any]],
            files: hf.HfFiles, *, optimizer: bool, adapted: Adapted | None) -> Mapped | None:
    """``--names`` applied to the model's tensors (None without it, or with ``"none"``); a
    Megatron-Core model's family map applies unasked, as its names are no loader's."""
    config_path = str(files.config_path) if files.config_path else None
    asked = names is not None
    if names is None and adapted is None:
        names = (megatron_optimizer.implied if optimizer else namemaps.implied)(
            named, files.config, config_path=config_path)
    if names is None or names == maps.KEEP:
        return None
    assert ckpt.info is not None
    if optimizer and (state := megatron_optimizer.apply(names, named, files.config,
                                                        config_path=config_path, asked=asked)):
        return state
    if optimizer:
        raise InputError(f"{ckpt.info.root}: holds optimizer state; --names maps a model's "
                         "weights: pass the model checkpoint")
    if adapted is not None:
        raise UnsupportedError(f"{ckpt.info.root}: --names with a LoRA adapter is not supported "
                               "yet; merge without the adapter, or without --names")
    return namemaps.apply(names, named, files.config, config_path=config_path, asked=asked)


def _start_report(src: Path, out: Path, whole: Checkpoint, ckpt: Checkpoint,
                  policy: DTypePolicy, files: hf.HfFiles, adapted: Adapted | None,
                  mapped: Mapped | None, *, model: bool) -> MergeReport:
    """What is known before any data is read: the source, its parts, renames, the dtype."""
    assert ckpt.info is not None
    info = ckpt.info
    report = MergeReport(src=str(src), checkpoint=str(info.root), out=str(out),
                         kind=ckpt.kind, format=info.format, storage=dict(info.storage),
                         part=ckpt.kind)
    report.contents = whole.contents()
    report.left_out = [c for c in report.contents if c.part != ckpt.kind or c.file]
    report.parts = list(ckpt.parts)
    report.skipped = [OtherCheckpoint(str(src / p.path), p.kind) for p in ckpt.parts
                      if p.path != ckpt.chosen and p.kind != "other"
                      and registry.is_format(p.format)]
    renamed = [t for t in ckpt.tensors if t.name != t.stored_name]
    report.renames = [Rename(t.stored_name, t.name) for t in renamed]
    report.wrappers_removed = detected_wrappers((t.path for t in renamed), ckpt.top_level)
    report.dtype = DTypeChoice(policy.requested, policy.target.name if policy.target else None,
                               policy.source)
    if model:
        if files.config_path is not None:
            report.config = ConfigUsed(str(files.config_path), files.found_in)
        elif files.config is None:  # (a config derived from Megatron's args has no path)
            report.warnings.append(hf.no_config_warning(
                info.root, ckpt.path, cast_to=policy.target.name if policy.target else None,
                stores=ckpt.stores))
    copies = model_copies(whole)
    if copies is not None:
        report.copies = copies
        report.warnings.append(copies.message("merge"))
    if adapted is not None:
        report.lora = adapted.report
        if adapted.report.assumed:
            report.warnings.append(assumed_warning(adapted.report))
    report.name_map = mapped
    return report


def _output_layout(sources: list[tuple[str, Source]], drop: frozenset[str], files: hf.HfFiles,
                   layout: str, report: MergeReport, *, stored: bool
                   ) -> tuple[list[tuple[str, Source]], frozenset[str]]:
    """``sources`` in the layout save_pretrained writes for config.json's family
    (:mod:`ckpttool.core.transforms.hub_layout`), the tied weight left out renamed alike, and
    a warning for names no model of that architecture has. ``stored``: the model's weights
    under their stored names (no name map, no adapter), the only case this applies to."""
    if not stored:
        return sources, drop
    if layout != "stored":
        converted = hub_layout.convert(sources, files.config)
        if converted is None:
            report.warnings += hub_layout.unconverted(sources, files.config)
        else:
            report.layout = converted
            sources = converted.sources
            drop = frozenset(converted.renamed.get(n, n) for n in drop)
    foreign = architecture.check([n for n, _ in sources], files.config)
    if foreign is not None:
        report.foreign_names = foreign
        report.warnings.append(foreign.message())
    return sources, drop


def _side_files(report: MergeReport, whole: Checkpoint, ckpt: Checkpoint, reader: Reader,
                files: hf.HfFiles, adapted: Adapted | None, plan: MergePlan,
                sources: list[tuple[str, Source]], recoded: list[str] | None = None
                ) -> list[tuple[str, bytes]]:
    """The small files written beside the weights (config, tokenizer, optimizer.json, an
    adapter's config), and the non-tensor entries, into ``report``."""
    objects = [(o, non_tensor.read(reader, o.entry)) for o in whole.objects]
    report.non_tensor = [non_tensor.describe(o.name, value, part=o.part) for o, value in objects]
    objects = [(o, value) for o, value in objects if o.part == ckpt.kind]
    mapped = report.name_map
    nextn = (mapped.mtp_layers if mapped is not None and maps.MAPS[mapped.map].mtp_required
             else None)
    config_bytes, report.config_changes = _config_output(files, plan, sources, nextn=nextn,
                                                         recoded=recoded or [])
    extra: list[tuple[str, bytes]] = [
        (name, config_bytes if p == files.config_path and config_bytes is not None
         else files.read(p)) for name, p in files.named()]
    report.copied = [name for name, _ in files.named()]
    report.warnings += list(files.skipped)
    if report.derived_config is not None and files.config is not None:
        extra.append((CONFIG_JSON, config_bytes if config_bytes is not None else
                      (json.dumps(files.config, indent=2) + "\n").encode()))
    if ckpt.kind == "optimizer":
        extra.append((OPTIMIZER_JSON, optimizer_json(objects, ckpt.top_level)))
    if adapted is not None and adapted.mode == "adapter":
        extra.append((hf.ADAPTER_CONFIG, adapted.config_bytes))
        report.copied.append(hf.ADAPTER_CONFIG)
    return extra


def _summarise(report: MergeReport, ckpt: Checkpoint, plan: MergePlan,
               optimizer_json: bytes | None, *, dry_run: bool, shared: Shared | None) -> None:
    """Files, counts and bytes per dtype before and after, into ``report``; a dry run's
    every tensor as it would be written."""
    report.files = [OutputFile(f.name, f.size, len(f.tensors)) for f in plan.files]
    if plan.index is not None:
        report.files.append(OutputFile(plan.index_name, len(plan.index), 0))
    if optimizer_json is not None:
        report.files.append(OutputFile(OPTIMIZER_JSON, len(optimizer_json), 0))
    written_tensors = [t for f in plan.files for t in f.tensors]
    report.num_tensors = len(written_tensors)
    report.num_parameters = sum(t.source.numel for t in written_tensors)
    report.total_bytes = plan.total_bytes
    for entry in ckpt.tensors:
        name = entry.dtype.name
        report.bytes_before[name] = report.bytes_before.get(name, 0) + entry.nbytes
    for out_tensor in written_tensors:
        name = out_tensor.dtype.name
        report.bytes_after[name] = report.bytes_after.get(name, 0) + out_tensor.slot.nbytes
    _shared_files(report)
    if dry_run:
        report.dry_run = True
        # Shared (--slice I/N, torchrun): the sharing and this process's tensors only.
        share = shared.preview(plan) if shared is not None else None
        mine = set(share.tensors or ()) if share is not None else None
        if share is not None:
            share.tensors = None
        report.distributed = share
        report.tensors = [PlannedTensor(t.name, f.name, t.dtype.name, t.source.dtype.name,
                                        list(t.slot.shape), t.slot.nbytes,
                                        [t.slot.begin, t.slot.end])
                          for f in plan.files for t in f.tensors
                          if mine is None or t.name in mine]


def _shared_files(report: MergeReport) -> None:
    """A slice (``--slice I/N``) put nothing in place: its report names the temporary files it
    wrote into and its marker, and no copied side file. ``--finish`` put in place weights the
    slices wrote: said so per file (``written_by``); the index and side files are its own."""
    d = report.distributed
    if d is None:
        return
    if d.files is not None:
        report.files, report.copied, report.config_changes = d.files, [], []
        d.files = None
    for f in report.files:
        if f.name in (d.committed or ()):
            f.written_by = "slices"
        elif f.name in (d.placed_before or ()):
            f.written_by = "slices"
            f.placed_before = True


def _config_output(files: hf.HfFiles, plan: MergePlan, sources: list[tuple[str, Source]],
                   *, nextn: int | None = None, recoded: list[str] | None = None
                   ) -> tuple[bytes | None, list[str]]:
    """config.json as written beside the weights: the FSDP class prefix removed, the dtype
    the weights are written in (that of the first floating tensor in model order, as
    ``save_pretrained`` records ``model.dtype``), and ``num_nextn_predict_layers`` = ``nextn``,
    the multi-token prediction layers written (DeepSeek-V3; None: left as it is)."""
    if files.config is None:
        return None, []
    fixed, changes = hf.strip_fsdp_prefix(files.config)
    changes = [f"architectures: {c}" for c in changes] + list(recoded or ())
    key = "num_nextn_predict_layers"
    if nextn is not None and fixed.get(key, 0) != nextn:
        changes.append(f"{key}: {fixed.get(key)} -> {nextn} (the multi-token prediction "
                       "layers written)")
        fixed = {**fixed, key: nextn}
    written = {t.name: t.dtype for f in plan.files for t in f.tensors}
    # The scales of quantized weights (float32 whatever the model's dtype) say nothing of it;
    # a floating weight does before a float8 one.
    scales = quantization.kept_names(written.items(), fixed)
    first = next((written[n] for n, _ in sources
                  if n in written and n not in scales and written[n].kind == "float"), None)
    first = first or next((written[n] for n, _ in sources
                           if n in written and written[n].kind == "float8"), None)
    fixed, dtype_changes = hf.with_written_dtype(fixed, first.torch_name if first else None)
    changes += dtype_changes
    if not changes:
        return None, []
    return (json.dumps(fixed, indent=2) + "\n").encode(), changes
