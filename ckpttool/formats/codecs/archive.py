"""``torch.save``'s container: an uncompressed zip whose headers give each entry's offset,
size and CRC-32, so data is located (and checked) without reading it and without torch. A
``.bin``/``.pt`` file is one archive; a DCP ``.distcp`` file is a concatenation of them.
Reads are bounded by what the file holds: a size field of a damaged file may claim gigabytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpttool.errors import InputError, UnsupportedError

if TYPE_CHECKING:
    from ckpttool.storage.store import Stores

ZIP_MAGIC = b"PK\x03\x04"


@contextlib.contextmanager
def opened(path: Path, stores: Stores) -> Iterator[tuple[Callable[[int, int], bytes], int]]:
    """``pread(size, offset)`` and the size of the file ``path`` (a rank's or a DeepSpeed
    state's archive), read through ``stores`` while the block runs.

    Raises:
        InputError: missing, not a regular file, or unreadable.
    """
    size = stores.file_size(path)
    if size is None:
        if path.name in stores.listdir(path.parent):
            raise InputError(f"{path}: not a regular file; copy the checkpoint again")
        raise InputError(f"{path}: cannot read: {os.strerror(errno.ENOENT)}")
    with contextlib.ExitStack() as stack:
        try:
            pread = stack.enter_context(stores.reading(path))
        except OSError as e:
            raise InputError(f"{path}: cannot read: {e.strerror}") from e
        yield pread, size


def is_zip(path: Path, stores: Stores) -> bool:
    """Whether ``path`` starts as a zip archive (``torch.save``'s container) does; False
    where it cannot be read."""
    try:
        with stores.reading(path) as pread:
            return pread(4, 0) == ZIP_MAGIC
    except (OSError, InputError):
        return False


# The zip end-of-central-directory record: torch.save writes it last, with no comment after it.
_END_RECORD = b"PK\x05\x06"
_END_RECORD_SIZE = 22


def pending_file(file: str | os.PathLike[str]) -> str | None:
    """Why the zip archive at ``file`` is still being written (its end record, which
    ``torch.save`` writes last, is not at its end yet); None when it is there, or when the
    file is no zip at all (not ours to judge: reading it says what is wrong)."""
    try:
        with open(file, "rb") as f:
            if f.read(4) != ZIP_MAGIC:
                return None
            size = os.fstat(f.fileno()).st_size
            if size < _END_RECORD_SIZE:
                return f"{os.path.basename(file)}: {size} bytes, still being written"
            f.seek(size - _END_RECORD_SIZE)
            tail = f.read(_END_RECORD_SIZE)
    except OSError:
        return None
    if tail[:4] != _END_RECORD:
        return f"{os.path.basename(file)}: no zip end record yet (torch.save writes it last)"
    return None



# --------------------------------------------------------------------------------------------
# The zip container


_EOCD = struct.Struct("<4sHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_HEAD_BYTES = 4096


@dataclass(frozen=True)
class ZipEntry:
    """One stored entry of an archive, its name without the archive's top folder."""

    name: str  # "data.pkl", "data/0", "byteorder"...
    data_offset: int  # relative to the archive start
    size: int
    crc32: int  # as the zip headers record it
    # Where the headers store this entry's CRC-32 (central directory first) and the data
    # descriptor after its data, relative to the archive start: what differs between two
    # records of one layout, besides entry contents (see dcp's record templates).
    crc_fields: tuple[int, ...] = ()
    descriptor: tuple[int, int] = (0, 0)  # (offset, length); length 0 without one


def _bounded_pread(fd: int) -> Callable[[int, int], bytes]:
    """``pread(size, offset)`` of ``fd`` that asks for no more than the file holds:
    ``os.pread`` allocates the size it is given before reading, and a size field of a
    damaged file may claim gigabytes."""
    end = os.fstat(fd).st_size

    def pread(size: int, offset: int) -> bytes:
        return os.pread(fd, max(0, min(size, end - offset)), offset)

    return pread


class RecordBytes:
    """Reads parts of one archive with as few ``pread`` calls as the layout allows."""

    def __init__(self, fd: int | Callable[[int, int], bytes], start: int, length: int,
                 where: str) -> None:
        # ``fd``: an open file, or ``pread(size, offset)`` of a store's file (which never
        # reads, nor allocates, past the file's end).
        self.pread = fd if callable(fd) else _bounded_pread(fd)
        self.start, self.length, self.where = start, length, where
        self.head = self.pread(min(length, _HEAD_BYTES), start)
        tail_len = min(length, _HEAD_BYTES)
        self.tail_start = length - tail_len
        self.tail = self.pread(tail_len, start + self.tail_start)
        if len(self.head) < min(length, _HEAD_BYTES) or len(self.tail) < tail_len:
            raise InputError(f"{where}: file ends inside this record; it is truncated")

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0 or offset + size > self.length:
            raise InputError(f"{self.where}: record header points outside the record; corrupt")
        if offset + size <= len(self.head):
            return self.head[offset : offset + size]
        if offset >= self.tail_start:
            return self.tail[offset - self.tail_start : offset - self.tail_start + size]
        data = self.pread(size, self.start + offset)
        if len(data) < size:
            raise InputError(f"{self.where}: file ends inside this record; it is truncated")
        return data



# A data descriptor: CRC and sizes, with or without its signature, 32- or 64-bit sizes.
_DESCRIPTOR_SIZES = (12, 16, 20, 24)


def zip_entries(rb: RecordBytes) -> dict[str, ZipEntry]:
    """The entries of the archive ``rb`` reads, from its central directory (headers only).

    Raises:
        InputError: no zip end record, or a corrupt directory or entry header.
        UnsupportedError: a compressed entry (torch.save never compresses).
    """
    where = rb.where
    tail = rb.tail
    pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 and rb.length > len(tail):  # a zip comment pushed the end record further back
        wider = min(rb.length, 65536 + _EOCD.size)
        rb.tail_start = rb.length - wider
        rb.tail = tail = rb.pread(wider, rb.start + rb.tail_start)
        pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 or pos + _EOCD.size > len(tail):
        raise InputError(
            f"{where}: not a torch.save record (no zip end record); corrupt or truncated"
        )
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, pos)
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        loc_pos = rb.tail_start + pos - _ZIP64_LOCATOR.size
        sig, _, z64_offset, _ = _ZIP64_LOCATOR.unpack(rb.read(loc_pos, _ZIP64_LOCATOR.size))
        if sig != b"PK\x06\x07":
            raise InputError(f"{where}: corrupt zip64 locator in torch.save record")
        fields = _ZIP64_EOCD.unpack(rb.read(z64_offset, _ZIP64_EOCD.size))
        if fields[0] != b"PK\x06\x06":
            raise InputError(f"{where}: corrupt zip64 end record in torch.save record")
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
    cd = rb.read(cd_offset, cd_size)
    entries: dict[str, ZipEntry] = {}
    spans: list[tuple[int, int, str, bool]] = []  # (local header, end of data, name, descriptor)
    p = 0
    for _ in range(count):
        if p + _CENTRAL.size > len(cd):
            raise InputError(f"{where}: corrupt zip directory in torch.save record")
        (sig, _, _, _, method, _, _, crc, csize, usize, nlen, elen, clen, _, _, _, local) = (
            _CENTRAL.unpack_from(cd, p)
        )
        if sig != b"PK\x01\x02":
            raise InputError(f"{where}: corrupt zip directory in torch.save record")
        name = cd[p + _CENTRAL.size : p + _CENTRAL.size + nlen].decode("utf-8", "replace")
        central_crc = cd_offset + p + 16
        extra = cd[p + _CENTRAL.size + nlen : p + _CENTRAL.size + nlen + elen]
        usize, csize, local = _zip64_extra(extra, usize, csize, local)
        p += _CENTRAL.size + nlen + elen + clen
        if method != 0:
            raise UnsupportedError(f"{where}: record entry '{name}' is compressed; not supported")
        lh = rb.read(local, _LOCAL.size)
        lsig, _, flags, *_rest = _LOCAL.unpack(lh)
        if lsig != b"PK\x03\x04":
            raise InputError(f"{where}: corrupt zip entry '{name}' in torch.save record")
        lnlen, lelen = _rest[-2], _rest[-1]
        short = name.split("/", 1)[1] if "/" in name else name
        data_offset = local + _LOCAL.size + lnlen + lelen
        # An entry must lie inside its record: a bad header must never point at a neighbour.
        if data_offset + usize > rb.length or csize != usize:
            raise InputError(f"{where}: zip entry '{name}' reaches past the end of its "
                             "torch.save record; corrupt")
        entries[short] = ZipEntry(short, data_offset, usize, crc, (central_crc, local + 14))
        spans.append((local, data_offset + usize, name, bool(flags & 0x08)))
    # torch.save writes entries back to back (header, data, data descriptor when flag bit 3 is
    # set), then the directory: a header that moves an entry's data (a flipped length byte)
    # breaks that and is caught here, before any byte is copied.
    if not spans:
        raise InputError(f"{where}: torch.save record with no entries; corrupt")
    spans.sort()
    for (_, end, name, descriptor), nxt in zip(
            spans, [s[0] for s in spans[1:]] + [cd_offset], strict=True):
        if nxt - end not in (_DESCRIPTOR_SIZES if descriptor else (0,)):
            raise InputError(f"{where}: zip entry '{name}' does not end where the next entry "
                             "of its torch.save record begins; corrupt")
        if descriptor:
            short = name.split("/", 1)[1] if "/" in name else name
            entries[short] = dataclasses.replace(entries[short], descriptor=(end, nxt - end))
    return entries


def _zip64_extra(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    p = 0
    while p + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, p)
        if tag == 1:
            q = p + 4
            if usize == 0xFFFFFFFF:
                (usize,) = struct.unpack_from("<Q", extra, q)
                q += 8
            if csize == 0xFFFFFFFF:
                (csize,) = struct.unpack_from("<Q", extra, q)
                q += 8
            if local == 0xFFFFFFFF:
                (local,) = struct.unpack_from("<Q", extra, q)
        p += 4 + size
    return usize, csize, local


def check_byteorder(rb: RecordBytes, entries: dict[str, ZipEntry]) -> None:
    """Raises UnsupportedError for a big-endian archive, InputError for a damaged entry."""
    order = entries.get("byteorder")
    value = rb.read(order.data_offset, order.size) if order is not None else b"little"
    if value == b"big":
        raise UnsupportedError(f"{rb.where}: big-endian torch.save record; not supported")
    if value != b"little":
        raise InputError(f"{rb.where}: byteorder entry holds {value[:16]!r}, neither little nor "
                         "big; corrupt")


def open_file_archive(fd: int | Callable[[int, int], bytes], where: str, damaged: str, *,
                      size: int | None = None
                      ) -> tuple[RecordBytes, dict[str, ZipEntry]]:
    """A whole ``torch.save`` file open at ``fd``: zip magic, entries and byte order checked.

    Args:
        fd: an open file, or ``pread(size, offset)`` of one of ``size`` bytes (which never
            reads past its end).
        damaged: what to do, said after "not a torch.save file (no zip header); ".

    Raises:
        InputError: no zip header, damaged entries; UnsupportedError: big-endian.
    """
    pread = fd if callable(fd) else _bounded_pread(fd)
    if pread(4, 0) != ZIP_MAGIC:
        raise InputError(f"{where}: not a torch.save file (no zip header); {damaged}")
    if size is None:
        assert not callable(fd), "a pread comes with its file's size"
        size = os.fstat(fd).st_size
    rb = RecordBytes(pread, 0, size, where)
    entries = zip_entries(rb)
    check_byteorder(rb, entries)
    return rb, entries
