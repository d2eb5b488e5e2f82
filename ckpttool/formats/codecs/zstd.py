"""zstd-compressed byte ranges, decompressed in memory one record at a time.

PyTorch DCP's ``ZStandard`` stream extension (``FileSystemWriter(_extensions=[ZStandard()])``,
descriptor ``stream.zstd/1``) compresses each record on its own into one zstd frame, written
with the ``zstandard`` library's defaults: no content size, no frame checksum. So nothing
says how large a record is until it is decompressed, and nothing but the record's own contents
(a ``torch.save`` archive's CRC-32s) checks it.

The ``zstandard`` library is optional (``pip install 'ckpttool[zstd]'``) and imported only
when a compressed record is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckpttool import settings
from ckpttool.errors import InputError, UnsupportedError

NAME = "zstd"
DESCRIPTOR = "stream.zstd"  # torch's ExtensionRegistry name; "/1" is the version
INSTALL = "pip install 'ckpttool[zstd]'"

# Compressed bytes fed to the decompressor per call. zstd expands a block of 4 bytes into at
# most 128 KB (an RLE block), so one call yields at most 32768 times its input: 128 MB here.
# The output is checked against the caller's limit after every call, so a record that claims
# more than it may never holds more than ``limit`` plus that in memory.
_FEED = 4096
# Compressed bytes read from the file per pread.
_READ = 1 << 20


# How much larger than its compressed bytes a record may claim to be before it is refused
# unread, and from what size on. Tensors of trained weights compress by 1.1-1.5x; a claim of
# gigabytes from kilobytes is a decompression bomb (zstd turns 4 bytes into 128 KB), unless
# the tensor is constant (zeros): CKPTTOOL_ZSTD_MAX_RATIO raises the bound for those.
MAX_RATIO = 1024
RATIO_FLOOR = 64 << 20


def max_ratio() -> int:
    """The ratio bound: ``CKPTTOOL_ZSTD_MAX_RATIO`` (a positive integer), else
    :data:`MAX_RATIO`."""
    return settings.zstd_max_ratio() or MAX_RATIO


def check_claim(claim: int, length: int, *, where: str) -> None:
    """Refuse a record that claims to decompress to ``claim`` bytes from ``length``
    compressed ones, past :func:`max_ratio` (and :data:`RATIO_FLOOR`), before any memory is
    taken for it.

    Raises:
        InputError: the claim is past the bound (the message says how to allow it).
    """
    ratio = max_ratio()
    if claim > RATIO_FLOOR and claim > max(length, 1) * ratio:
        raise InputError(f"{where}: the metadata claims {claim:,} bytes from {length:,} "
                         f"compressed ones, more than {ratio}x; refused as a likely "
                         "decompression bomb (for a constant tensor that truly compresses "
                         "so well, set CKPTTOOL_ZSTD_MAX_RATIO higher)")


def supported(descriptor: str) -> bool:
    """True for the zstd descriptors ckpttool reads (``stream.zstd/1``, any 1.x)."""
    name, _, version = descriptor.partition("/")
    return name == DESCRIPTOR and version.partition(".")[0] == "1"


def _library(where: str) -> Any:
    try:
        import zstandard
    except ImportError as err:
        raise UnsupportedError(
            f"{where}: records are zstd-compressed (DCP's ZStandard extension); reading them "
            f"needs the zstandard library: {INSTALL}") from err
    return zstandard


def available() -> bool:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


def inflate(pread: Callable[[int, int], bytes], offset: int, length: int, *, limit: int,
            where: str) -> bytearray:
    """The decompressed bytes of the one zstd frame that fills ``length`` bytes at ``offset``,
    decompressed :data:`_FEED` compressed bytes at a time into one buffer (never copied: the
    record's real size is all it takes, however much is claimed).

    Args:
        pread: ``pread(size, offset)`` of the file (fewer bytes at its end).
        limit: the most bytes the record may decompress to; more is corruption.
        where: the record, for messages (file, offset, what it holds).

    Raises:
        InputError: the frame is truncated, corrupt, followed by other bytes, or larger than
            ``limit``.
        UnsupportedError: the ``zstandard`` library is not installed.
    """
    zstandard = _library(where)
    dobj = zstandard.ZstdDecompressor().decompressobj()
    out = bytearray()
    done = 0
    while done < length:
        piece = pread(min(_READ, length - done), offset + done)
        if not piece:
            raise InputError(f"{where}: the file ends inside this compressed record; it is "
                             "truncated")
        done += len(piece)
        for at in range(0, len(piece), _FEED):
            if dobj.eof:
                raise InputError(f"{where}: bytes follow the end of the record's zstd frame; "
                                 "corrupt")
            try:
                out += dobj.decompress(piece[at : at + _FEED])
            except zstandard.ZstdError as e:
                raise InputError(f"{where}: does not decompress ({e}); the compressed record "
                                 "is corrupt") from e
            except MemoryError as err:
                raise InputError(f"{where}: decompressing it needs more memory than this "
                                 f"process may take ({len(out):,} bytes so far)") from err
            if len(out) > limit:
                raise InputError(f"{where}: decompresses to more than the {limit} bytes it "
                                 "may hold; the compressed record is corrupt")
    if not dobj.eof:
        raise InputError(f"{where}: the record's zstd frame is incomplete (it ends after "
                         f"{length} compressed bytes); the record is truncated or corrupt")
    if dobj.unused_data:
        raise InputError(f"{where}: bytes follow the end of the record's zstd frame; corrupt")
    return out
