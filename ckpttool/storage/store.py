"""Where a checkpoint's bytes come from: a store of named files, read by byte range.

Readers never open files themselves: they are *given* a :class:`Store` (``open_reader(info,
store=...)``) and ask it for ranges of the files their metadata names. A store declares what
it can do (:class:`Capabilities`) instead of being probed with ``getattr``/``isinstance``, as
obstore's and fsspec's stores do: whether it reads many planned ranges at once (object
storage, where each request costs a round trip), whether its bytes are local files (mapped
views, kernel copies, readers shared with forked processes), whether it lists and writes.

Which store serves a path is decided by a :class:`Stores` (an opener) that the caller holds
and passes down: :data:`LOCAL` for local directories; the object tree of a remote checkpoint
(:mod:`ckpttool.storage.objtree`) for the path that stands for it. Nothing here is
process-global.

A new store is one module plus one subclass of the store contract suite
(``tests/storage/contract.py``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Protocol

from ckpttool import settings
from ckpttool.errors import InputError, UnreadableError
from ckpttool.storage import outputs, sidefiles


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store does well, declared once per store class."""

    # Told every range a command will read (:meth:`Store.plan_reads`), it fetches them as
    # coalesced requests ahead of the readers; readers then go in stored order.
    many_ranges: bool
    # Its bytes are local files: large ranges come mapped (:meth:`Store.views`), copies run in
    # the kernel, and forked processes may share its open files.
    local_files: bool
    # Threads that keep it busy when reads wait on the network (0: the caller's own choice).
    workers: int = 0


class Store(Protocol):
    """Named files of one checkpoint, read by byte range. Thread-safe once
    :meth:`open_all` has run."""

    capabilities: ClassVar[Capabilities]

    def path(self, name: str) -> Path:
        """The local path that stands for ``name`` in messages (an object tree's for a remote
        one, where no local file is)."""
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

    def readv(self, name: str, offset: int, bufs: Sequence[memoryview]) -> int:
        """Fill each of ``bufs`` in turn with the consecutive bytes from ``offset`` (a
        scattered read); returns the bytes read (fewer at the file's end)."""
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

    def read_small(self, name: str, kind: sidefiles.Kind) -> bytes:
        """Every byte of a small file (an index, a JSON or tracker file), refused over
        ``kind``'s cap before a byte is read.

        Raises:
            FileNotFoundError: it is not there. InputError, UnreadableError: not a regular
            file, over the cap, unreadable.
        """
        ...

    def close(self) -> None: ...


class Stores(Protocol):
    """Opens the store of a checkpoint directory: what a caller passes down to discovery
    and to readers, so that no reader looks its storage up."""

    def open(self, base: Path, *, metadata_name: str, follow_links: bool = False) -> Store:
        """The store of the files below ``base`` (``metadata_name``: what references them,
        for the "missing" message; ``follow_links``: read local data files that link out)."""
        ...

    def reading(self, path: Path, *, inside: str | None = None
                ) -> contextlib.AbstractContextManager[Callable[[int, int], bytes]]:
        """``pread(size, offset)`` over one file while the block runs (what a format reads
        while describing a checkpoint: headers, nested records); ``inside``: a real
        directory a local file must lie in (checked on the descriptor)."""
        ...

    def file_size(self, path: Path) -> int | None:
        """The size of the regular file ``path``; None where there is none (missing, a
        directory, a FIFO...)."""
        ...

    def is_dir(self, path: Path) -> bool:
        """True if ``path`` is a directory (an object-store prefix with objects below it)."""
        ...

    def listdir(self, directory: Path) -> dict[str, int | None]:
        """What lies directly in ``directory``: each regular file's name -> its size, any
        other entry's (a subdirectory, a FIFO...) -> None; empty when it is no directory."""
        ...

    def read_small(self, path: Path, kind: sidefiles.Kind) -> bytes:
        """Every byte of the small file ``path`` (a JSON index, a tracker), checked against
        ``kind`` first (:meth:`side_file`).

        Raises:
            FileNotFoundError: it is not there. InputError, UnreadableError: as
            :meth:`side_file`.
        """
        ...

    def side_file(self, path: Path, kind: sidefiles.Kind
                  ) -> contextlib.AbstractContextManager[BinaryIO]:
        """A side file (``.metadata``, an index, a tracker...) open for reading while the
        block runs, checked against ``kind`` first (:mod:`ckpttool.storage.sidefiles`: a
        local file's kind and size before the open and on the descriptor; a remote one's
        listed size, its bytes then read by ranged GETs).

        Raises:
            FileNotFoundError: it is not there. InputError, UnreadableError: as
            :func:`ckpttool.storage.sidefiles.open_checked`.
        """
        ...


class LocalStores:
    """Local directories: a :class:`LocalStore` each."""

    def open(self, base: Path, *, metadata_name: str, follow_links: bool = False) -> Store:
        return LocalStore(base, metadata_name=metadata_name, follow_links=follow_links)

    @contextlib.contextmanager
    def reading(self, path: Path, *, inside: str | None = None
                ) -> Iterator[Callable[[int, int], bytes]]:
        """Raises OSError as ``open`` (FileNotFoundError...); InputError (``inside``): not a
        regular file, or a link out of ``inside``."""
        if inside is not None:
            fd = open_data_file(path, path.name, inside=inside,
                                hint="copy the file into the checkpoint directory")
        else:
            fd = os.open(path, READ_FLAGS)
        try:
            yield functools.partial(os.pread, fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def side_file(self, path: Path, kind: sidefiles.Kind) -> Iterator[BinaryIO]:
        with os.fdopen(sidefiles.open_checked(path, kind), "rb") as f:
            yield f

    def file_size(self, path: Path) -> int | None:
        return file_size(path)

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def listdir(self, directory: Path) -> dict[str, int | None]:
        """Links are followed, as ``Path.is_file``/``is_dir`` follow them."""
        found: dict[str, int | None] = {}
        try:
            entries = os.scandir(directory)
        except OSError:
            return found
        with entries:
            for e in entries:
                try:
                    found[e.name] = e.stat().st_size if e.is_file() else None
                except OSError:
                    found[e.name] = None
        return found

    def read_small(self, path: Path, kind: sidefiles.Kind) -> bytes:
        return sidefiles.read_checked(path, kind)


LOCAL: Stores = LocalStores()



class PreadFile(io.RawIOBase):
    """``size`` bytes read through ``pread(size, offset)`` as a read-only binary file (a
    remote side file, read by ranged GETs as it is parsed)."""

    def __init__(self, pread: Callable[[int, int], bytes], size: int) -> None:
        self._pread = pread
        self._size = size
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._at, 2: self._size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self._pread(min(len(view), max(0, self._size - self._at)), self._at)
        view[:len(data)] = data
        self._at += len(data)
        return len(data)


def pread_of(path: Path, stores: Stores = LOCAL, *, inside: str | None = None
             ) -> contextlib.AbstractContextManager[Callable[[int, int], bytes]]:
    """``pread(size, offset)`` over one file of a checkpoint, through ``stores``."""
    return stores.reading(path, inside=inside)


def max_open_files() -> int:
    """How many data files one store keeps open at once: a quarter of this process's
    descriptor limit (``ulimit -n``), at most 256, at least 8. A checkpoint of 2,048 ranks
    has 2,048 data files; one descriptor each for the whole run would exceed the default
    limit of 1,024."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 256
    return max(8, min(256, soft // 4))


class LocalStore:
    """Files below a local directory, read with ``pread`` through a bounded set of open
    descriptors (thread-safe): a file is opened when first read and closed when it is the
    least recently used of more than :func:`max_open_files`; a reopened file must be the one
    first opened (same device and inode), or the read fails as "changed while reading".

    Each file is checked on its open descriptor, never on its name: a regular file (a FIFO
    is never waited on) that really lies inside the checkpoint directory (unless
    ``follow_links``), so a link swapped in between a check and the open is refused.

    Args:
        base: the directory that names are relative to.
        metadata_name: what references the files, for the "missing" message (".metadata").
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        many_ranges=False, local_files=True)

    def __init__(self, base: Path, *, metadata_name: str, follow_links: bool = False) -> None:
        self.base = base
        self.metadata_name = metadata_name
        # A data file that is a link out of the checkpoint is refused unless asked for
        # (--follow-links): storage paths are checked by name, a link would sidestep that.
        self._inside = None if follow_links else os.path.realpath(base)
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._pins: dict[str, int] = {}  # reads in flight on each open descriptor
        self._ids: dict[str, tuple[int, int]] = {}  # (st_dev, st_ino) at the first open
        self._sizes: dict[str, int] = {}  # st_size at the first open
        self._limit = max_open_files()
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        return self.base / name

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[int]:
        """The open file ``name`` while the block runs (it is not closed meanwhile).

        Raises:
            InputError: missing, unreadable, not a regular file, a link out of the checkpoint,
                or another file than the one first opened under this name.
        """
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._open(name)
                self._fds[name] = fd
            else:
                self._fds.move_to_end(name)
            self._pins[name] = self._pins.get(name, 0) + 1
            self._evict()
        try:
            yield fd
        finally:
            with self._lock:
                self._pins[name] -= 1
                if not self._pins[name]:
                    del self._pins[name]
                self._evict()

    def _open(self, name: str) -> int:
        path = self.path(name)
        fd = open_data_file(path, self.metadata_name, inside=self._inside)
        info = os.fstat(fd)
        ident = (info.st_dev, info.st_ino)
        self._sizes.setdefault(name, info.st_size)
        if self._ids.setdefault(name, ident) != ident:
            os.close(fd)
            raise InputError(f"{path}: the file changed while it was read (another file is "
                             "there now); run again on a checkpoint nothing is writing to")
        return fd

    def _evict(self) -> None:
        while len(self._fds) > self._limit:
            victim = next((n for n in self._fds if n not in self._pins), None)
            if victim is None:
                return
            os.close(self._fds.pop(victim))

    def size(self, name: str) -> int:
        with self.use(name) as fd:
            return os.fstat(fd).st_size

    def open_all(self, names: Iterable[str]) -> None:
        """Open (and check) every file now: a missing or refused one fails before any work.
        At most :func:`max_open_files` stay open."""
        for name in names:
            with self.use(name):
                pass

    def _bounded(self, name: str, size: int, offset: int) -> int:
        """``size`` cut to what the file holds from ``offset``: ``os.pread`` allocates all it
        is asked for before reading, so a size field of a damaged file (a 5-byte edit can
        claim 2 GB) must never reach it unbounded."""
        return max(0, min(size, self._sizes.get(name, size) - offset))

    def pread(self, name: str, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer at the file's end)."""
        with self.use(name) as fd:
            return os.pread(fd, self._bounded(name, size, offset), offset)

    def read_exact(self, name: str, offset: int, size: int, *, what: str) -> bytes:
        with self.use(name) as fd:
            data = os.pread(fd, self._bounded(name, size, offset), offset)
        if len(data) != size:
            raise truncated(self.path(name), offset + len(data), what)
        return data

    def readinto(self, name: str, offset: int, buf: memoryview) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer at the file's end)."""
        with self.use(name) as fd:
            return os.preadv(fd, [buf], offset)

    def readv(self, name: str, offset: int, bufs: Sequence[memoryview]) -> int:
        """Fill each of ``bufs`` in turn from ``offset``: ``preadv`` (the kernel places the
        bytes; no Python per buffer), at most ``IOV_MAX`` buffers a call."""
        done = 0
        with self.use(name) as fd:
            if len(bufs) <= _IOV_MAX:
                return os.preadv(fd, bufs, offset)
            for k in range(0, len(bufs), _IOV_MAX):
                group = bufs[k : k + _IOV_MAX]
                want = sum(len(b) for b in group)
                got = os.preadv(fd, group, offset + done)
                done += got
                if got != want:  # the file's end (preadv reads all it can of a regular file)
                    break
        return done

    def copy_to(self, name: str, offset: int, dst_fd: int, dst_offset: int, size: int) -> None:
        """Copy ``size`` bytes at ``offset`` into an open output file, in the kernel."""
        with self.use(name) as fd:
            outputs.copy_range(fd, offset, dst_fd, dst_offset, size)

    def plan_reads(self, reads: list[tuple[str, int, int]]) -> None:
        """Nothing to plan: a local read costs no round trip (the page cache reads ahead)."""

    def read_small(self, name: str, kind: sidefiles.Kind) -> bytes:
        """Checked as a side file is, and (unless ``follow_links``) inside the directory."""
        path = self.path(name)
        fd = sidefiles.open_checked(path, kind)
        try:
            if self._inside is not None:
                ok, real = is_inside(fd, path, self._inside)
                if not ok:
                    raise InputError(f"{path}: a link to {real}, outside the checkpoint "
                                     "directory; pass --follow-links to read through links")
            return sidefiles.read_fd(fd, path, kind)
        finally:
            os.close(fd)

    def views(self, name: str, offset: int, size: int, block: int) -> Iterator[memoryview]:
        """The ``size`` bytes at ``offset`` of ``name`` as consecutive views of at most
        ``block`` bytes, mapped from the page cache (no copy; see :func:`read_blocks`); they
        stop early where the file ends."""
        with self.use(name) as fd:
            end = min(offset + size, os.fstat(fd).st_size)
        pos = offset
        me = threading.get_ident()
        try:
            while pos < end:
                n = min(block, end - pos)
                base = pos - pos % mmap.ALLOCATIONGRANULARITY
                # For the SIGBUS message (storage.outputs): the file, and where this window ends.
                outputs.MAPPED[me] = (str(self.path(name)), pos + n)
                # Copy-on-write: writable views (torch.frombuffer warns on read-only ones) that
                # no write ever reaches the file through. Unmapped when the last view of it goes
                # (a mapping holds its own reference to the file: closing the descriptor is
                # safe).
                with self.use(name) as fd:
                    window = mmap.mmap(fd, pos + n - base, access=mmap.ACCESS_COPY, offset=base)
                _test_pause_after_map()
                yield memoryview(window)[pos - base : pos - base + n]
                del window
                pos += n
        finally:
            outputs.MAPPED.pop(me, None)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._pins.clear()


def _test_pause_after_map() -> None:
    """Test hook (tests/cli/test_trust.py): ``CKPTTOOL_TEST_FAULT=pause-map:FILE`` creates
    FILE once a window is mapped and waits (at most 60 s) until FILE is removed, so that a
    test can cut the source file short under the mapping."""
    fault = settings.test_fault()
    if not fault.startswith("pause-map:"):
        return
    flag = fault.split(":", 1)[1]
    if os.path.exists(flag + ".done"):
        return
    with open(flag, "w") as f:
        f.write(str(os.getpid()))
    open(flag + ".done", "w").close()
    for _ in range(1200):
        time.sleep(0.05)
        if not os.path.exists(flag):
            return


def real_path(fd: int) -> str | None:
    """Where the open file ``fd`` really lies (Linux: its /proc link); None where the system
    does not say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def is_inside(fd: int, path: Path, directory: str) -> tuple[bool, str]:
    """Whether the open file ``fd`` (opened as ``path``) lies inside ``directory`` (a real
    path), judged on the descriptor itself: a link swapped in after any check by name is
    seen. Returns the answer and the file's real path."""
    real = real_path(fd)
    if real is None:  # no /proc: the name's target, then the same inode as the descriptor
        real = os.path.realpath(path)
        try:
            same = os.path.samestat(os.stat(real), os.fstat(fd))
        except OSError:
            same = False
        if not same:
            return False, real
    return os.path.commonpath([real, directory]) == directory, real


# Open flags for reading a file a checkpoint names: never wait on a FIFO or device, never
# make a terminal ours.
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)


def open_data_file(path: Path, metadata_name: str, *, inside: str | None = None,
                   hint: str = "pass --follow-links to read data files through links") -> int:
    """Open a data file that ``metadata_name`` references, for reading, and check the open
    descriptor (never the name, which may change meanwhile).

    Args:
        inside: a real directory path the file must lie in (links out of it are refused).

    Raises:
        UnreadableError: this process may not read it.
        InputError: missing, unreadable, not a regular file (a FIFO would block), or outside
            ``inside``.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError as err:
        raise InputError(missing_message(path, metadata_name)) from err
    except PermissionError as e:
        raise UnreadableError.of(path, e) from e
    except OSError as e:
        raise InputError(f"{path}: cannot open data file: {e.strerror}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path}: is not a regular file; {metadata_name} names it as data")
    if inside is not None:
        ok, real = is_inside(fd, path, inside)
        if not ok:
            os.close(fd)
            raise InputError(f"{path}: a link to {real}, outside the checkpoint directory; "
                             f"{hint}")
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


def _iov_max() -> int:
    """Buffers one ``preadv`` may fill (POSIX's IOV_MAX: 1024 on Linux; 16, the least POSIX
    allows, where the system does not say)."""
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 16
    return min(1024, n) if n > 0 else 16


_IOV_MAX = _iov_max()


def read_blocks(store: Store, name: str, offset: int, size: int, buf: memoryview, *,
                mapped: bool = True) -> Iterator[memoryview]:
    """The ``size`` bytes at ``offset`` of ``name``, in consecutive blocks of at most
    ``len(buf)`` bytes, each valid until the next is asked for; fewer bytes in all where the
    file ends first (the caller says so, in its words).

    A local file's large ranges come mapped from the page cache (measured on 6 GB: copying
    them into ``buf`` with ``pread`` took 0.3-1.0 s of system time, mapping 0.1 s; on 1.6 GB
    cast to bf16, ``benchmarks/cast_read.py``: pread 8% more CPU time); anything else (or
    with ``mapped=False``) is read into ``buf``. A mapped file cut short while it is read
    raises SIGBUS, which :mod:`ckpttool.storage.outputs` turns into the one-line error once
    a command writes outputs; its size is checked first.
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
