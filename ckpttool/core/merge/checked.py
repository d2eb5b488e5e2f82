"""A merge checks the CRC-32 each stored record carries as it reads or copies the record
(``merge --no-check-crc`` skips it): a byte flipped in a record after it was written stops
the merge with exit 3, naming the tensor, the file and the byte offset, and nothing is
published.

:class:`CheckedReader` wraps the checkpoint's reader, so every path of the engine (kernel
copies, casts, batches of small chunks, windows of small tensors, derived tensors, a share
of a merge that several processes write) gets checked payloads without a branch of its
own: every chunk's bytes reach the engine through :meth:`Reader.read` (a
:class:`~ckpttool.formats.base.Decode`, :class:`~ckpttool.formats.base.Elements` or
:class:`~ckpttool.formats.base.Whole` request), which checks here before it hands anything
on.

A payload's stored bytes are read once more to check them when decoding did not read them
already (a large record, copied file to file in the kernel). Local files come mapped from
the page cache that the copy reads anyway, CRC-32 at memory speed with the ``fast`` extra
(zlib-ng); object storage reads them from the range the store fetched ahead for the copy.
A large record read by several output tensors (a Megatron layer stack) is checked once.
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ckpttool.core.runtime import scratch
from ckpttool.errors import InputError
from ckpttool.formats.base import (
    Blocks,
    Checksummed,
    Chunk,
    Decode,
    Elements,
    ObjectEntry,
    Payload,
    Problem,
    Reader,
    Request,
    Tensor,
    Whole,
)
from ckpttool.formats.codecs.crc import crc32
from ckpttool.storage.store import Capabilities

__all__ = ["CheckedReader", "checked"]

# Blocks of this size are read to check a record that is not mapped (object storage)...
_BLOCK = 2 << 20
# ...and mapped, for a local file's: one mapping per 64 MB instead of per 2 MB took 0.31
# instead of 0.57 s of CPU per 0.75 GB (benchmarks/merge_crc.py's checkpoint, page cache warm).
_MAPPED_BLOCK = 64 << 20
_anonymous = threading.local()
# Records at least this large are remembered once checked (a smaller one costs less to check
# again than a million remembered records would take in memory).
_REMEMBER = 1 << 20

NO_CHECK_FLAG = "--no-check-crc"


def checked(reader: Reader, *, check_crc: bool) -> Reader:
    """``reader`` itself, or wrapped so that every record it hands on is checked first."""
    return CheckedReader(reader) if check_crc else reader


class CheckedReader(Reader):
    """Every method of :class:`Reader` passed on to ``inner``; :meth:`read`, where it hands
    on a chunk's bytes, checks the CRC-32s of its record first.

    Raises (from the methods that hand on a chunk):
        InputError: a stored CRC-32 does not match the bytes.
    """

    def __init__(self, inner: Reader) -> None:  # noqa: D107 - no super(): state is inner's
        self.inner = inner
        self.info = inner.info
        self.store = inner.store
        self._done: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    # -- checking

    def _check(self, tensor: Tensor, payload: Payload) -> None:
        if payload.crc32 is not None:
            key = (payload.file, payload.storage_offset)
            large = payload.data is None and payload.storage_size >= _REMEMBER
            if not (large and key in self._done):
                got = (crc32(payload.data) if payload.data is not None else
                       self._crc_of(payload.file, payload.storage_offset, payload.storage_size,
                                    tensor))
                if got != payload.crc32:
                    raise self._mismatch(tensor, payload.file, payload.storage_offset, got,
                                         payload.crc32, "its stored bytes")
                if large:
                    with self._lock:
                        self._done.add(key)
        for s in payload.side:
            self._check_side(tensor, s)

    def _check_side(self, tensor: Tensor, s: Checksummed) -> None:
        got = crc32(s.data) if s.data is not None else self._crc_of(s.file, s.offset, s.size,
                                                                      tensor)
        if got != s.crc32:
            raise self._mismatch(tensor, s.file, s.offset, got, s.crc32, s.what)

    def _crc_of(self, file: str, offset: int, size: int, tensor: Tensor) -> int:
        crc = 0
        done = 0
        for view in self.inner.read(Blocks(file, offset, size, self._buffer(size))):
            crc = crc32(view, crc)
            done += len(view)
        if done != size:
            raise InputError(f"{self.inner.path(file)}: ends at byte {offset + done}, inside "
                             f"tensor '{tensor.name}'; it is truncated. Copy the checkpoint "
                             "again from a good source")
        return crc

    def _buffer(self, size: int) -> memoryview:
        """What a :class:`~ckpttool.formats.base.Blocks` request reads into, and whose length
        sets its block size. Local files are mapped, never read into it, where they are
        large; an anonymous mapping's pages take no memory until written, so a 64 MB one
        costs nothing there."""
        if not self.capabilities.local_files:
            return scratch.buffer("crc", min(size, _BLOCK))
        held: mmap.mmap | None = getattr(_anonymous, "map", None)
        if held is None:
            # Private: a forked child writes into its own copy, never the parent's.
            held = _anonymous.map = mmap.mmap(-1, _MAPPED_BLOCK, flags=mmap.MAP_PRIVATE)
        return memoryview(held)[: min(size, _MAPPED_BLOCK)]

    def _mismatch(self, tensor: Tensor, file: str, offset: int, got: int, want: int,
                  what: str) -> InputError:
        return InputError(
            f"{self.inner.path(file)} at byte {offset} (tensor '{tensor.name}', {what}): "
            f"CRC-32 of the stored bytes is {got:08x} but the record says {want:08x}; the "
            "bytes changed after they were written (bit rot, a bad copy) and nothing was "
            "written. Copy the checkpoint again from a good source (ckpttool verify lists "
            f"every damaged record), or pass {NO_CHECK_FLAG} to merge it as it is")

    # -- the one data verb: what hands on a chunk's bytes is checked first

    def read(self, request: Request) -> Any:
        match request:
            case Decode(items, _):
                return self._checked_payloads(items)
            case Elements(tensor, chunk):
                self._check(tensor, next(self.inner.read(Decode(((tensor, chunk),), True))))
                return self.inner.read(request)
            case Whole():
                # Made whole with every record's CRC-32s checked; a tensor whose records fail
                # is read chunk by chunk through this wrapper (Elements), which says what is
                # wrong.
                return self.inner.read(dataclasses.replace(request, checksums=True, via=self))
        return self.inner.read(request)

    def _checked_payloads(self, items: Sequence[tuple[Tensor, Chunk]]) -> Iterator[Payload]:
        for (tensor, _), p in zip(items, self.inner.read(Decode(items, checksums=True)),
                                  strict=True):
            self._check(tensor, p)
            yield p

    # The steps, for a caller that holds this reader: through read(), so checked too.

    def payload(self, tensor: Tensor, chunk: Chunk, *, checksums: bool = False) -> Payload:
        got: Iterator[Payload] = self.read(Decode(((tensor, chunk),), checksums))
        return next(got)

    def payloads(self, items: Sequence[tuple[Tensor, Chunk]], *, checksums: bool = False
                 ) -> Iterator[Payload]:
        got: Iterator[Payload] = self.read(Decode(items, checksums))
        return got

    def read_chunk(self, tensor: Tensor, chunk: Chunk) -> bytes:
        got: bytes = self.read(Elements(tensor, chunk))
        return got

    # -- everything else, passed on

    def __enter__(self) -> CheckedReader:
        return self

    def close(self) -> None:
        self.inner.close()

    def open_files(self) -> None:
        self.inner.open_files()

    def where(self, file: str, offset: int, what: str) -> str:
        return self.inner.where(file, offset, what)

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def path(self, file: str) -> Path:
        return self.inner.path(file)

    def plan_reads(self, reads: list[tuple[str, int, int]]) -> None:
        self.inner.plan_reads(reads)

    def check_copies(self) -> list[Problem]:
        return self.inner.check_copies()

    def other_checksums(self) -> tuple[list[Checksummed], list[Problem]]:
        return self.inner.other_checksums()

    def check_file_digests(self) -> list[Problem]:
        return self.inner.check_file_digests()

    def read_object(self, entry: ObjectEntry) -> Any:
        return self.inner.read_object(entry)

    def object_record(self, entry: ObjectEntry) -> bytes | None:
        return self.inner.object_record(entry)

    def __getattr__(self, name: str) -> Any:
        # A format's own methods (not Reader's): the inner reader's.
        return getattr(self.inner, name)
