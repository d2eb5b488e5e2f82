"""``reshard``: change how a checkpoint is split.

* to DCP on M ranks, laid out as FSDP2 saves it: each tensor split on dim 0 the way
  ``fully_shard`` splits it (``torch.chunk``: pieces of ceil(n / M) rows, trailing ranks
  possibly empty), one ``__<rank>_0.distcp`` per rank; tensors stored whole in the source
  (buffers, replicated tensors, scalars) stay whole, on the least-loaded rank;
* from full weights (safetensors, torch.save) to DCP, optionally under accelerate's ``model``
  key;
* full weights to safetensors with new shard sizes, byte for byte.

Any format the registry reads is a source; whether it holds a training split (``sharded``) or
full weights decides what each target means.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool import units
from ckpttool.core import contract
from ckpttool.core.checkpoint import structure, tensors
from ckpttool.core.checkpoint.discover import Checkpoint, discover, open_reader
from ckpttool.core.contract import Contract
from ckpttool.core.runtime import urls
from ckpttool.core.runtime.report import Progress, Section, document, locked, section
from ckpttool.core.runtime.torch_threads import default_workers, workers_for
from ckpttool.errors import InputError, OutputError, UsageError
from ckpttool.formats import safetensors
from ckpttool.formats.base import CopyOut, Reader, Tensor
from ckpttool.formats.dcp.reader import DATA_SUFFIX, METADATA_FILE
from ckpttool.formats.dcp.writer import DcpWriter
from ckpttool.storage.outputs import (
    AtomicOutputs,
    check_apart,
    check_space,
    existing_outputs,
    pwrite_all,
    remove_stale,
)
from ckpttool.storage.store import LOCAL, Stores


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
        raise UsageError(f"--ranks must be at least 1, got {num_ranks}")
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


@section
class WrittenFile(Section):
    """A file reshard wrote, and its size."""

    name: str
    bytes: int


@dataclass
class ReshardReport:
    src: str
    out: str
    format_in: str
    format_out: str
    ranks: int | None = None
    files: list[WrittenFile] = field(default_factory=list)
    num_tensors: int = 0
    num_objects: int = 0
    total_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    checkpoint: str = ""  # the checkpoint read: SRC, or the one found in it (checkpoint-500/)
    # The output held against the model config.json names (core.contract): a DCP as
    # dcp.load(get_model_state_dict(model)) reads it, safetensors as from_pretrained does
    contract: Contract | None = None
    tied_copies: list[str] = field(default_factory=list)  # tied copies written again

    def to_json(self) -> dict[str, Any]:
        return document("reshard", self)


@urls.urls(sources=("src",), output="out")
def reshard(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    ranks: int | None = None,
    to: str | None = None,
    prefix: str | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    follow_links: bool = False,
    workers: int | None = None,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    stores: Stores = LOCAL,
    iteration: int | None = None,
) -> ReshardReport:
    """Rewrite the checkpoint at ``src`` into ``out`` with another split.

    Args:
        src: any checkpoint ckpttool reads (a sharded one for ``--ranks``, full weights for
            ``--to safetensors`` and ``--prefix``).
        out: output directory.
        ranks: number of ranks of the DCP output (default: 1 from full weights; required for
            DCP to DCP).
        to: ``dcp`` or ``safetensors``; default: ``dcp``.
        prefix: with DCP output from full weights, nest tensors under this key (accelerate's
            ``model``), so the result loads with ``load_fsdp_model``.
        max_shard_size: with safetensors output, the largest shard.
        overwrite: replace a checkpoint already in ``out``.
        follow_links: read data files that are links out of the checkpoint directory.
        workers: threads reading (and writing) data in parallel (default: the CPUs this
            process may use); DCP output holds up to this many chunks in memory at once.
        iteration: of a Megatron-Core run directory, this iteration instead of the one
            ``latest_checkpointed_iteration.txt`` names.

    Raises:
        InputError, UnsupportedError, OutputError: as for ``merge``.
    """
    started = time.perf_counter()
    src_path, out_path = Path(src), Path(out)
    target = (to or "dcp").lower()
    if target not in ("dcp", "safetensors"):
        raise UsageError(f"unknown --to '{to}'; use dcp or safetensors")
    if ranks is not None and ranks < 1:
        raise UsageError(f"--ranks must be at least 1, got {ranks}")
    ckpt = discover(src_path, command="reshard", stores=stores, iteration=iteration)
    assert ckpt.info is not None
    info = ckpt.info
    check_apart(out_path, src_path, info.root)
    structure.raise_first(structure.check(info, ckpt.canonical()))
    report = ReshardReport(str(src_path), str(out_path), info.format, target,
                           checkpoint=str(info.root))
    if target == "safetensors" and info.sharded:
        raise InputError(f"{src_path}: --to safetensors re-splits full weights; to turn a "
                         f"sharded checkpoint into safetensors run: ckpttool merge {src_path} "
                         f"{out_path}")
    if target == "dcp" and info.sharded and ranks is None:
        raise UsageError("DCP to DCP needs --ranks M (the number of ranks to lay the "
                         "checkpoint out for)")
    if target == "dcp" and info.sharded and prefix is not None:
        raise UsageError("--prefix applies to full weights; a DCP source keeps its keys")
    n_workers = workers_for(workers or default_workers(),
                            nbytes=sum(t.nbytes for t in ckpt.tensors),
                            chunks=sum(len(t.tensor.chunks) for t in ckpt.tensors))
    if progress is not None:  # called from the worker threads
        progress = locked(progress)
    ties = _hold_to_contract(ckpt, out_path, target, prefix, report)
    output = _Output(out_path, overwrite, report, progress, on_start, n_workers)
    with open_reader(ckpt, follow_links=follow_links) as reader:
        structure.raise_first(reader.check_copies())  # replicated chunks every rank stored
        reader.open_files()
        if target == "safetensors":
            _to_safetensors(ckpt, reader, output, units.parse_size(str(max_shard_size)))
        else:
            _to_dcp(ckpt, reader, output, ranks or 1, prefix, ties)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


@dataclass(frozen=True)
class _Output:
    """Where and how a reshard writes, passed whole to the writer of its target: the
    directory, whether a checkpoint there is replaced, the report filled in, the progress
    callbacks (``progress`` called from the worker threads) and the threads."""

    path: Path
    overwrite: bool
    report: ReshardReport
    progress: Progress | None
    on_start: Callable[[int], None] | None
    workers: int


def _hold_to_contract(ckpt: Checkpoint, out: Path, target: str, prefix: str | None,
                      report: ReshardReport) -> dict[str, Tensor]:
    """The output held against its consumer before anything is written (exit 3 naming a
    missing or misshapen tensor): full weights to DCP as ``dcp.load`` of the model's
    ``get_model_state_dict`` reads them (accelerate's resume), with the tied copies the
    config promises written again (returned: written name -> the source tensor); safetensors
    as ``from_pretrained`` reads them. A DCP re-split keeps its keys and is not held."""
    assert ckpt.info is not None
    config = ckpt.hf.config
    if target == "dcp" and ckpt.info.sharded:
        report.contract = contract.skipped("a DCP re-split keeps the keys it holds")
        return {}
    by_name = {t.tensor.name: t.tensor for t in ckpt.tensors}
    shapes = {n: t.shape for n, t in by_name.items()}
    if target == "safetensors":
        result = contract.check(shapes, config)
        ties: dict[str, Tensor] = {}
    else:
        ties = {target_name: by_name[source] for target_name, source
                in contract.tied_copies(shapes, config).items()}
        lead = f"{prefix}." if prefix else ""
        planned = {lead + n: s for n, s in shapes.items()}
        planned.update({lead + n: t.shape for n, t in ties.items()})
        result = contract.check_state_dict(planned, config, prefix=prefix)
    report.contract = result
    report.tied_copies = sorted(ties)
    result.raise_if_broken(str(out), next_step=(
        "Reshard the weights of the model config.json names (beside SRC)"))
    if result.checked and result.extra:
        report.warnings.append(result.extra_message(str(out)))
    elif not result.checked and config is not None:
        report.warnings.append(result.not_checked(str(out)))
    return ties


def _in_order(fn: Callable[[Any], bytes | bytearray], items: Iterable[Any], workers: int
              ) -> Generator[bytes | bytearray, None, None]:
    """``fn(item)`` for each item, in order, computed by ``workers`` threads at most that many
    ahead (memory: ``workers`` results)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        ahead: deque[Future[bytes | bytearray]] = deque()
        try:
            for item in items:
                ahead.append(pool.submit(fn, item))
                if len(ahead) >= workers:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        finally:
            for f in ahead:
                f.cancel()


def _to_dcp(ckpt: Checkpoint, reader: Reader, output: _Output, num_ranks: int,
            prefix: str | None, ties: dict[str, Tensor]) -> None:
    assert ckpt.info is not None
    out, overwrite, report = output.path, output.overwrite, output.report
    progress = output.progress
    sharded = ckpt.info.sharded
    # (name written, tensor read): each stored tensor, then the tied copies written again
    stored = [(t.tensor.name, t.tensor) for t in ckpt.tensors] + list(ties.items())
    plans = plan_chunks([(t.shape, t.dtype.itemsize, tensors.stored_whole(t, sharded=sharded))
                         for _, t in stored], num_ranks)
    objects = [(o.entry, record) for o in ckpt.objects
               if (record := reader.object_record(o.entry)) is not None]
    _check_dcp_output(out, overwrite)
    total = sum(t.nbytes for _, t in stored)
    # Each record adds about 1.5 KB of zip and pickle headers to its bytes.
    check_space(out, total + 2048 * sum(len(c) for c in plans)
                 + sum(len(record) for _, record in objects))
    if output.on_start is not None:
        output.on_start(total)
    def read(tc: tuple[Tensor, PlannedChunk]) -> bytes | bytearray:
        t, c = tc
        return tensors.read_range(reader, t, c.start, c.stop)

    pieces = [(t, c) for (_, t), chunks in zip(stored, plans, strict=True) for c in chunks]
    # Read ahead in threads, written in order; closed (pending reads cancelled) on any exit.
    with AtomicOutputs(out, check=lambda: _check_dcp_output(out, overwrite)) as outputs, \
            contextlib.closing(
            _in_order(read, pieces, output.workers)) as data:
        writer = DcpWriter(outputs.create, pwrite_all, str(out))
        for (name, t), chunks in zip(stored, plans, strict=True):
            key, path = name, (t.path if name == t.name else (name,))
            if prefix:
                key, path = f"{prefix}.{name}", (prefix, name)
            writer.declare_tensor(key, path, t.dtype, t.shape)
            for c in chunks:
                writer.add_chunk(key, c.offsets, c.sizes, next(data), c.rank)
                if progress is not None:
                    progress((c.stop - c.start) * t.dtype.itemsize)
        for o, record in objects:
            writer.add_object(o.name, o.path, record)
        outputs.write_bytes(METADATA_FILE, writer.metadata())
        keep = set(writer.files) | {METADATA_FILE}
        written = outputs.commit(
            last=(METADATA_FILE,),
            before_last=(lambda: remove_stale(out, keep, _is_dcp_file)) if overwrite else None)
    report.ranks = num_ranks
    report.files = [WrittenFile(p.name, p.stat().st_size) for p in written]
    report.num_tensors = len(stored)
    report.num_objects = len(objects)
    report.total_bytes = total


def _is_dcp_file(name: str) -> bool:
    return name == METADATA_FILE or name.endswith(DATA_SUFFIX)


def _check_dcp_output(out: Path, overwrite: bool) -> None:
    existing = existing_outputs(out, _is_dcp_file)
    if existing and not overwrite:
        raise OutputError(f"{out}: already holds a DCP checkpoint ({existing[0]}...); pass "
                          "--overwrite to replace it or choose an empty directory")


def _to_safetensors(ckpt: Checkpoint, reader: Reader, output: _Output, max_shard_size: int
                    ) -> None:
    out, overwrite, report = output.path, output.overwrite, output.report
    progress = output.progress
    stored = {t.stored_name: t.tensor for t in ckpt.tensors}
    files, index = safetensors.plan_files([(t.name, t.dtype, t.shape) for t in stored.values()],
                                          max_shard_size)
    hf_files = ckpt.hf.named()  # config and tokenizer: the output is a model directory too
    report.warnings += list(ckpt.hf.skipped)
    hf_names = {name for name, _ in hf_files}

    def check_existing() -> None:
        existing = sorted(existing_outputs(
                              out, lambda n: safetensors.is_weight_file(n) or n in hf_names),
                          key=lambda name: (not safetensors.is_weight_file(name), name))
        if existing and not overwrite:
            raise OutputError(f"{out}: already holds {existing[0]}; pass --overwrite to replace "
                              "it or choose an empty directory")

    check_existing()
    total = sum(t.nbytes for t in stored.values())
    check_space(out, sum(f.layout.file_size for f in files) + len(index or b""))
    if output.on_start is not None:
        output.on_start(total)
    # Under the output's lock, OUT is looked at again: another run may have written it.
    with AtomicOutputs(out, check=check_existing) as outputs:
        jobs = []
        for f in files:
            fd = outputs.create(f.name, f.layout.file_size)
            pwrite_all(fd, f.layout.header, 0)
            jobs += [(fd, slot) for slot in f.layout.slots]

        def copy(job: tuple[int, safetensors.Slot]) -> None:  # each tensor to its own byte range
            fd, slot = job
            _copy_tensor(reader, stored[slot.name], fd, slot.begin)
            if progress is not None:
                progress(slot.nbytes)

        if output.workers <= 1:
            for job in jobs:
                copy(job)
        else:
            with ThreadPoolExecutor(max_workers=output.workers) as pool:
                list(pool.map(copy, jobs))
        if index is not None:
            outputs.write_bytes(safetensors.INDEX_NAME, index)
        for name, path in hf_files:
            outputs.write_bytes(name, ckpt.hf.read(path))
        keep = {f.name for f in files} | hf_names
        if index is not None:
            keep.add(safetensors.INDEX_NAME)
        written = outputs.commit(
            last=(safetensors.INDEX_NAME,),
            before_last=(lambda: remove_stale(out, keep, safetensors.is_weight_file))
            if overwrite else None)
    report.files = [WrittenFile(p.name, p.stat().st_size) for p in written]
    report.num_tensors = len(stored)
    report.total_bytes = total


def _copy_tensor(reader: Reader, t: Tensor, fd: int, offset: int) -> None:
    """A full tensor's bytes into ``fd`` at ``offset``: in the kernel when it is stored as one
    contiguous run, else in C-ordered blocks."""
    chunk = t.chunks[0] if len(t.chunks) == 1 else None
    if chunk is not None and chunk.sizes == t.shape:
        payload = tensors.payload(reader, t, chunk)
        if payload.start is not None:
            reader.read(CopyOut(payload.file, payload.start, t.nbytes, fd, offset))
            return
    for start, block in tensors.blocks(reader, t):
        pwrite_all(fd, block, offset + start * t.dtype.itemsize)
