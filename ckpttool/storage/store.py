"""Where a checkpoint's bytes come from: a store of named files, read by byte range.

Readers never open files themselves: they are *given* a :class:`Store` (``open_reader(info,
store=...)``) and ask it for ranges of the files their metadata names. A store declares what
it can do (:class:`Capabilities`) instead of being probed with ``getattr``/``isinstance``, as
obstore's and fsspec's stores do: whether it reads many planned ranges at once (object
storage, where each request costs a round trip), whether its bytes are local files (mapped
views, kernel copies, readers shared with forked processes), whether it lists and writes.

Which store serves a path is decided by a :class:`Stores` (an opener) that the caller holds
and passes down: :data:`LOCAL` for local directories; a mirror of object storage
(:mod:`ckpttool.storage.mirror`) for its own directory. Nothing here is process-global.

A new store is one module plus one subclass of the store contract suite
(``tests/storage/contract.py``).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from ckpttool.errors import InputError, UnreadableError
from ckpttool.storage import outputs


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store does well, declared once per store class."""

    # Told every range a command will read (:meth:`Store.plan_reads`), it fetches them as
    # coalesced requests ahead of the readers; readers then go in stored order.
    many_ranges: bool
    # Its bytes are local files: large ranges come mapped (:meth:`Store.views`), copies run in
    # the kernel, and forked processes may share its open files.
    local_files: bool
    # :meth:`Store.list_files` names every file below it with its size.
    listing: bool
    # Large files are written in parts sent in parallel (object storage's multipart uploads).
    multipart_writes: bool
    # Threads that keep it busy when reads wait on the network (0: the caller's own choice).
    workers: int = 0


class Store(Protocol):
    """Named files of one checkpoint, read by byte range. Thread-safe once
    :meth:`open_all` has run."""

    capabilities: ClassVar[Capabilities]

    def path(self, name: str) -> Path:
        """The local path that stands for ``name`` in messages (a mirror's for a remote one)."""
        ...

    def size(self, name: str) -> int:
        """The file's size. Raises InputError when it is missing."""
        ...

    def open_all(self, names: Iterable[str]) -> None: ...

    def pread(self, name: str, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer at the file's end)."""
        ...

    def read_exact(self, name: str, offset: int, size: int, *, what: str) -> bytes:
        """Exactly ``size`` bytes; InputError naming ``what`` when the file ends first."""
        ...

    def readinto(self, name: str, offset: int, buf: memoryview) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer at the file's end)."""
        ...

    def read_ranges(self, name: str, ranges: list[tuple[int, int]], *, what: str
                    ) -> list[bytes]:
        """The bytes of each ``(offset, size)`` of ``name``, in the order asked."""
        ...

    def plan_reads(self, reads: list[tuple[str, int, int]]) -> None:
        """The ``(name, offset, size)`` ranges about to be read, in that order (a no-op
        unless ``capabilities.many_ranges``)."""
        ...

    def views(self, name: str, offset: int, size: int, block: int) -> Iterator[memoryview]:
        """Consecutive mapped views (only with ``capabilities.local_files``)."""
        ...

    def copy_to(self, name: str, offset: int, dst_fd: int, dst_offset: int, size: int
                ) -> None:
        """Copy ``size`` bytes at ``offset`` into an open output file."""
        ...

    def list_files(self) -> dict[str, int]:
        """Every file below the store (relative name -> size); with ``capabilities.listing``."""
        ...

    def close(self) -> None: ...


class Stores(Protocol):
    """Opens the store of a checkpoint directory: what a caller passes down to discovery
    and to readers, so that no reader looks its storage up."""

    def open(self, base: Path, *, metadata_name: str, follow_links: bool = False) -> Store:
        """The store of the files below ``base`` (``metadata_name``: what references them,
        for the "missing" message; ``follow_links``: read local data files that link out)."""
        ...

    def reading(self, path: Path) -> contextlib.AbstractContextManager[
            Callable[[int, int], bytes]]:
        """``pread(size, offset)`` over one file while the block runs (what a format reads
        while describing a checkpoint: headers, nested records)."""
        ...


class LocalStores:
    """Local directories: a :class:`LocalStore` each."""

    def open(self, base: Path, *, metadata_name: str, follow_links: bool = False) -> Store:
        return LocalStore(base, metadata_name=metadata_name, follow_links=follow_links)

    @contextlib.contextmanager
    def reading(self, path: Path) -> Iterator[Callable[[int, int], bytes]]:
        """Raises OSError as ``open`` (FileNotFoundError...)."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            yield functools.partial(os.pread, fd)
        finally:
            os.close(fd)


LOCAL: Stores = LocalStores()


def pread_of(path: Path, stores: Stores = LOCAL
             ) -> contextlib.AbstractContextManager[Callable[[int, int], bytes]]:
    """``pread(size, offset)`` over one file of a checkpoint, through ``stores``."""
    return stores.reading(path)


class LocalStore:
    """Files below a local directory, each opened once (thread-safe) and read with ``pread``.

    Args:
        base: the directory that names are relative to.
        metadata_name: what references the files, for the "missing" message (".metadata").
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        many_ranges=False, local_files=True, listing=True, multipart_writes=False)

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

    def size(self, name: str) -> int:
        return os.fstat(self.fd(name)).st_size

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
        outputs.copy_range(self.fd(name), offset, dst_fd, dst_offset, size)

    def plan_reads(self, reads: list[tuple[str, int, int]]) -> None:
        """Nothing to plan: a local read costs no round trip (the page cache reads ahead)."""

    def list_files(self) -> dict[str, int]:
        """Regular files below the directory (links are not followed into)."""
        found: dict[str, int] = {}
        for root, _dirs, files in os.walk(self.base):
            for f in files:
                p = Path(root) / f
                size = file_size(p) if not p.is_symlink() else None
                if size is not None:
                    found[p.relative_to(self.base).as_posix()] = size
        return found

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


def open_data_file(path: Path, metadata_name: str) -> int:
    """Open a data file that ``metadata_name`` references, for reading.

    Raises:
        UnreadableError: this process may not read it.
        InputError: missing, unreadable, or not a regular file (a FIFO would block).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise InputError(missing_message(path, metadata_name)) from None
    except PermissionError as e:
        raise UnreadableError.of(path, e) from None
    except OSError as e:
        raise InputError(f"{path}: cannot open data file: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path}: is not a regular file; {metadata_name} names it as data")
    return fd


def missing_message(path: Path, metadata_name: str, detail: str = "") -> str:
    """The one message for a data file that is not there (``detail``: what it should hold)."""
    about = f" ({detail})" if detail else ""
    return (f"{path}: data file is missing; {metadata_name} references it{about}. Copy the "
            "whole checkpoint directory again")


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
    if mapped and store.capabilities.local_files and size >= MAP_MIN:
        yield from store.views(name, offset, size, len(buf))
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
