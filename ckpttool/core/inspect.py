"""``inspect``: what is in a checkpoint of any supported format, from metadata and headers.

:func:`~ckpttool.core.checkpoint.discover.discover` recognises the path and describes it the same
way for
every format; this module summarises that description (counts, bytes per dtype, what a merge
would write, placements) without reading tensor data. ``--stats`` streams the data
(:class:`~ckpttool.core.values.Stats`, the only part that imports torch).
"""

from __future__ import annotations

import fnmatch
import os
import time
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ckpttool._gc import gc_paused
from ckpttool.core import dtype_policy, quantization, ties
from ckpttool.core.checkpoint import hf, names, non_tensor
from ckpttool.core.checkpoint.copies import model_copies
from ckpttool.core.checkpoint.discover import (
    Box,
    Checkpoint,
    Part,
    TensorView,
    discover,
    open_reader,
    select,
)
from ckpttool.core.checkpoint.parts import Content
from ckpttool.core.checkpoint.tensors import blocks
from ckpttool.core.runtime import urls
from ckpttool.core.runtime.report import Progress, Section, document, locked, section
from ckpttool.core.runtime.torch_threads import default_workers, one_torch_thread, workers_for
from ckpttool.core.transforms.lora.layout import adapter_of, parse
from ckpttool.core.transforms.lora.report import AdapterSummary, describe
from ckpttool.core.values import Stats, TensorStats
from ckpttool.errors import CkptError, InputError
from ckpttool.formats.base import ChunkColumns, Reader, Tensor
from ckpttool.storage.store import LOCAL, Stores

# Problem codes meaning the metadata itself could not be read: inspect stops on them.
_UNREADABLE_METADATA = frozenset({"header-corrupt", "missing-file"})


# --------------------------------------------------------------------------------------------
# Pure descriptions


def placement(shape: tuple[int, ...], boxes: tuple[Box, ...]) -> str:
    """How the pieces split the tensor: ``whole``, ``Shard(0) x4``, ``Shard(0)+Shard(1) x4``,
    ``none`` when nothing is stored."""
    if not boxes:
        return "none"
    if len(boxes) == 1 and boxes[0][1] == shape:
        return "whole"
    split = sorted({d for _, sizes in boxes for d, (s, n) in enumerate(zip(sizes, shape,
                                                                          strict=False))
                    if s != n})
    if not split:
        return f"Replicate x{len(boxes)}"
    return "+".join(f"Shard({d})" for d in split) + f" x{len(boxes)}"


def tensor_placement(t: TensorView) -> str:
    """:func:`placement` of ``t``'s chunks; from their columns where the format keeps them so
    (a million chunks cost a C-level pass per dimension, and no box is built)."""
    chunks = t.tensor.chunks
    if not isinstance(chunks, ChunkColumns) or chunks.ndim != len(t.shape) or not chunks:
        return placement(t.shape, t.boxes)
    n = len(chunks)
    split = [d for d, size in enumerate(t.shape) if not _all(chunks.column(chunks.ndim + d), size)]
    if not split:
        return "whole" if n == 1 else f"Replicate x{n}"
    return "+".join(f"Shard({d})" for d in split) + f" x{n}"


def _all(column: array[int], value: int) -> bool:
    """Whether every item of ``column`` is ``value``: arrays of one type compare by their
    bytes (``count`` makes an int of each item: 3M of them for 15,000 tensors)."""
    try:
        return column == array(column.typecode, (value,)) * len(column)
    except OverflowError:  # no item of this type holds it
        return False


@section
class MergedSize(Section):
    """What ``merge --dtype auto`` would write: the dtype and why, the bytes (per dtype), and
    the tied copy it would leave out (None: none)."""

    dtype: str | None
    dtype_source: str
    bytes: int
    bytes_per_dtype: dict[str, int]
    deduplicated: str | None


@section
class Summary(Section):
    """``inspect``'s summary: counts, bytes per dtype, the size a merge would write, wrapper
    segments, the tied pair, how it is stored, the config used and a LoRA adapter found."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"lora", "quantization"})

    kind: str
    num_ranks: int | None
    num_files: int
    num_tensors: int
    num_parameters: int
    bytes: int
    bytes_per_dtype: dict[str, int]
    merged: MergedSize
    wrappers: list[str]
    num_renamed: int
    tie: ties.TiePair | None
    num_non_tensor: int
    storage: dict[str, Any]  # CheckpointInfo.storage
    config: str | None
    lora: AdapterSummary | None = None
    # The quantization scheme (core.quantization); None: no quantized weight
    quantization: quantization.QuantizationSummary | None = None


def summary(ckpt: Checkpoint) -> Summary:
    """The summary block of ``inspect``: counts, bytes per dtype, the size ``merge --dtype
    auto`` would write, wrappers, tie candidates. Pure."""
    per_dtype: dict[str, int] = {}
    for t in ckpt.tensors:
        per_dtype[t.dtype.name] = per_dtype.get(t.dtype.name, 0) + t.nbytes
    config_name = str(ckpt.hf.config_path) if ckpt.hf.config_path else "config.json"
    policy = (dtype_policy.DTypePolicy("auto", None, "optimizer state keeps its dtypes")
              if ckpt.kind == "optimizer" else dtype_policy.resolve("auto", ckpt.hf.config,
                                                                     config_name))
    written = _written(ckpt)
    stored = {t.name: (t.dtype, tuple(t.shape)) for t in ckpt.tensors}
    # The scales of quantized weights are kept as stored by every dtype policy.
    policy = replace(policy, keep=quantization.kept_names(
        ((n, d) for n, (d, _) in stored.items()), ckpt.hf.config))
    pair = ties.find_pair(dict(written)) if ckpt.kind == "model" else None
    config_ties = hf.ties_word_embeddings(ckpt.hf.config)
    dropped = pair[0] if pair is not None and config_ties else None
    merged: dict[str, int] = {}
    for name, entry in written:
        if name == dropped:
            continue
        out = policy.output_dtype(entry.dtype, name)
        merged[out.name] = merged.get(out.name, 0) + entry.numel * out.itemsize
    assert ckpt.info is not None
    return Summary(
        kind=ckpt.kind,
        num_ranks=ckpt.info.num_ranks,
        num_files=len(ckpt.info.files),
        num_tensors=len(ckpt.tensors),
        num_parameters=sum(t.numel for t in ckpt.tensors),
        bytes=sum(t.nbytes for t in ckpt.tensors),
        bytes_per_dtype=dict(sorted(per_dtype.items())),
        merged=MergedSize(policy.target.name if policy.target else None, policy.source,
                          sum(merged.values()), dict(sorted(merged.items())), dropped),
        wrappers=names.detected_wrappers(t.path for t in ckpt.tensors),
        num_renamed=sum(1 for t in ckpt.tensors if t.name != t.stored_name),
        tie=None if pair is None else ties.TiePair(pair[0], pair[1], config_ties),
        num_non_tensor=len(ckpt.objects),
        storage=dict(ckpt.info.storage),
        config=str(ckpt.hf.config_path) if ckpt.hf.config_path else None,
        quantization=quantization.summarise(ckpt.hf.config, stored)
        if ckpt.kind == "model" else None,
    )


def _written(ckpt: Checkpoint) -> list[tuple[str, Tensor]]:
    """The tensors a default merge writes: all of them, or for a LoRA checkpoint the base
    model's weights (the adapter folded in, trained copies of modules_to_save used)."""
    entries = [(t.name, t.tensor) for t in ckpt.tensors if t.part == ckpt.kind]
    if ckpt.kind != "model":
        return entries
    try:
        layout = parse(entries)
    except CkptError:  # reported by verify and merge
        return entries
    if layout is None or not layout.has_base:
        return entries
    return [(name, layout.trained.get(name, t)) for name, t in layout.base]


@section
class TensorRow(Section):
    """A row of ``inspect``'s table: a tensor's names, part, shape, dtype, bytes, chunks,
    placement, data files and (``--stats``) its values' statistics."""

    name: str
    stored_name: str
    part: str
    shape: list[int]
    dtype: str
    bytes: int
    chunks: int
    placement: str
    files: list[str]
    stats: TensorStats | None = None

    def to_json(self) -> dict[str, Any]:
        # The fields written out: one row per tensor (15,000 in a MoE checkpoint), where
        # Section's walk over dataclasses.fields costs 5x. The same document
        # (test_inspect_report pins it against Section.to_json).
        stats = self.stats
        return {"name": self.name, "stored_name": self.stored_name, "part": self.part,
                "shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes,
                "chunks": self.chunks, "placement": self.placement, "files": list(self.files),
                "stats": None if stats is None else stats.to_json()}


def tensor_row(t: TensorView) -> TensorRow:
    return TensorRow(t.name, t.stored_name, t.part, list(t.shape), t.dtype.name, t.nbytes,
                     len(t.tensor.chunks), tensor_placement(t), list(t.files))


def matches(t: TensorView, pattern: str | None) -> bool:
    """``--filter``: a glob on the canonical or the stored name."""
    return pattern is None or fnmatch.fnmatchcase(t.name, pattern) or fnmatch.fnmatchcase(
        t.stored_name, pattern)


# --------------------------------------------------------------------------------------------
# Non-tensor entries


def describe_objects(ckpt: Checkpoint, reader: Reader) -> list[non_tensor.Entry]:
    """Each non-tensor entry as ``merge`` reports it (:class:`non_tensor.Entry`). Reads object
    records (small), never a tensor."""
    out = []
    for o in ckpt.objects:
        try:
            out.append(non_tensor.describe(o.name, non_tensor.read(reader, o.entry),
                                           part=o.part))
        except InputError as e:
            out.append(non_tensor.Entry(o.name, False, note=f"unreadable: {e}", part=o.part))
    return out


# --------------------------------------------------------------------------------------------
# The operation


@dataclass
class InspectReport:
    """What ``inspect`` found, for people (CLI) and programs (``to_json``)."""

    path: str
    checkpoint: str
    format: str
    kind: str
    parts: list[Part] = field(default_factory=list)
    contents: list[Content] = field(default_factory=list)  # model, optimizer, ...
    summary: Summary | None = None  # None: no checkpoint recognised (parts only)
    tensors: list[TensorRow] = field(default_factory=list)  # the --filter'ed table
    non_tensor: list[non_tensor.Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    filter: str | None = None
    stats: bool = False
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        with gc_paused():  # a dict per tensor, none of them garbage (see inspect())
            doc = document("inspect", self)
        if self.summary is None:
            doc["summary"] = {}
        return doc


@urls.urls(sources=("path",))
def inspect(
    path: str | os.PathLike[str],
    *,
    filter: str | None = None,
    stats: bool = False,
    config: str | os.PathLike[str] | None = None,
    follow_links: bool = False,
    workers: int | None = None,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    stores: Stores = LOCAL,
    iteration: int | None = None,
) -> InspectReport:
    """Describe the checkpoint at ``path`` from its metadata (and, with ``stats``, its data).

    Args:
        path: any supported checkpoint (see :func:`open_checkpoint`).
        filter: a glob on tensor names; narrows the table (and the tensors ``stats`` reads).
        stats: stream the data and add min, max, mean, abs-max, NaN and Inf counts per tensor.
        config: config.json (or its directory) instead of the one beside the checkpoint.
        iteration: of a Megatron-Core run directory, this iteration instead of the one
            ``latest_checkpointed_iteration.txt`` names.
        follow_links: read data files that are links out of the checkpoint directory.
        workers: with ``stats``, tensors read in parallel (default: the CPUs this process
            may use).
        progress: called with bytes read (``stats`` only).
        on_start: called once with the bytes ``stats`` will read.

    Returns:
        An :class:`InspectReport`.

    Raises:
        InputError: ``path`` is not a readable checkpoint.
        UnsupportedError: a format or layout ckpttool does not read yet.
    """
    started = time.perf_counter()
    # The description and the report hold a few objects per tensor and make no garbage cycles:
    # the collector would walk them again and again as they are made (15,000 tensors: 0.2 s).
    # Reading values (``stats``) runs with it as usual.
    with gc_paused():
        report, ckpt, shown = _describe(path, filter=filter, stats=stats, config=config,
                                        stores=stores, iteration=iteration)
    if ckpt is None or ckpt.info is None:
        report.seconds = round(time.perf_counter() - started, 3)
        return report
    with open_reader(ckpt, follow_links=follow_links) as reader:
        report.non_tensor = describe_objects(ckpt, reader)
        if stats:
            if on_start is not None:
                on_start(sum(t.nbytes for t in shown))
            for row, result in zip(report.tensors, _stats(reader, shown, workers, progress),
                                   strict=True):
                row.stats = result
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def _describe(path: str | os.PathLike[str], *, filter: str | None, stats: bool,
              config: str | os.PathLike[str] | None, stores: Stores, iteration: int | None
              ) -> tuple[InspectReport, Checkpoint | None, list[TensorView]]:
    """:func:`inspect` but the values and non-tensor entries: the report, the checkpoint
    (None: none recognised) and the tensors its table shows."""
    ckpt = discover(path, config=config, require=False, stores=stores, iteration=iteration)
    report = InspectReport(path=str(ckpt.path), checkpoint=str(ckpt.root), format=ckpt.format,
                           kind=ckpt.kind, filter=filter, stats=stats)
    report.parts = list(ckpt.parts)
    report.notes = [ckpt.note] if ckpt.note else []
    if ckpt.info is None:
        return report, None, []
    report.summary = summary(ckpt)
    report.contents = ckpt.contents()
    report.notes += list(ckpt.side_notes)
    copies = model_copies(ckpt)
    if copies is not None:
        report.notes.append(copies.message("inspect"))
    report.notes += [p.message for p in ckpt.info.problems if p.code == "tensors-unplaced"]
    layout, adapter_config, lora_problems = adapter_of(
        select(ckpt, ckpt.kind) if ckpt.has_part(ckpt.kind) else ckpt)
    if layout is not None and layout.modules:
        report.summary.lora = describe(layout, adapter_config)
        report.notes += [p.message for p in lora_problems]
    shown = [t for t in ckpt.tensors if matches(t, filter)]
    report.tensors = [tensor_row(t) for t in shown]
    info = ckpt.info
    missing = [f.name for f in info.files if f.size is None]
    if missing:
        report.notes.append(f"{len(missing)} data files are missing ({', '.join(missing[:3])}"
                            f"{'...' if len(missing) > 3 else ''}); run ckpttool verify "
                            f"{ckpt.path}")
    # Headers that cannot be read are the metadata itself (a safetensors shard): cannot go on.
    for p in info.problems:
        if p.code in _UNREADABLE_METADATA:
            raise InputError(f"{p.message}; ckpttool verify {ckpt.path} lists every problem")
    return report, ckpt, shown


def _stats(reader: Reader, shown: list[TensorView], workers: int | None,
           progress: Progress | None) -> list[TensorStats]:
    """Each tensor's statistics, tensors read in ``workers`` threads."""
    report = locked(progress)

    def one(t: TensorView) -> TensorStats:
        acc = Stats(t.dtype, full=True)
        for _, data in blocks(reader, t.tensor):
            acc.update(data)
            report(len(data))
        return acc.result()

    n = workers_for(workers or default_workers(), nbytes=sum(t.nbytes for t in shown),
                    chunks=sum(len(t.tensor.chunks) for t in shown))
    with one_torch_thread():
        if n <= 1:
            return [one(t) for t in shown]
        with ThreadPoolExecutor(max_workers=n) as pool:
            return list(pool.map(one, shown))
