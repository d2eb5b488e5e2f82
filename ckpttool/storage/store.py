"""Where a checkpoint's bytes come from: a store of named files, read by byte range.

Readers never open files themselves: they ask a :class:`Store` for ranges of the files their
metadata names. A store is opened once per checkpoint and shared by worker threads; it can be
asked for many ranges of one file at once (:meth:`Store.read_ranges`), so that a plan that
knows every range it needs can batch them per file (local files today; object storage, where
each request costs a round trip, plugs in here). Positional file I/O helpers used by every
writer live here too, so that input and output share one copy loop.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from ckpttool.errors import InputError, OutputError, UnreadableError

_BLOCK = 64 << 20
_use_copy_file_range = hasattr(os, "copy_file_range")
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


class Store(Protocol):
    """Named files of one checkpoint, read by byte range."""

    def path(self, name: str) -> Path: ...

    def pread(self, name: str, size: int, offset: int) -> bytes: ...

    def open_all(self, names: Iterable[str]) -> None: ...

    def read_exact(self, name: str, offset: int, size: int, *, what: str) -> bytes: ...

    def readinto(self, name: str, offset: int, buf: memoryview) -> int: ...

    def read_ranges(self, name: str, ranges: list[tuple[int, int]], *, what: str
                    ) -> list[bytes]: ...

    def copy_to(self, name: str, offset: int, dst_fd: int, dst_offset: int, size: int
                ) -> None: ...

    def close(self) -> None: ...


class LocalStore:
    """Files below a local directory, each opened once (thread-safe) and read with ``pread``.

    Args:
        base: the directory that names are relative to.
        metadata_name: what references the files, for the "missing" message (".metadata").
    """

    def __init__(self, base: Path, *, metadata_name: str, follow_links: bool = False) -> None:
        self.base = base
        self.metadata_name = metadata_name
        # A data file that is a link out of the checkpoint is refused unless asked for
        # (--follow-links): storage paths are checked by name, a link would sidestep that.
        self._inside = None if follow_links else os.path.realpath(base)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        return self.base / name

    def fd(self, name: str) -> int:
        """The open file ``name``.

        Raises:
            InputError: missing, unreadable or not a regular file.
        """
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                path = self.path(name)
                if self._inside is not None:
                    real = os.path.realpath(path)
                    if os.path.commonpath([real, self._inside]) != self._inside:
                        raise InputError(
                            f"{path}: a link to {real}, outside the checkpoint directory; "
                            "pass --follow-links to read data files through links")
                fd = self._fds[name] = open_data_file(path, self.metadata_name)
        return fd

    def open_all(self, names: Iterable[str]) -> None:
        for name in names:
            self.fd(name)

    def pread(self, name: str, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer at the file's end)."""
        return os.pread(self.fd(name), size, offset)

    def read_exact(self, name: str, offset: int, size: int, *, what: str) -> bytes:
        data = os.pread(self.fd(name), size, offset)
        if len(data) != size:
            raise truncated(self.path(name), offset + len(data), what)
        return data

    def readinto(self, name: str, offset: int, buf: memoryview) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer at the file's end)."""
        return os.preadv(self.fd(name), [buf], offset)

    def read_ranges(self, name: str, ranges: list[tuple[int, int]], *, what: str
                    ) -> list[bytes]:
        """The bytes of each ``(offset, size)`` of ``name``, in the order asked."""
        return [self.read_exact(name, offset, size, what=what) for offset, size in ranges]

    def copy_to(self, name: str, offset: int, dst_fd: int, dst_offset: int, size: int) -> None:
        """Copy ``size`` bytes at ``offset`` into an open output file, in the kernel."""
        copy_range(self.fd(name), offset, dst_fd, dst_offset, size)

    def views(self, name: str, offset: int, size: int, block: int) -> Iterator[memoryview]:
        """The ``size`` bytes at ``offset`` of ``name`` as consecutive views of at most
        ``block`` bytes, mapped from the page cache (no copy; see :func:`read_blocks`); they
        stop early where the file ends."""
        fd = self.fd(name)
        end = min(offset + size, os.fstat(fd).st_size)
        pos = offset
        while pos < end:
            n = min(block, end - pos)
            base = pos - pos % mmap.ALLOCATIONGRANULARITY
            # Copy-on-write: writable views (torch.frombuffer warns on read-only ones) that no
            # write ever reaches the file through. Unmapped when the last view of it goes.
            window = mmap.mmap(fd, pos + n - base, access=mmap.ACCESS_COPY, offset=base)
            yield memoryview(window)[pos - base : pos - base + n]
            del window
            pos += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


# Local directories that stand for remote checkpoints (formats/remote.py's mirrors), with the
# factory of the store that serves their data files: readers ask open_store, never which
# storage a checkpoint is on.
_MIRRORS: dict[Path, Callable[[Path, str], Any]] = {}


def register_mirror(directory: Path, factory: Callable[[Path, str], Any]) -> None:
    """Serve the data files below ``directory`` with ``factory(base, metadata_name)``."""
    _MIRRORS[directory] = factory


def unregister_mirror(directory: Path) -> None:
    _MIRRORS.pop(directory, None)


def open_store(base: Path, *, metadata_name: str, follow_links: bool = False) -> Store:
    """The store of the checkpoint whose files are relative to ``base``: a remote one for a
    mirror of object storage, else a :class:`LocalStore`."""
    factory = _mirror_factory(base)
    if factory is not None:
        store: Store = factory(base, metadata_name)
        return store
    return LocalStore(base, metadata_name=metadata_name, follow_links=follow_links)


def _mirror_factory(path: Path) -> Callable[[Path, str], Any] | None:
    """The store factory of the mirror ``path`` lies in (or is); None for a local path."""
    for directory, factory in list(_MIRRORS.items()):
        if path == directory or directory in path.parents:
            return factory
    return None


@contextlib.contextmanager
def pread_of(path: Path) -> Iterator[Callable[[int, int], bytes]]:
    """``pread(size, offset)`` over one file while the block runs: by ranged reads of its
    store for a data file of a remote checkpoint (its local placeholder holds no data).

    Raises:
        OSError: as ``open`` (FileNotFoundError...).
    """
    if _mirror_factory(path.parent) is not None:
        store = open_store(path.parent, metadata_name=path.name)
        try:
            yield functools.partial(store.pread, path.name)
        finally:
            store.close()
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        yield functools.partial(os.pread, fd)
    finally:
        os.close(fd)


def open_data_file(path: Path, metadata_name: str) -> int:
    """Open a data file that ``metadata_name`` references, for reading.

    Raises:
        UnreadableError: this process may not read it.
        InputError: missing, unreadable, or not a regular file (a FIFO would block).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError as err:
        raise InputError(missing_message(path, metadata_name)) from err
    except PermissionError as e:
        raise UnreadableError.of(path, e) from e
    except OSError as e:
        raise InputError(f"{path}: cannot open data file: {e.strerror}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path}: is not a regular file; {metadata_name} names it as data")
    return fd


def missing_message(path: Path, metadata_name: str, detail: str = "") -> str:
    """The one message for a data file that is not there (``detail``: what it should hold),
    or is there but not a regular file (a FIFO, socket, device or directory: never opened,
    and never called missing, which would send the user looking for a file they can see)."""
    about = f" ({detail})" if detail else ""
    kind = _special_kind(path)
    if kind is not None:
        return (f"{path}: is a {kind}, not a regular file; {metadata_name} references it as a "
                f"data file{about}. ckpttool never reads one: put the checkpoint's file there")
    return (f"{path}: data file is missing; {metadata_name} references it{about}. Copy the "
            "whole checkpoint directory again")


def _special_kind(path: Path) -> str | None:
    """What ``path`` is when it exists but is not a regular file; None otherwise."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISDIR, "directory")):
        if test(mode):
            return kind
    return None


def truncated(path: Path, offset: int, what: str) -> InputError:
    return InputError(f"{path}: ends at byte {offset}, inside {what}; it is truncated. Copy "
                      "the checkpoint again")


def file_size(path: Path) -> int | None:
    """Size of a regular file; None when it is missing (a non-file counts as missing)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


# Ranges at least this large are mapped (:func:`read_blocks`); smaller ones are read: mapping
# and unmapping cost more than copying a few pages.
MAP_MIN = 1 << 20


def read_blocks(store: Store, name: str, offset: int, size: int, buf: memoryview, *,
                mapped: bool = True) -> Iterator[memoryview]:
    """The ``size`` bytes at ``offset`` of ``name``, in consecutive blocks of at most
    ``len(buf)`` bytes, each valid until the next is asked for; fewer bytes in all where the
    file ends first (the caller says so, in its words).

    A local file's large ranges come mapped from the page cache (measured on 6 GB: copying
    them into ``buf`` with ``pread`` took 0.3-1.0 s of system time, mapping 0.1 s); anything
    else (or with ``mapped=False``) is read into ``buf``. A mapped file cut short while it is
    read would end the process (SIGBUS), as for any reader that maps files (safetensors,
    numpy.memmap); its size is checked first.
    """
    views = getattr(store, "views", None) if mapped else None
    if views is not None and size >= MAP_MIN:
        yield from views(name, offset, size, len(buf))
        return
    done = 0
    while done < size:
        n = min(len(buf), size - done)
        got = store.readinto(name, offset + done, buf[:n])
        if got:
            yield buf[:got]
        if got != n:
            return
        done += n


# --------------------------------------------------------------------------------------------
# Positional I/O shared with the writers


def output_error(e: OSError) -> OutputError:
    """A failed write, in the user's terms (the temporary files are removed by the caller)."""
    return OutputError(f"writing the output failed: {e.strerror}; free space (or raise the "
                       "quota or file-size limit) where the output goes, then run again")


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, size: int) -> None:
    """Copy ``size`` bytes between open files at the given offsets, in the kernel when it can.

    Raises:
        InputError: the source ends early. OutputError: the output cannot be written.
    """
    global _use_copy_file_range
    done = 0
    while done < size and _use_copy_file_range:
        try:
            n = os.copy_file_range(src_fd, dst_fd, size - done, src_offset + done,
                                   dst_offset + done)
        except OSError as e:
            if e.errno in _WRITE_ERRNOS:
                raise output_error(e) from e
            if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                           errno.EPERM, errno.EBADF):
                _use_copy_file_range = False
                break
            raise
        if n == 0:
            raise InputError(f"a data file ends {size - done} bytes before the tensor bytes "
                             f"its headers promise (at byte {src_offset + done}); it is truncated")
        done += n
    while done < size:
        data = os.pread(src_fd, min(_BLOCK, size - done), src_offset + done)
        if not data:
            raise InputError(f"a data file ends {size - done} bytes before the tensor bytes "
                             f"its headers promise (at byte {src_offset + done}); it is truncated")
        pwrite_all(dst_fd, data, dst_offset + done)
        done += len(data)


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write less than asked).

    Raises:
        OutputError: the output cannot be written (no space, quota, file-size limit).
    """
    view = memoryview(data).cast("B")
    while view:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            raise output_error(e) from e
        view = view[n:]
        offset += n
