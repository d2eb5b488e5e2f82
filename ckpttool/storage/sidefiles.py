"""A checkpoint's small files other than its data (a format's trackers, metadata JSON,
pickled common state, ``.metadata``; config and tokenizer files), opened once and checked
before they are read.

Every such file is named by a checkpoint a stranger may have made, so before it is opened
its kind and size are looked at (``stat``): a FIFO (``open`` would wait for a writer for
ever), a socket, a device (``/dev/zero`` never ends; opening some devices does something) or
a directory is refused, and so is a file larger than the cap for its kind (an 8 GB sparse
"config" is refused without a byte read). It is then opened without blocking and checked
again on the descriptor, which is what is read: a file swapped between the look and the open
is seen. Each refusal is one line (:class:`~ckpttool.errors.InputError`, exit 3).

Callers pass a :class:`Kind`: what the file is for messages, and its cap (a format's own
kinds live with the format, e.g. DCP's ``.metadata``).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ckpttool.errors import InputError, UnreadableError


@dataclass(frozen=True)
class Kind:
    """A kind of side file: ``what`` it is (for messages) and the most bytes one may hold."""

    what: str
    limit: int


# The caps, by kind (generous: each is far above what its writer produces).
TRACKER = Kind("tracker file (an iteration number or tag)", 4 << 10)
METADATA_JSON = Kind("metadata JSON file", 64 << 20)
COMMON_STATE = Kind("pickled common state", 1 << 30)
HF_FILE = Kind("config or tokenizer file", 256 << 20)

# Open flags: never wait on a FIFO, never make a terminal ours.
_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)

_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
          (stat.S_ISDIR, "directory"))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("FIFO", "regular file"...)."""
    return next((name for test, name in _KINDS if test(mode)), "regular file"
                if stat.S_ISREG(mode) else "special file")


def _check(path: Path, st: os.stat_result, kind: Kind) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: is a {kind_of(st.st_mode)}, not a regular file; a "
                         f"{kind.what} must be one, and ckpttool never reads from anything "
                         "else: put the checkpoint's file there")
    check_size(path, st.st_size, kind)


def check_size(path: Path | str, size: int, kind: Kind) -> None:
    """Refuse a side file of ``size`` bytes over ``kind``'s cap (a local one's, or a remote
    one's listed size)."""
    if size > kind.limit:
        raise InputError(f"{path}: {size:,} bytes, more than the {kind.limit:,} a "
                         f"{kind.what} may hold; it is not the writer's file: copy the "
                         "checkpoint again")


def open_checked(path: Path, kind: Kind, *, nofollow: bool = False) -> int:
    """A descriptor of ``path``, a regular file within ``kind``'s cap, checked by name
    before the open and on the descriptor after it.

    Args:
        nofollow: refuse a link (``ELOOP``) instead of reading its target.

    Raises:
        FileNotFoundError: it is not there (callers say what that means).
        UnreadableError: this user may not read it.
        InputError: not a regular file, over the cap, or unreadable.
    """
    try:
        _check(path, os.lstat(path) if nofollow else os.stat(path), kind)
        fd = os.open(path, _FLAGS | (getattr(os, "O_NOFOLLOW", 0) if nofollow else 0))
    except FileNotFoundError:
        raise
    except PermissionError as e:
        raise UnreadableError.of(path, e) from None
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e}); copy the checkpoint "
                         "again") from None
    try:
        _check(path, os.fstat(fd), kind)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, path: Path, kind: Kind) -> bytes:
    """Every byte of the open file ``fd`` (see :func:`read_file`)."""
    with open(fd, "rb", buffering=0, closefd=False) as f:
        return read_file(f, path, kind)


def read_file(f: BinaryIO, path: Path, kind: Kind) -> bytes:
    """Every byte of the open file ``f`` (at most ``kind.limit``; a file that grew past it
    since it was checked is refused). The size checked is allocated at once, so a file this
    process cannot hold is a ``MemoryError`` before a byte is read.

    Raises:
        MemoryError: the file is larger than this process may hold.
        InputError: unreadable, or grew past the cap.
    """
    parts: list[bytes] = []
    total = 0
    try:
        want = min(f.seek(0, 2), kind.limit)
        f.seek(0)
        while total < want:  # one read, unless the system returns less at a time
            block = f.read(want - total)
            if not block:
                break
            parts.append(block)
            total += len(block)
        while block := f.read(min(1 << 20, kind.limit + 1 - total)):  # grown since
            parts.append(block)
            total += len(block)
            if total > kind.limit:
                raise InputError(f"{path}: grew past the {kind.limit:,} bytes a "
                                 f"{kind.what} may hold while it was read; run again "
                                 "when nothing writes to it")
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e}); copy the checkpoint "
                         "again") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_checked(path: Path, kind: Kind, *, nofollow: bool = False) -> bytes:
    """The bytes of ``path``, opened once by :func:`open_checked`.

    Raises:
        FileNotFoundError, UnreadableError, InputError: as :func:`open_checked`.
    """
    fd = open_checked(path, kind, nofollow=nofollow)
    try:
        return read_fd(fd, path, kind)
    finally:
        os.close(fd)


def parse_json(data: bytes | str, path: Path, *, next_step: str) -> Any:
    """``data`` (read from ``path``) as JSON; any failure one line (nesting too deep for
    the parser included).

    Raises:
        InputError: not JSON, not UTF-8, or nested too deeply; ``next_step`` says what to do.
    """
    try:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except RecursionError:
        raise InputError(f"{path}: not valid JSON (arrays or objects nested too deeply); "
                         f"{next_step}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e}); {next_step}") from None


_ASCII_NUMBER = re.compile(r"[0-9]+")


def ascii_number(text: str) -> int | None:
    """``text`` as a non-negative integer when it is ASCII digits only; None otherwise.
    (``str.isdigit`` and ``int`` take other scripts' digits and superscripts too: ``'٣'`` is
    a digit to both, ``'²'`` to ``isdigit`` only; no writer puts either in a tracker.)"""
    return int(text) if _ASCII_NUMBER.fullmatch(text) else None
