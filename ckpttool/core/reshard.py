"""``reshard``: change how a checkpoint is split.

* to DCP on M ranks, laid out as FSDP2 saves it: each tensor split on dim 0 the way
  ``fully_shard`` splits it (``torch.chunk``: pieces of ceil(n / M) rows, trailing ranks
  possibly empty), one ``__<rank>_0.distcp`` per rank; tensors stored whole in the source
  (buffers, replicated tensors, scalars) stay whole, on the least-loaded rank;
* from full weights (safetensors) to DCP, optionally under accelerate's ``model`` key;
* safetensors to safetensors with new shard sizes, byte for byte.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.core import source as locate
from ckpttool.core import tensors as sources
from ckpttool.core.fileio import (
    AtomicOutputs,
    check_space,
    copy_range,
    existing_outputs,
    pwrite_all,
    remove_stale,
)
from ckpttool.errors import InputError, OutputError
from ckpttool.formats import dcp
from ckpttool.formats import safetensors as st
from ckpttool.formats.dcp_writer import DcpWriter

SCHEMA = 1
Progress = Callable[[int], None]


@dataclass(frozen=True)
class PlannedChunk:
    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int  # first element in the C-ordered full tensor
    stop: int


def plan_chunks(shapes: list[tuple[tuple[int, ...], int, bool]], num_ranks: int
                ) -> list[list[PlannedChunk]]:
    """Chunks per tensor for an FSDP2-style layout on ``num_ranks``. Pure.

    Args:
        shapes: per tensor, (shape, item size, keep whole).
    """
    if num_ranks < 1:
        raise InputError(f"--ranks must be at least 1, got {num_ranks}")
    load = [0] * num_ranks
    out: list[list[PlannedChunk]] = []
    for shape, itemsize, whole in shapes:
        numel = 1
        for s in shape:
            numel *= s
        if whole or not shape or shape[0] == 0:
            rank = min(range(num_ranks), key=lambda r: load[r])
            load[rank] += numel * itemsize
            out.append([PlannedChunk(rank, (0,) * len(shape), tuple(shape), 0, numel)])
            continue
        rows = shape[0]
        row = numel // rows
        per = -(-rows // num_ranks)
        pieces = []
        for rank in range(num_ranks):
            first = rank * per
            if first >= rows:
                break
            n = min(per, rows - first)
            pieces.append(PlannedChunk(rank, (first,) + (0,) * (len(shape) - 1),
                                       (n, *shape[1:]), first * row, (first + n) * row))
            load[rank] += n * row * itemsize
        out.append(pieces)
    return out


@dataclass
class ReshardReport:
    src: str
    out: str
    format_in: str
    format_out: str
    ranks: int | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    num_tensors: int = 0
    num_objects: int = 0
    total_bytes: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "command": "reshard", **self.__dict__}


def reshard(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    ranks: int | None = None,
    to: str | None = None,
    prefix: str | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
) -> ReshardReport:
    """Rewrite the checkpoint at ``src`` into ``out`` with another split.

    Args:
        src: a DCP directory, a safetensors file, or a safetensors model directory.
        out: output directory.
        ranks: number of ranks of the DCP output (default: 1 from full weights; required for
            DCP to DCP).
        to: ``dcp`` or ``safetensors``; default: ``dcp``.
        prefix: with DCP output from full weights, nest tensors under this key (accelerate's
            ``model``), so the result loads with ``load_fsdp_model``.
        max_shard_size: with safetensors output, the largest shard.
        overwrite: replace a checkpoint already in ``out``.

    Raises:
        InputError, UnsupportedError, OutputError: as for ``merge``.
    """
    started = time.perf_counter()
    src_path, out_path = Path(src), Path(out)
    target = (to or "dcp").lower()
    if target not in ("dcp", "safetensors"):
        raise InputError(f"unknown --to '{to}'; use dcp or safetensors")
    if ranks is not None and ranks < 1:
        raise InputError(f"--ranks must be at least 1, got {ranks}")
    with sources.open_source(src_path) as source:
        report = ReshardReport(str(src_path), str(out_path), source.format, target)
        if target == "safetensors":
            if not isinstance(source, sources.SafetensorsSource):
                raise InputError(f"{src_path}: --to safetensors re-splits safetensors; to turn "
                                 f"a DCP checkpoint into safetensors run: ckpttool merge "
                                 f"{src_path} {out_path}")
            hf = locate.find_hf_files(src_path if src_path.is_dir() else src_path.parent)
            _to_safetensors(source, out_path, st.parse_size(str(max_shard_size)), hf.files,
                            overwrite, report, progress, on_start)
        else:
            if isinstance(source, sources.DcpSource) and ranks is None:
                raise InputError("DCP to DCP needs --ranks M (the number of ranks to lay "
                                 "the checkpoint out for)")
            if isinstance(source, sources.DcpSource) and prefix is not None:
                raise InputError("--prefix applies to full weights; a DCP source keeps its keys")
            _to_dcp(source, out_path, ranks or 1, prefix, overwrite, report, progress,
                    on_start)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def _to_dcp(source: sources.Source, out: Path, num_ranks: int, prefix: str | None,
            overwrite: bool, report: ReshardReport, progress: Progress | None,
            on_start: Callable[[int], None] | None) -> None:
    tensors = source.tensors
    plans = plan_chunks([(t.shape, t.dtype.itemsize, t.whole) for t in tensors], num_ranks)
    objects = source.objects()
    _check_dcp_output(out, overwrite)
    total = sum(t.numel * t.dtype.itemsize for t in tensors)
    # Each record adds about 1.5 KB of zip and pickle headers to its bytes.
    check_space(out, total + 2048 * sum(len(c) for c in plans)
                 + sum(len(o.record) for o in objects))
    if on_start is not None:
        on_start(total)
    with AtomicOutputs(out) as outputs:
        writer = DcpWriter(outputs.create, pwrite_all, str(out))
        for t, chunks in zip(tensors, plans, strict=True):
            key, path = t.key, t.path
            if prefix:
                key, path = f"{prefix}.{t.key}", (prefix, t.key)
            writer.declare_tensor(key, path, t.dtype, t.shape)
            for c in chunks:
                writer.add_chunk(key, c.offsets, c.sizes, source.read(t.key, c.start, c.stop),
                                 c.rank)
                if progress is not None:
                    progress((c.stop - c.start) * t.dtype.itemsize)
        for o in objects:
            writer.add_object(o.key, o.path, o.record)
        outputs.write_bytes(dcp.METADATA_FILE, writer.metadata())
        keep = set(writer.files) | {dcp.METADATA_FILE}
        written = outputs.commit(
            last=(dcp.METADATA_FILE,),
            before_last=(lambda: remove_stale(out, keep, _is_dcp_file)) if overwrite else None)
    report.ranks = num_ranks
    report.files = [{"name": p.name, "bytes": p.stat().st_size} for p in written]
    report.num_tensors = len(tensors)
    report.num_objects = len(objects)
    report.total_bytes = total


def _is_dcp_file(name: str) -> bool:
    return name == dcp.METADATA_FILE or name.endswith(dcp.DATA_SUFFIX)


def _check_dcp_output(out: Path, overwrite: bool) -> None:
    existing = existing_outputs(out, _is_dcp_file)
    if existing and not overwrite:
        raise OutputError(f"{out}: already holds a DCP checkpoint ({existing[0]}...); pass "
                          "--overwrite to replace it or choose an empty directory")


def _to_safetensors(source: sources.SafetensorsSource, out: Path, max_shard_size: int,
                    hf_files: tuple[Path, ...], overwrite: bool, report: ReshardReport,
                    progress: Progress | None, on_start: Callable[[int], None] | None) -> None:
    stored = list(source.stored.values())
    files, index = st.plan_files([(t.slot.name, t.slot.dtype, t.slot.shape) for t in stored],
                                 max_shard_size)
    hf_names = {f.name for f in hf_files}
    existing = sorted(existing_outputs(out, lambda n: st.is_weight_file(n) or n in hf_names),
                      key=lambda name: (not st.is_weight_file(name), name))
    if existing and not overwrite:
        raise OutputError(f"{out}: already holds {existing[0]}; pass --overwrite to replace it "
                          "or choose an empty directory")
    total = sum(t.slot.nbytes for t in stored)
    check_space(out, sum(f.layout.file_size for f in files) + len(index or b""))
    if on_start is not None:
        on_start(total)
    src_fds: dict[Path, int] = {}
    try:
        with AtomicOutputs(out) as outputs:
            for f in files:
                fd = outputs.create(f.name, f.layout.file_size)
                pwrite_all(fd, f.layout.header, 0)
                for slot in f.layout.slots:
                    t = source.stored[slot.name]
                    if t.file not in src_fds:
                        src_fds[t.file] = os.open(t.file, os.O_RDONLY)
                    copy_range(src_fds[t.file], t.slot.begin, fd, slot.begin, slot.nbytes)
                    if progress is not None:
                        progress(slot.nbytes)
            if index is not None:
                outputs.write_bytes(st.INDEX_NAME, index)
            for path in hf_files:  # config and tokenizer: the output is a model directory too
                outputs.write_bytes(path.name, path.read_bytes())
            keep = {f.name for f in files} | {p.name for p in hf_files}
            if index is not None:
                keep.add(st.INDEX_NAME)
            written = outputs.commit(
                last=(st.INDEX_NAME,),
                before_last=(lambda: remove_stale(out, keep, st.is_weight_file))
                if overwrite else None)
    finally:
        for fd in src_fds.values():
            os.close(fd)
    report.files = [{"name": p.name, "bytes": p.stat().st_size} for p in written]
    report.num_tensors = len(stored)
    report.total_bytes = total
