"""``apply BASE DELTA OUT``: B rebuilt bit for bit, as a Hugging Face safetensors directory,
from a checkpoint holding A's tensors (any format) and a delta of ``diff --write-delta``.

BASE is checked by content first (every tensor's SHA-256 against the delta's record of A; a
tied copy stored once is accepted, as ``verify --check-manifest`` accepts it); each tensor of
OUT is checked against B's record as it is written, before anything is published.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ckpttool import units
from ckpttool.core import ties
from ckpttool.core.checkpoint.discover import Checkpoint, discover, open_reader
from ckpttool.core.diff import plan, stream
from ckpttool.core.diff.delta import BASE, DELTA_JSON, INDEX, INDICES, OWN, SPARSE, VALUES, WHOLE
from ckpttool.core.diff.delta import read as read_delta
from ckpttool.core.diff.operation import sha256
from ckpttool.core.diff.plan import Named
from ckpttool.core.runtime import urls
from ckpttool.core.runtime.report import Progress, document, locked
from ckpttool.core.verify import manifest
from ckpttool.errors import InputError, OutputError
from ckpttool.formats import safetensors
from ckpttool.formats.base import Reader
from ckpttool.formats.codecs.dtypes import BY_NAME, DType
from ckpttool.storage import sidefiles
from ckpttool.storage.outputs import (
    AtomicOutputs,
    check_apart,
    check_space,
    existing_outputs,
    pwrite_all,
    remove_stale,
)
from ckpttool.storage.store import LOCAL, READ_FLAGS, Stores

BLOCK_BYTES = 8 << 20
# Changed elements read from the delta at a time.
PATCH_STEP = 1 << 20


@dataclass
class ApplyReport:
    """What ``apply`` wrote."""

    base: str
    delta: str
    out: str
    files: list[str] = field(default_factory=list)
    num_tensors: int = 0
    from_base: int = 0
    sparse: int = 0
    whole: int = 0
    bytes_written: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return document("apply", self)


@urls.urls(sources=("base",))
def apply(
    base: str | os.PathLike[str],
    delta: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    follow_links: bool = False,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    stores: Stores = LOCAL,
) -> ApplyReport:
    """Rebuild B from ``base`` (A, in any format) and ``delta`` into ``out``.

    Args:
        base: a checkpoint holding the tensors of the delta's A.
        delta: the directory ``diff A B --write-delta`` wrote (or its ``delta.json``).
        out: the output directory (HF safetensors, with B's config files).
        max_shard_size: largest output shard, e.g. ``"5GB"``.
        overwrite: replace model weights already in ``out``.
        follow_links: read data files that are links out of BASE's directory.
        progress: called with bytes read.
        on_start: called once with the bytes about to be read.

    Returns:
        An :class:`ApplyReport`.

    Raises:
        InputError: BASE does not hold A (naming the first tensor that differs), the delta is
            damaged, or OUT would not match B.
        OutputError: OUT holds weights already (without ``overwrite``), or cannot be written.
    """
    started = time.perf_counter()
    doc, data = read_delta(Path(delta))
    named = plan.named(discover(base, command="apply", stores=stores))
    ckpt = named.ckpt
    out_dir = Path(out)
    check_apart(out_dir, ckpt.root, data.parent)
    files = [str(f) for f in doc.get("files", [])]
    recipes = _recipes(doc, data)
    want = doc["b"]["tensors"]
    planned, index = safetensors.plan_files([(r.name, r.dtype, r.shape) for r in recipes],
                                            units.parse_size(max_shard_size)
                                            if isinstance(max_shard_size, str) else max_shard_size)

    def check_existing() -> None:
        existing = existing_outputs(out_dir, lambda n: safetensors.is_weight_file(n) or n in files)
        if existing and not overwrite:
            raise OutputError(f"{out_dir}: already holds {existing[0]}; pass --overwrite to "
                              "replace it or choose an empty directory")

    check_existing()
    report = ApplyReport(str(ckpt.root), str(data.parent), str(out_dir),
                         num_tensors=len(recipes))
    read = locked(progress)
    if on_start is not None:
        on_start(sum(v.nbytes for v in named.views.values()) + sum(
            r.nbytes for r in recipes if r.how != BASE))
    with open_reader(ckpt, follow_links=follow_links) as reader:
        _check_base(named, reader, doc["a"]["tensors"], data.parent / DELTA_JSON, read)
        check_space(out_dir, sum(f.layout.file_size for f in planned) + len(index or b""))
        by_name = {r.name: r for r in recipes}
        sources = _sources(named, doc["a"]["tensors"])
        fd_data = _open(data)
        try:
            with AtomicOutputs(out_dir, check=check_existing) as outputs:
                for f in planned:
                    fd = outputs.create(f.name, f.layout.file_size)
                    pwrite_all(fd, f.layout.header, 0)
                    for slot in f.layout.slots:
                        r = by_name[slot.name]
                        h = hashlib.sha256()
                        at = slot.begin
                        for block in _make(r, reader, sources, fd_data, data):
                            h.update(block)
                            pwrite_all(fd, block, at)
                            at += len(block)
                            read(len(block))
                        if h.hexdigest() != want.get(r.name, {}).get("sha256"):
                            raise InputError(
                                f"{data.parent}: tensor '{r.name}' rebuilt does not match the "
                                "SHA-256 the delta records for B; the delta is damaged. "
                                "Write it again with ckpttool diff A B --write-delta DIR")
                for name in files:
                    src = data.parent / name
                    if (Path(name).name != name or not src.is_file()
                            or safetensors.is_weight_file(name) or name in OWN):
                        raise InputError(f"{src}: a file the delta names is missing or is no "
                                         "config or tokenizer file; write the delta again")
                    try:  # a link is refused, never followed out of the delta
                        body = sidefiles.read_checked(src, sidefiles.HF_FILE, nofollow=True)
                    except FileNotFoundError:
                        raise InputError(f"{src}: a file the delta names is missing; write "
                                         "the delta again") from None
                    outputs.write_bytes(name, body)
                if index is not None:
                    outputs.write_bytes(safetensors.index_name(), index)
                keep = {f.name for f in planned} | set(files) | {safetensors.index_name()}
                outputs.commit(last=(safetensors.index_name(),) if index is not None else (),
                               before_last=(lambda: remove_stale(
                                   out_dir, keep, safetensors.is_weight_file))
                               if overwrite else None)
        finally:
            os.close(fd_data)
    report.files = [f.name for f in planned] + ([safetensors.index_name()] if index else []) + files
    report.from_base = sum(r.how == BASE for r in recipes)
    report.sparse = sum(r.how == SPARSE for r in recipes)
    report.whole = sum(r.how == WHOLE for r in recipes)
    report.bytes_written = sum(f.layout.file_size for f in planned)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def _gathered(side: stream.Side, start: int, stop: int) -> bytearray:
    """Elements ``[start, stop)`` in a buffer of their own (patched in place)."""
    out = bytearray((stop - start) * side.tensor.dtype.itemsize)
    buf = memoryview(out)
    for data in side.read(start, stop, buf):
        if not (isinstance(data, memoryview) and data.obj is out):
            buf[:] = data  # mapped from the page cache, or gathered: copied
    return out


@dataclass(frozen=True)
class _Recipe:
    name: str
    how: str
    source: str | None
    dtype: DType
    shape: tuple[int, ...]
    # in delta.safetensors: WHOLE's one, SPARSE's indices, values
    slots: tuple[safetensors.Slot, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def _recipes(doc: dict[str, Any], data: Path) -> list[_Recipe]:
    """Each tensor of B with how it is made, checked against B's record and the data file."""
    _, slots = safetensors.read_layout(data, exact=True)
    by_slot = {s.name: s for s in slots}
    damaged = f"{data.parent}: damaged delta"
    out = []
    for name, want in sorted(doc["b"]["tensors"].items()):
        how = doc["tensors"].get(name)
        dtype = BY_NAME.get(str(want.get("dtype"))) if isinstance(want, dict) else None
        shape = want.get("shape") if isinstance(want, dict) else None
        if (not isinstance(how, dict) or dtype is None or not isinstance(shape, list)
                or how.get("how") not in (BASE, SPARSE, WHOLE)):
            raise InputError(f"{damaged}: no valid record of how to make tensor '{name}'; "
                             "write the delta again")
        kind, source = how["how"], how.get("from")
        names = {WHOLE: (name,), SPARSE: (name + INDICES,
                                          name + VALUES)}.get(kind, ())
        got = tuple(by_slot[n] for n in names if n in by_slot)
        if len(got) != len(names) or (kind != WHOLE and not isinstance(source, str)):
            raise InputError(f"{damaged}: tensor '{name}' lacks its data in {data.name}; "
                             "write the delta again")
        if kind == SPARSE and (got[0].dtype != INDEX or got[1].dtype != dtype
                               or got[0].shape != got[1].shape):
            raise InputError(f"{damaged}: tensor '{name}': its indices and values disagree")
        out.append(_Recipe(name, kind, source, dtype, tuple(shape), got))
    return out


def _check_base(named: Named, reader: Reader, expected: dict[str, dict[str, Any]],
                where: Path, read: Progress) -> None:
    """BASE holds A: every tensor's SHA-256 as the delta recorded it.

    Raises:
        InputError: naming the first tensor that differs.
    """
    ckpt = named.ckpt
    digests = {n: sha256(stream.Side(reader, v.source), BLOCK_BYTES, read)
               for n, v in named.views.items()}
    # verify's manifest check, on the tensors under the names compared (a Named has the
    # by_name() and hf of a Checkpoint).
    problems = [p for p in manifest.check(cast(Checkpoint, named), expected, digests, set(),
                                          where) if p.severity == "error"]
    if problems:
        first = min(problems, key=lambda p: p.location.tensor or "")
        raise InputError(f"{ckpt.root}: is not the checkpoint the delta was made from "
                         f"({first.message}); apply it to that checkpoint (its A)")


def _sources(named: Named, expected: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A's canonical names -> BASE's tensors (a tied copy BASE stores once: its partner)."""
    have: dict[str, Any] = {n: v.source for n, v in named.views.items()}
    pair = ties.find_pair(named.views) or ties.find_pair(
        {n: _Shape(e) for n, e in expected.items()})
    if pair is not None and pair[0] not in have and pair[1] in have:
        have[pair[0]] = have[pair[1]]
    return have


class _Shape:
    def __init__(self, entry: dict[str, Any]) -> None:
        shape = entry.get("shape")
        self.shape = tuple(shape) if isinstance(shape, list) else ()


def _open(path: Path) -> int:
    try:
        return os.open(path, READ_FLAGS)
    except OSError as e:
        raise InputError(f"{path}: cannot open the delta's data: {e.strerror}") from e


def _pread(fd: int, size: int, offset: int, path: Path) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise InputError(f"{path}: truncated at byte {offset + len(data)}; write the delta "
                         "again")
    return data


def _make(r: _Recipe, reader: Reader, sources: dict[str, Any], fd: int, data: Path
          ) -> Iterator[bytes | bytearray | memoryview]:
    """The bytes of B's tensor ``r`` in C order, block by block."""
    item = r.dtype.itemsize
    if r.how == WHOLE:
        slot = r.slots[0]
        for lo in range(slot.begin, slot.end, BLOCK_BYTES):
            yield _pread(fd, min(BLOCK_BYTES, slot.end - lo), lo, data)
        return
    tensor = sources.get(r.source or "")
    if tensor is None:
        raise InputError(f"{data.parent}: tensor '{r.name}' is made from '{r.source}', which "
                         "the base does not hold; write the delta again")
    if (tensor.dtype, tuple(tensor.shape)) != (r.dtype, r.shape):
        raise InputError(f"{data.parent}: damaged delta: tensor '{r.name}' is made from "
                         f"'{r.source}', which is {tensor.dtype.name} {list(tensor.shape)}, not "
                         f"{r.dtype.name} {list(r.shape)}; write the delta again")
    side = stream.Side(reader, tensor)
    step = max(1, BLOCK_BYTES // item)
    if r.how == BASE:
        buf = memoryview(bytearray(min(step, max(tensor.numel, 1)) * item))
        for start in range(0, tensor.numel, step):
            yield from side.read(start, min(tensor.numel, start + step), buf)
        return
    import numpy as np

    from ckpttool.core.diff.values import bits

    indices, values = r.slots
    total = indices.nbytes // INDEX.itemsize
    done = 0
    pending_i = np.empty(0, dtype=np.int64)
    pending_v = np.empty(0, dtype=bits(b"", r.dtype).dtype)
    for start in range(0, tensor.numel, step):
        stop = min(tensor.numel, start + step)
        block = _gathered(side, start, stop)
        while done < total and (not len(pending_i) or pending_i[-1] < stop):
            n = min(PATCH_STEP, total - done)
            more_i = np.frombuffer(_pread(fd, n * 8, indices.begin + done * 8, data), "<i8")
            more_v = bits(_pread(fd, n * item, values.begin + done * item, data), r.dtype)
            pending_i = np.concatenate([pending_i, more_i])
            pending_v = np.concatenate([pending_v, more_v])
            done += n
        k = int(np.searchsorted(pending_i, stop))
        if k:
            if pending_i[0] < start or (k > 1 and bool(np.any(np.diff(pending_i[:k]) <= 0))):
                raise InputError(f"{data.parent}: damaged delta: the indices of tensor "
                                 f"'{r.name}' are not ascending; write the delta again")
            view = bits(block, r.dtype)
            view[pending_i[:k] - start] = pending_v[:k]
            pending_i, pending_v = pending_i[k:], pending_v[k:]
        yield block
    if len(pending_i) or done < total:
        raise InputError(f"{data.parent}: damaged delta: tensor '{r.name}' has indices past its "
                         "end; write the delta again")
