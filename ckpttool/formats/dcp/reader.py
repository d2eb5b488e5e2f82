"""PyTorch Distributed Checkpoint (DCP) directories: ``.metadata`` plus ``__<rank>_<n>.distcp``.

Nothing here imports torch or runs code from the checkpoint:

* ``.metadata`` is a pickle. It is read by an allow-list unpickler that maps the handful of
  globals DCP writes (its metadata dataclasses, ``torch.Size``, dtypes, a layout helper, a path
  class) onto inert stand-ins. Any other global is refused by name before it is looked up.
* each chunk is a ``torch.save`` record: an uncompressed zip archive whose ``data.pkl`` names
  the storage, shape and strides, and whose ``data/<key>`` entry holds the raw bytes. The zip
  headers give the payload's offset and its CRC-32, so a chunk's bytes are located without
  reading them, and copied or checked without torch.

The layout is taken from what the real writer produces (torch/distributed/checkpoint/
metadata.py and filesystem.py): ``Metadata.state_dict_metadata`` maps each flat key to a
``TensorStorageMetadata`` (dtype, global size, chunks with offsets and sizes) or a
``BytesStorageMetadata``; ``Metadata.storage_data`` maps a ``MetadataIndex(fqn, offset)`` to a
``_StorageInfo(relative_path, offset, length, transform_descriptors)``; ``planner_data`` maps
each flat key to the path of nested keys it came from.

``FileSystemWriter``'s options, as torch 2.13 writes them:

* ``serialization_format=SerializationFormat.SAFETENSORS``: a rank's non-tensor records come
  first (``torch.save`` records as usual), then one safetensors blob of all its tensor chunks,
  keyed by flat key, whose ``__metadata__`` ``DCP_SHARDING_INFO`` gives each chunk's
  ``saved_offsets``. ``.metadata`` records every chunk of the file at the blob's start with
  the chunk's byte length (nothing locates it inside the blob), so the blob's header is read
  here to place each chunk; no checksum covers the bytes. (torch's own ``FileSystemReader``
  cannot load these: it hands the blob to ``torch.load``.)
* ``dcp.save(..., use_collectives=False)``: every rank writes its own ``__<rank>.metadata``,
  describing only its own chunks and no global ``.metadata``; a replicated tensor is written
  by every rank. The checkpoint is the union of the rank files; a chunk stored by several
  ranks is read from the lowest rank, once the others are known to hold the same bytes
  (:meth:`DcpReader.check_copies`).
* ``_extensions=[ZStandard()]``: every record (tensor chunk or not) is one zstd frame of the
  usual ``torch.save`` record, with the descriptor ``stream.zstd/1`` in its storage entry.
  Records are decompressed one at a time (:mod:`ckpttool.formats.codecs.zstd`); the archive's
  CRC-32s
  are the only checksums.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ckpttool._gc import gc_paused
from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats.base import (
    RECORD,
    CheckpointInfo,
    Checksummed,
    Chunk,
    ChunkColumns,
    DataFile,
    ObjectEntry,
    Payload,
    Problem,
    Reader,
    Tensor,
    Whole,
    error,
)
from ckpttool.formats.codecs import torchsave, zstd
from ckpttool.formats.dcp.blobs import locate_safetensors
from ckpttool.formats.dcp.metadata import (  # the format's file names are its verbs' too
    DATA_SUFFIX as DATA_SUFFIX,
)
from ckpttool.formats.dcp.metadata import (
    METADATA_FILE as METADATA_FILE,
)
from ckpttool.formats.dcp.metadata import (
    RANK_METADATA,
    RANK_METADATA_RE,
    ZSTD_RECORD,
    Copy,
    Detail,
    Lookup,
    missing_rank_metadata,
    nested_records,
    rank_metadata_files,
    rank_of,
    read_one,
    stray_files,
    union_of,
)
from ckpttool.formats.dcp.records import (
    SMALL_RECORD,
    SPAN,
    Template,
    TensorRecord,
    fill_rows,
    payload_of,
    read_object,
    read_record,
    record_entries,
)
from ckpttool.storage.store import LOCAL, Store, Stores

NAME = "dcp"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = '`.metadata` (or one `__<rank>.metadata` per rank) + `__<rank>_<n>.distcp` files'
WRITTEN_BY = ('`torch.distributed.checkpoint.save` (FSDP2, accelerate, torchtitan, Lightning '
    'Fabric...), with any `FileSystemWriter` option')
# A decompressed record holds its chunk's bytes plus a few hundred bytes of zip and pickle
# headers (DCP's writer gives each chunk a storage of its own size); beyond this it is corrupt.
_RECORD_OVERHEAD = 1 << 16
_OBJECT_LIMIT = 256 << 20  # a compressed non-tensor record decompresses to at most this


def detect(path: Path, stores: Stores = LOCAL) -> bool:
    """A directory with a ``.metadata`` file, ``__<rank>.metadata`` files or ``.distcp`` data
    files (data files alone are a damaged DCP checkpoint, which :func:`read_info` explains)."""
    names = stores.listdir(path)
    return (METADATA_FILE in names or any(n.endswith(DATA_SUFFIX) for n in names)
            or bool(rank_metadata_files(path, names)))


def piece_of(path: Path) -> str | None:
    """Why the file ``path`` is a piece of a DCP checkpoint, not a checkpoint (a data file,
    ``.metadata``, ``__<rank>.metadata``), naming the directory to pass; None otherwise.
    Names only: a data file begins with a valid ``torch.save`` archive (its first record),
    which must never be taken for the whole checkpoint."""
    if path.name.endswith(DATA_SUFFIX):
        what = "a DCP data file (records of one rank, a piece of the checkpoint)"
    elif path.name == METADATA_FILE or RANK_METADATA_RE.match(path.name):
        what = "the metadata of a DCP checkpoint"
    else:
        return None
    return f"{path}: {what}; pass the DCP directory that holds it: {path.parent}"


def pending(path: Path) -> str | None:
    """``dcp.save`` writes ``.metadata`` (or, without collectives, each rank its
    ``__<rank>.metadata``) after every data file: without one, the save is still going on, or
    its writer was killed before the end."""
    names = LOCAL.listdir(path)
    if names.get(METADATA_FILE) is not None or rank_metadata_files(path, names):
        return None
    return f"no {METADATA_FILE} yet (dcp.save writes it after every data file)"


def read_info(path: str | os.PathLike[str], *, lookup: Lookup | None = None,
              stores: Stores = LOCAL, open_nested: bool = True) -> CheckpointInfo:
    """Read a DCP directory's ``.metadata`` (or, without one, every ``__<rank>.metadata``),
    plus the header of each safetensors blob (``SerializationFormat.SAFETENSORS``). Reads no
    tensor data.

    ``lookup``: the ``.metadata`` allow-list, for a format built on DCP whose writer pickles
    more than DCP's own classes there (default: DCP's).

    Raises:
        InputError: not a DCP directory, or its metadata is missing, unsafe, truncated or
            corrupt.
        UnsupportedError: a DCP layout ckpttool does not read yet.
    """
    root = Path(path)
    md_path = root / METADATA_FILE
    listed = stores.listdir(root)
    ranks = rank_metadata_files(root, listed) if METADATA_FILE not in listed else []
    if METADATA_FILE not in listed and not ranks and any(n.endswith(DATA_SUFFIX)
                                                         for n in listed):
        raise InputError(f"{root}: has .distcp data files but no {METADATA_FILE}; the copy is "
                         f"incomplete (copy {METADATA_FILE} too)")
    if not ranks and listed.get(METADATA_FILE) is None:
        raise InputError(f"{root}: not a DCP checkpoint directory (no {METADATA_FILE} file)")
    with gc_paused():
        if not ranks:
            read = read_one(root, md_path, lookup, stores, open_nested)
            per_file = [(0, read)]
            tensors, objects = read.tensors, read.objects
            copies: list[Copy] = []
            metadata_name, problems = METADATA_FILE, []
            zstd_records = read.compressed_all
            layers = {read.zstd_layers}
        else:
            reads = [(r, read_one(root, p, lookup, stores, open_nested)) for r, p in ranks]
            per_file = reads
            read = reads[0][1]
            tensors, objects, copies = union_of(reads)
            metadata_name, problems = RANK_METADATA, missing_rank_metadata(root, reads, listed)
            zstd_records = frozenset().union(*(r.compressed_all for _, r in reads))
            layers = {r.zstd_layers for _, r in reads if r.compressed_all}
        tensors, serialization = locate_safetensors(root, tensors, stores)
    for t in tensors:
        # No file holds 2**63 bytes: a larger claim is damage, refused before any size is
        # computed or printed from it (sizes past a float's range cannot be formatted).
        if math.prod(t.shape) * t.dtype.itemsize > torchsave.MAX_INT:
            raise InputError(f"{root / metadata_name}: tensor '{t.name}' claims shape "
                             f"{list(t.shape)[:8]}, more than 2**63 bytes; corrupt")
    names = sorted({f for t in tensors for f in t.files}
                   | {o.file for o in objects if o.file is not None})
    ranks_of = {rank_of(f) for f in names}
    # Copies of objects are read too (check_copies): every compressed record is listed.
    compressed = zstd_records & frozenset((o.file, o.offset) for o in objects if o.file)
    if copies:
        compressed |= zstd_records & frozenset(
            (c.other.file, c.other.offset) for c in copies
            if isinstance(c.other, ObjectEntry) and c.other.file)
    any_zstd = bool(zstd_records)
    if len(layers) > 1:
        raise UnsupportedError(
            f"{root}: the ranks' metadata files say records are compressed "
            f"{' or '.join(map(str, sorted(layers)))} times with the ZStandard extension; "
            "ckpttool reads checkpoints whose records went through the same extensions")
    return CheckpointInfo(
        format=NAME, root=root, tensors=tuple(tensors), objects=tuple(objects),
        files=tuple(DataFile(f, stores.file_size(root / f)) for f in names),
        metadata_name=metadata_name, sharded=True, single_file=False,
        num_ranks=None if None in ranks_of else len(ranks_of),
        problems=tuple(problems) + tuple(p for _, r in per_file for p in r.nested.problems),
        values={k: v for _, r in per_file for k, v in r.nested.values.items()},
        stray=tuple(stray_files(listed, set(names))),
        version=read.version,
        storage={"serialization": serialization,
                 "compression": zstd.NAME if any_zstd else None,
                 "metadata": "rank-local" if ranks else "global"},
        detail=Detail(compressed, tuple(copies), nested_records(per_file),
                      max(layers, default=1)))


class DcpReader(Reader):
    """Chunks are ``torch.save`` records (zstd-compressed ones included) or ranges of a
    safetensors blob; objects are pickled records."""

    def __init__(self, info: CheckpointInfo, store: Store | None = None, *,
                 templates: bool = True) -> None:
        super().__init__(info, store)
        self._templates: dict[tuple[int, str, tuple[int, ...]], Template | None] = {}
        self._use_templates = templates  # False: decode every record in full (tests compare)
        self.detail = info.detail if isinstance(info.detail, Detail) else Detail()
        # The last record each thread decompressed: payload() then read_chunk() of one chunk
        # decompress it once. One record per thread is all that is ever held.
        self._inflated = threading.local()

    def close(self) -> None:
        self._inflated = threading.local()
        super().close()

    def _pread(self, file: str) -> Callable[[int, int], bytes]:
        return functools.partial(self.store.pread, file)

    def _outside_data(self, chunk: Chunk, head: int, data_end: int
                      ) -> tuple[bytes, bytes | None]:
        """The record's bytes before and after its storage's data, in one read when small;
        and then the whole record (None when it is read in two parts)."""
        if chunk.length <= SMALL_RECORD:
            whole = self.store.pread(chunk.file, chunk.length, chunk.offset)
            if len(whole) != chunk.length:
                return b"", None
            return whole[:head] + whole[data_end:], whole
        return (self.store.pread(chunk.file, head, chunk.offset)
                + self.store.pread(chunk.file, chunk.length - data_end, chunk.offset + data_end),
                None)

    # -- zstd-compressed records

    def _inflate(self, file: str, offset: int, length: int, *, limit: int, what: str
                 ) -> bytes | bytearray:
        """The decompressed record at ``offset`` (the thread's last one, when asked again).
        A record compressed more than once (stacked ZStandard extensions) is decompressed
        layer by layer, each bounded by what a zstd frame of the next can take (its bytes
        plus 1/128 and a KiB), so no layer is a bomb either."""
        key = (file, offset, length)
        last = getattr(self._inflated, "record", None)
        if last is not None and last[0] == key:
            return last[1]  # type: ignore[no-any-return]
        where = self.where(file, offset, f"{what}, zstd-compressed record")
        bounds = [limit]
        for _ in range(self.detail.zstd_layers - 1):
            bounds.append(bounds[-1] + (bounds[-1] >> 7) + 1024)
        data = zstd.inflate(self._pread(file), offset, length, limit=bounds.pop(), where=where)
        while bounds:
            data = zstd.inflate(functools.partial(_slice, data), 0, len(data),
                                limit=bounds.pop(), where=where)
        self._inflated.record = (key, data)
        return data

    def _zstd_record(self, tensor: Tensor, chunk: Chunk
                     ) -> tuple[TensorRecord, bytes | bytearray, str]:
        """A compressed chunk's record, decoded from its decompressed bytes, and those bytes;
        checked against what the metadata promises as an uncompressed record is."""
        what = f"tensor '{tensor.name}'"
        need = chunk.numel * tensor.dtype.itemsize
        where = self.where(chunk.file, chunk.offset, f"{what}, zstd-compressed record")
        # The metadata's claim, judged before any memory is taken for it.
        zstd.check_claim(need, chunk.length, where=where)
        raw = self._inflate(chunk.file, chunk.offset, chunk.length,
                            limit=need + _RECORD_OVERHEAD, what=what)
        rec = read_record(functools.partial(_slice, raw), offset=0, length=len(raw),
                          where=where)
        if rec.dtype != tensor.dtype or rec.shape != chunk.sizes:
            raise InputError(
                f"{where}: record holds {rec.dtype.name} {list(rec.shape)} but the metadata "
                f"promises {tensor.dtype.name} {list(chunk.sizes)}; the checkpoint is "
                "inconsistent")
        extent = torchsave.view_extent(rec.shape, rec.stride, rec.storage_offset,
                                       contiguous=rec.is_contiguous) * rec.dtype.itemsize
        if math.prod(rec.shape) and extent > rec.data_size:
            raise InputError(f"{where}: record's storage is smaller than its tensor; corrupt")
        return rec, raw, where

    def read_chunk(self, tensor: Tensor, chunk: Chunk) -> bytes:
        if chunk.encoding != ZSTD_RECORD:
            return super().read_chunk(tensor, chunk)
        rec, raw, where = self._zstd_record(tensor, chunk)
        storage = memoryview(raw)[rec.data_offset : rec.data_offset + rec.data_size]
        # Nothing else checks a compressed record (its zstd frame has no checksum), and it is
        # decompressed anyway: the archive's CRC-32 of the storage costs little more.
        crc = zlib.crc32(storage)
        if rec.crc32 is not None and crc != rec.crc32:
            raise InputError(f"{where}: CRC-32 of the decompressed storage is {crc:08x} but "
                             f"the record says {rec.crc32:08x}; the record is damaged. Copy "
                             "the checkpoint again from a good source")
        item = tensor.dtype.itemsize
        if rec.is_contiguous:
            start = rec.storage_offset * item
            return bytes(storage[start : start + chunk.numel * item])
        return torchsave.gather_strided(bytes(storage), itemsize=item, shape=chunk.sizes,
                                        stride=rec.stride, storage_offset=rec.storage_offset)

    def _zstd_payload(self, tensor: Tensor, chunk: Chunk, checksums: bool) -> Payload:
        rec, raw, _ = self._zstd_record(tensor, chunk)
        side = tuple(Checksummed(chunk.file, chunk.offset, e.size, e.crc32,
                                 f"record entry '{e.name}', decompressed",
                                 bytes(raw[e.data_offset : e.data_offset + e.size]))
                     for e in rec.entries) if checksums else ()
        return Payload(chunk.file, chunk.offset, chunk.length, None, None, stride=rec.stride,
                       view_offset=rec.storage_offset, side=side, compression=zstd.NAME)

    def _object_bytes(self, entry: ObjectEntry) -> tuple[Callable[[int, int], bytes],
                                                          ObjectEntry]:
        """``pread`` over the entry's record and the entry relative to it (decompressed for
        a compressed record)."""
        assert entry.file is not None
        if (entry.file, entry.offset) not in self.detail.compressed_objects:
            return self._pread(entry.file), entry
        raw = self._inflate(entry.file, entry.offset, entry.length, limit=_OBJECT_LIMIT,
                            what=f"entry '{entry.name}'")
        return (functools.partial(_slice, raw),
                dataclasses.replace(entry, offset=0, length=len(raw)))

    # -- chunks

    def _decode(self, tensor: Tensor, chunk: Chunk, checksums: bool = False,
                whole: bytes | None = None) -> Payload:
        """``whole``: the record's bytes, when the caller read them already (:meth:`payloads`)."""
        if chunk.encoding == ZSTD_RECORD:
            return self._zstd_payload(tensor, chunk, checksums)
        if chunk.encoding != RECORD:
            return super()._decode(tensor, chunk, checksums)
        key = (chunk.length, tensor.dtype.name, chunk.sizes)
        template = self._templates.get(key) if self._use_templates else None
        if template is not None:
            if whole is not None:  # read with its neighbours: compared in place
                p = template.decode_whole(chunk, whole, checksums)
                if p is not None:
                    return p
            else:
                raw, whole = self._outside_data(chunk, template.head, template.data_end)
                if template.matches(raw):
                    crcs = template.crcs(raw)
                    return payload_of(chunk, template.rec, crcs[0],
                                    zip(template.side, crcs[1:],
                                        (raw[s] for s in template.side_slices), strict=True)
                                    if checksums else (),
                                    None if whole is None
                                    else memoryview(whole)[template.head:template.data_end])
        where = self.where(chunk.file, chunk.offset, f"tensor '{tensor.name}'")
        rec = read_record(self._pread(chunk.file), offset=chunk.offset, length=chunk.length,
                          where=where)
        if rec.dtype != tensor.dtype or rec.shape != chunk.sizes:
            raise InputError(
                f"{where}: record holds {rec.dtype.name} {list(rec.shape)} but .metadata "
                f"promises {tensor.dtype.name} {list(chunk.sizes)}; the checkpoint is inconsistent"
            )
        need = torchsave.view_extent(rec.shape, rec.stride, rec.storage_offset,
                                     contiguous=rec.is_contiguous) * rec.dtype.itemsize
        if math.prod(rec.shape) and need > rec.data_size:
            raise InputError(f"{where}: record's storage is smaller than its tensor; corrupt")
        relative = dataclasses.replace(rec, data_offset=rec.data_offset - chunk.offset)
        data = next(e for e in rec.entries if e.data_offset == relative.data_offset)
        if self._use_templates and key not in self._templates:
            self._templates[key] = (Template(relative, self._outside_data(
                chunk, data.data_offset, data.data_offset + data.size)[0], chunk.length, data)
                if data.crc_fields else None)
        return payload_of(chunk, relative, rec.crc32,
                        ((e, e.crc32, None) for e in rec.entries if e is not data)
                        if checksums else ())

    def payloads(self, items: Sequence[tuple[Tensor, Chunk]], *, checksums: bool = False
                 ) -> Iterator[Payload]:
        """Records that lie back to back in one file (as a writer leaves them, and as a
        caller that sorts by file and offset asks for them) are read together, in one read
        of up to ``SPAN`` bytes, and decoded from memory with their stored bytes."""
        i, n = 0, len(items)
        while i < n:
            first = items[i][1]
            if first.encoding != RECORD or first.length > SMALL_RECORD:
                yield self._decode(items[i][0], first, checksums)
                i += 1
                continue
            j, end = i + 1, first.end
            while j < n:
                c = items[j][1]
                if (c.offset != end or c.file != first.file or c.encoding != RECORD
                        or c.length > SMALL_RECORD or c.end - first.offset > SPAN):
                    break
                end = c.end
                j += 1
            span = self.store.pread(first.file, end - first.offset, first.offset)
            templates = self._templates if self._use_templates else {}
            for t, c in items[i:j]:
                at = c.offset - first.offset
                if at + c.length > len(span):
                    # A short read (a truncated file): decoded alone, which says where it ends.
                    yield self._decode(t, c, checksums)
                    continue
                whole = span[at : at + c.length]
                template = templates.get((c.length, t.dtype.name, c.sizes))
                p = template.decode_whole(c, whole, checksums) if template is not None else None
                yield p if p is not None else self._decode(t, c, checksums, whole)
            i = j

    def elements(self, items: Sequence[tuple[Tensor, int]]) -> Iterator[memoryview | None]:
        """Chunks of column tables (a ``.metadata`` of many chunks) whose records lie back to
        back are read together, as in :meth:`payloads`, and each record that matches its
        template hands over its elements, located by the template: no Chunk or Payload is
        built. None for any other chunk (a record with no template yet, or not matching it,
        a strided view, a compressed or large record): the caller reads it the usual way,
        which decodes it in full (and makes the template)."""
        for got in self._from_templates(items, checksums=False):
            yield None if got is None else got[0]

    def checked_elements(self, items: Sequence[tuple[Tensor, int]]
                         ) -> Iterator[tuple[memoryview, int] | None]:
        """:meth:`elements` with the stored bytes whose CRC-32s were checked with each (the
        whole record's, every entry), where all of them matched; else None."""
        return self._from_templates(items, checksums=True)

    def _from_templates(self, items: Sequence[tuple[Tensor, int]], *, checksums: bool
                        ) -> Iterator[tuple[memoryview, int] | None]:
        """(elements, bytes checked) per item, as :meth:`elements` and
        :meth:`checked_elements` say."""
        templates = self._templates if self._use_templates else {}
        i, n = 0, len(items)
        while i < n:
            t, k = items[i]
            cols = t.chunks
            g = cols.first + k if isinstance(cols, ChunkColumns) else 0
            if not isinstance(cols, ChunkColumns) or cols.table.encoding != RECORD or \
                    cols.table.length[g] > SMALL_RECORD:
                yield None
                i += 1
                continue
            table = cols.table
            file_col, offset_col, length_col = table.file, table.offset, table.length
            file, start = file_col[g], offset_col[g]
            end = start + length_col[g]
            j = i + 1
            while j < n:  # the run of back-to-back records in this table and file
                t2, k2 = items[j]
                c2 = t2.chunks
                if not isinstance(c2, ChunkColumns) or c2.table is not table:
                    break
                g2 = c2.first + k2
                if file_col[g2] != file or offset_col[g2] != end or \
                        length_col[g2] > SMALL_RECORD or end + length_col[g2] - start > SPAN:
                    break
                end += length_col[g2]
                j += 1
            span = self.store.pread(table.names[file], end - start, start)
            for t2, k2 in items[i:j]:
                c2 = t2.chunks
                assert isinstance(c2, ChunkColumns)
                g2, nd = c2.first + k2, c2.ndim
                at, length = offset_col[g2] - start, length_col[g2]
                b = c2.box + 2 * nd * k2 + nd
                sizes = tuple(table.boxes[b : b + nd])
                template = templates.get((length, t2.dtype.name, sizes))
                if template is None or template.start is None or at + length > len(span):
                    yield None
                    continue
                whole = span[at : at + length]
                if not template.matches_whole(whole):
                    yield None
                    continue
                first = template.head + template.start
                elements = memoryview(whole)[first : first + math.prod(sizes)
                                             * t2.dtype.itemsize]
                if not checksums:
                    yield elements, 0
                    continue
                checked = template.checked(whole)
                yield None if checked is None else (elements, checked)
            i = j

    def _whole(self, request: Whole, via: Reader) -> list[int | None]:
        """Tensors of row chunks all at once (:meth:`fill_rows`: nothing per chunk in
        Python); then, where ``strict``, the others chunk by chunk in stored order, a record
        that matches its template handing over its elements from a read of many
        (:meth:`elements`), any other read through ``via`` (a full decode, which makes the
        template)."""
        got = self.fill_rows(request.tensors, request.out, request.dsts,
                             checksums=request.checksums)
        rest = [i for i, g in enumerate(got) if g is None]
        if not request.strict or not rest:
            return got
        self._chunk_by_chunk(request, rest, via, lambda items: (
            None if g is None else g[0]
            for g in self._from_templates(items, checksums=request.checksums)))
        for i in rest:
            got[i] = 0
        return got

    def fill_rows(self, tensors: Sequence[Tensor], out: bytearray, dsts: Sequence[int], *,
                  checksums: bool = False) -> list[int | None]:
        """Each tensor of row chunks (``Shard(0)``) made whole in ``out`` at ``dsts[i]``,
        many small chunks at once with nothing done per chunk in Python. Per tensor: the
        stored bytes whose CRC-32s were checked with it (``checksums``; else 0), or None
        where it was not made whole (another layout, a record unlike its template, a failed
        checksum): :meth:`_whole` then reads it chunk by chunk."""
        # Object storage reads the ranges a merge planned, ahead (formats/remote.py): the
        # chunk by chunk path asks for exactly those.
        if not self._use_templates or self.capabilities.many_ranges:
            return [None] * len(tensors)
        return fill_rows(tensors, out, dsts, checksums=checksums, templates=self._templates,
                         pread=self.store.pread, readinto=self.store.readinto,
                         decode=self._decode)

    def other_checksums(self) -> tuple[list[Checksummed], list[Problem]]:
        """The entries of every non-tensor record (their pickles) whose file holds them, and
        every copy of a replicated chunk or record that another rank stored too."""
        sums: list[Checksummed] = []
        problems: list[Problem] = []
        nested = self.detail.nested
        if nested is not None and nested.records:
            covered = {(c.file, c.crc_span[0]) for t in self.info.tensors for c in t.chunks
                       if c.crc_span is not None}
            for file, offset, length in nested.records:
                where = self.where(file, offset, "a record of nested values")
                try:
                    entries = record_entries(self._pread(file), offset=offset, length=length,
                                             where=where)
                except InputError as e:
                    problems.append(error("record-corrupt", str(e), file=file, offset=offset))
                    continue
                sums += [Checksummed(file, e.data_offset, e.size, e.crc32,
                                     f"record entry '{e.name}'") for e in entries
                         if (file, e.data_offset) not in covered]
        objects = list(self.info.objects) + [c.other for c in self.detail.copies
                                             if isinstance(c.other, ObjectEntry)]
        for o in objects:
            if o.file is None or not self._present(o.file, o.offset + o.length):
                continue  # missing or truncated: a structure problem already
            where = self.where(o.file, o.offset, f"entry '{o.name}'")
            try:
                pread, rel = self._object_bytes(o)
                entries = record_entries(pread, offset=rel.offset, length=rel.length,
                                         where=where)
            except InputError as e:
                problems.append(error("record-corrupt", str(e), file=o.file, offset=o.offset))
                continue
            if rel is o:
                sums += [Checksummed(o.file, e.data_offset, e.size, e.crc32,
                                     f"record entry '{e.name}'") for e in entries]
            else:
                sums += [Checksummed(o.file, o.offset, e.size, e.crc32,
                                     f"record entry '{e.name}', decompressed",
                                     pread(e.size, e.data_offset)) for e in entries]
        tensors = {t.name: t for t in self.info.tensors} if self.detail.copies else {}
        for copy in self.detail.copies:
            c = copy.other
            if not isinstance(c, Chunk) or not self._present(c.file, c.end):
                continue
            t = tensors[copy.name]
            try:
                p = self.payload(t, c, checksums=True)
            except InputError as e:
                problems.append(error("record-corrupt", str(e), file=c.file, tensor=t.name,
                                      offset=c.offset))
                continue
            sums += p.side
            if p.crc32 is not None:
                sums.append(Checksummed(c.file, p.storage_offset, p.storage_size, p.crc32,
                                        f"tensor '{t.name}', the copy listed in "
                                        f"{copy.other_from}"))
        return sums, problems

    def _present(self, file: str, end: int) -> bool:
        size = self._sizes.get(file)
        return size is not None and end <= size

    @functools.cached_property
    def _sizes(self) -> dict[str, int | None]:
        return {f.name: f.size for f in self.info.files}

    def check_copies(self) -> list[Problem]:
        """Each chunk (and non-tensor record) several ranks stored against the copy the
        checkpoint uses, byte for byte, in blocks."""
        problems: list[Problem] = []
        tensors = {t.name: t for t in self.info.tensors} if self.detail.copies else {}
        for copy in self.detail.copies:
            kept, other = copy.kept, copy.other
            ends = [(x.file, x.end if isinstance(x, Chunk) else x.offset + x.length)
                    for x in (kept, other)]
            if not all(f is not None and self._present(f, e) for f, e in ends):
                continue  # missing or truncated: a structure problem already
            try:
                if isinstance(kept, Chunk) and isinstance(other, Chunk):
                    at = _first_difference(self._chunk_blocks(tensors[copy.name], kept),
                                           self._chunk_blocks(tensors[copy.name], other))
                    what = f"tensor '{copy.name}', chunk at offsets {list(kept.offsets)}"
                else:
                    assert isinstance(kept, ObjectEntry) and isinstance(other, ObjectEntry)
                    at = self._object_difference(kept, other)
                    what = f"entry '{copy.name}'"
            except InputError as e:  # a damaged copy: verify's CRCs name it too
                problems.append(error("record-corrupt", str(e), file=other.file,
                                      tensor=copy.name, offset=other.offset))
                continue
            if at is None:
                continue
            problems.append(error(
                "copy-differs",
                f"{self.info.root}: {what} is stored by several ranks, and the copies differ "
                f"(from byte {at}): {other.file} at byte {other.offset} (listed in "
                f"{copy.other_from}) and {kept.file} at byte {kept.offset} (listed in "
                f"{copy.kept_from}). The ranks saved different values without coordination "
                "(dcp.save(use_collectives=False)) or a copy is damaged; ckpttool verify "
                "names damaged records",
                file=other.file, tensor=copy.name, offset=other.offset))
        return problems

    def _chunk_blocks(self, tensor: Tensor, chunk: Chunk) -> Iterator[bytes]:
        """The chunk's elements in C order, in blocks of ``_COMPARE_BLOCK`` bytes."""
        n = chunk.numel * tensor.dtype.itemsize
        p = self.payload(tensor, chunk)
        if p.start is not None:
            for at in range(0, n, _COMPARE_BLOCK):
                yield self.store.read_exact(p.file, p.start + at, min(_COMPARE_BLOCK, n - at),
                                            what=f"tensor '{tensor.name}'")
            return
        data = self.read_chunk(tensor, chunk)  # a compressed record or a strided view
        for at in range(0, n, _COMPARE_BLOCK):
            yield data[at : at + _COMPARE_BLOCK]

    def _object_difference(self, kept: ObjectEntry, other: ObjectEntry) -> int | None:
        """Where two copies of a non-tensor record first differ (None: they do not). A record
        is compared decompressed, whole (records of non-tensor entries are small)."""
        def record(o: ObjectEntry) -> bytes:
            pread, rel = self._object_bytes(o)
            return pread(rel.length, rel.offset)

        return _first_difference(iter([record(kept)]), iter([record(other)]))

    def read_object(self, entry: ObjectEntry) -> Any:
        if entry.file is None:
            return super().read_object(entry)
        where = self.where(entry.file, entry.offset, f"entry '{entry.name}'")
        pread, rel = self._object_bytes(entry)
        return read_object(pread, rel, where=where)

    def object_record(self, entry: ObjectEntry) -> bytes | None:
        if entry.file is None:
            return None
        if (entry.file, entry.offset) in self.detail.compressed_objects:
            pread, rel = self._object_bytes(entry)
            return pread(rel.length, rel.offset)  # a DCP writer stores it uncompressed
        return self.store.read_exact(entry.file, entry.offset, entry.length,
                                     what=f"entry '{entry.name}'")


# Bytes of two copies compared at a time.
_COMPARE_BLOCK = 16 << 20


def _slice(data: bytes | bytearray, size: int, offset: int) -> bytes:
    """``pread(size, offset)`` over bytes in memory."""
    return bytes(memoryview(data)[offset : offset + size])


def _first_difference(a: Iterator[bytes], b: Iterator[bytes]) -> int | None:
    """The first byte at which two equally cut block streams differ; None if they do not."""
    done = 0
    for x, y in itertools.zip_longest(a, b):
        if x is None or y is None:
            return done
        if x != y:
            return done + next((i for i, (u, v) in enumerate(zip(x, y, strict=False))
                                if u != v), min(len(x), len(y)))
        done += len(x)
    return None


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> DcpReader:
    return DcpReader(info, store)
