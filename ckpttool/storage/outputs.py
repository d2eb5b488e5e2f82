"""Output I/O, shared by every operation that writes files: atomic outputs, write-behind,
space checks, and the positional writes and copies (``pwrite_all``, ``copy_range``) that
writers and local stores use.

Outputs are created under a hidden temporary name in the output directory, filled at known
offsets, and renamed to their real names only when everything is complete. Anything that stops
the run early (an error, Ctrl-C) removes the temporary files, and a killed process leaves only
names ending in ``.ckpttool-tmp``, which never look like a finished checkpoint.

While it writes, a process holds an exclusive ``flock`` on the output directory: a second
ckpttool writing into the same directory refuses at once (the kernel drops the lock when a
process dies, so a killed run never blocks the next). Before publishing, every file and then the
directory are fsync'ed, so that a power cut cannot publish a name whose data never reached the
disk. Publishing replaces a previous output so that no moment shows a finished-looking but
mixed set: the previous index goes first, then the new files come in, then the previous files
the new output lacks go, and the new index comes last.

Test hook (tests/core/test_faults.py): ``CKPTTOOL_TEST_FAULT=kill:K`` ends the process as
``kill -9`` would at the K-th publishing step (creating an output file, fsync, rename, unlink),
``pause:K:FILE`` creates FILE there and waits for a signal (at most ``PAUSE_LIMIT_S``, then
the run exits ``PAUSE_EXPIRED_EXIT``). ``CKPTTOOL_TEST_REMOTE_FAULT`` does
the same at the steps of an upload to object storage (:func:`fault_step`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ckpttool import settings
from ckpttool.errors import InputError, OutputError
from ckpttool.units import human_bytes

__all__ = ["TMP_SUFFIX", "AtomicOutputs", "check_space", "copy_range", "existing_outputs",
           "note_resumable", "output_error", "pwrite_all", "remove_stale", "take_resumable",
           "take_stale_notes"]

TMP_SUFFIX = ".ckpttool-tmp"

_BLOCK = 64 << 20
_use_copy_file_range = hasattr(os, "copy_file_range")
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: no lock
    fcntl = None  # type: ignore[assignment]

_steps = {"CKPTTOOL_TEST_FAULT": itertools.count(1),
          "CKPTTOOL_TEST_REMOTE_FAULT": itertools.count(1)}


def _step(hook: str = "CKPTTOOL_TEST_FAULT") -> None:
    """One publishing step; the test hook acts here (see the module docstring)."""
    fault = (settings.test_fault() if hook == "CKPTTOOL_TEST_FAULT"
             else settings.test_remote_fault())
    if not fault:
        return
    action, at, *rest = fault.split(":", 2)
    if action not in ("kill", "pause"):  # another hook's (storage.store)
        return
    if next(_steps[hook]) != int(at):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "pause":
        with open(rest[0], "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while time.monotonic() < deadline:  # until a signal comes (one held back is pending)
            time.sleep(0.05)
            if signal.sigpending() or any(_deferred):
                return
        # No signal came: end here, with a code no run otherwise exits with, rather than go
        # on and publish as if the test's interrupt had been taken.
        os.write(2, f"ckpttool: test hook {fault}: no signal came in {PAUSE_LIMIT_S:g} s\n"
                 .encode())
        os._exit(PAUSE_EXPIRED_EXIT)


# The test hook's pause: how long it waits for a signal, and the exit code when none came.
PAUSE_LIMIT_S = 60.0
PAUSE_EXPIRED_EXIT = 97


def fault_step() -> None:
    """A step of a remote commit (each object put or deleted by an upload to object
    storage), counted apart by ``CKPTTOOL_TEST_REMOTE_FAULT`` (same actions)."""
    _step("CKPTTOOL_TEST_REMOTE_FAULT")


def _fsync_wanted() -> bool:
    """``CKPTTOOL_FSYNC=0`` skips the syncs (about 0.3 s per GB written on a page-cache-warm
    run: benchmarks/README.md), for scratch outputs a power cut may lose."""
    return settings.fsync()


# Bytes written between two early syncs (write_behind).
WRITE_BEHIND = 256 << 20


@contextlib.contextmanager
def write_behind(fds: list[int], report: Callable[[int], None]) -> Iterator[Callable[[int], None]]:
    """While the block writes into ``fds``, sync what it has written so far in a thread of
    its own, every :data:`WRITE_BEHIND` bytes it reports through the callback yielded (which
    passes them on to ``report``): the disk takes the data while the rest is being written,
    and the fsync before the output is published (:meth:`AtomicOutputs.commit`) waits for the
    last part only. Nothing is synced with ``CKPTTOOL_FSYNC=0``."""
    if not _fsync_wanted() or not fds:
        yield report
        return
    lock = threading.Lock()
    wake = threading.Event()
    done = asked = False
    written = 0
    failed: list[OSError] = []

    def counted(n: int) -> None:
        nonlocal written, asked
        report(n)
        with lock:
            written += n
            if written >= WRITE_BEHIND:
                written, asked = 0, True
                wake.set()

    def syncer() -> None:
        nonlocal asked
        while True:
            wake.wait()
            with lock:
                wake.clear()
                sync, asked = asked, False
                last = done
            if sync:  # a sync asked for before the block ended is still made
                try:
                    for fd in fds:
                        os.fdatasync(fd)
                except OSError as e:  # reported here: a later fsync of the file may not be
                    failed.append(e)
                    return
            if last:
                return

    thread = threading.Thread(target=syncer, name="ckpttool-write-behind", daemon=True)
    thread.start()
    try:
        yield counted
    except BaseException:
        with lock:
            asked = False  # no sync for an output about to be removed (Ctrl-C, an error)
        raise
    finally:
        with lock:
            done = True
            wake.set()
        thread.join()
    if failed:
        raise output_error(failed[0]) from None


def _fsync_dir(fd: int) -> None:
    if not _fsync_wanted():
        return
    with contextlib.suppress(OSError):  # some file systems cannot sync a directory
        os.fsync(fd)


def existing_outputs(out_dir: Path, taken: Callable[[str], bool]) -> list[str]:
    """Names already in ``out_dir`` that the output would take (``taken``), sorted; nothing
    is created. Whether they may be replaced (--overwrite) is the caller's to say.

    Raises:
        OutputError: ``out_dir`` is not a directory, or such a name is not a regular file (a
            directory or a link, which not even --overwrite replaces).
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: exists and is not a directory; choose another output path")
    if not out_dir.is_dir():
        return []
    existing = sorted(p.name for p in out_dir.iterdir() if taken(p.name))
    for name in existing:
        path = out_dir / name
        if path.is_symlink() or not path.is_file():
            raise OutputError(f"{path}: is not a regular file, and the output needs this name; "
                              "move it away first")
    return existing


def check_apart(out_dir: Path, *sources: Path) -> None:
    """OUT is neither a source nor inside one (a merge into its own checkpoint directory would
    write weights, config and tokenizer among the files it reads).

    Raises:
        OutputError: naming the source.
    """
    out = out_dir.resolve()
    for src in sources:
        if src.is_dir():
            s = src.resolve()
            inside = out.is_relative_to(s)
        else:  # a file checkpoint: its own directory is off limits, a subdirectory is fine
            s = src.resolve().parent
            inside = out == s
        if inside:
            where = "is" if out == s else "is inside"
            raise OutputError(f"{out_dir}: {where} the checkpoint directory {s}; choose an "
                              "output directory outside it")


def check_space(out_dir: Path, need: int) -> None:
    """Create ``out_dir`` and check it can take ``need`` bytes, before any is written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out_dir}: cannot create output directory: {e.strerror}") from e
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise OutputError(
            f"{out_dir}: not enough free space: the output takes about {human_bytes(need)} and "
            f"{human_bytes(free)} are free; free some space or choose another output directory"
        )


def remove_stale(out_dir: Path, keep: set[str], belongs: Callable[[str], bool]) -> None:
    """With --overwrite: remove a previous output's files (regular files whose name
    ``belongs`` to this kind of output) that the new output does not have."""
    for p in sorted(out_dir.iterdir()):
        if belongs(p.name) and p.name not in keep and p.is_file() and not p.is_symlink():
            _step()
            p.unlink()


# A temporary file of a single-process run: tagged with its process id. Shared runs tag theirs
# with a run id ("r..." under torchrun, "s..." for --slice): those outlive a process on purpose.
_PID_TEMPORARY = re.compile(rf"\..+\.(\d+){re.escape(TMP_SUFFIX)}")

# Temporary files being written by this process, removed by the SIGBUS guard.
_LIVE: set[str] = set()
_removed_stale: list[str] = []


# The file each thread reads through a mapping now and where its window ends (set by the
# local store around a mapped read), for the SIGBUS message: a mapped file cut short ends
# the read there.
MAPPED: dict[int, tuple[str, int]] = {}


def mapped_file() -> str | None:
    """The mapped source file that is now shorter than the window read from it (the one a
    SIGBUS came from), else any file mapped now; None when none is."""
    entries = list(MAPPED.values())
    for path, end in entries:
        with contextlib.suppress(OSError):
            if os.stat(path).st_size < end:
                return path
    return entries[0][0] if entries else None


def take_stale_notes() -> list[str]:
    """What this process removed as a killed run's leftovers since last asked (for the CLI
    to say, as warnings)."""
    notes = list(_removed_stale)
    _removed_stale.clear()
    return notes


_resumable: list[Path] = []


def note_resumable(journal: Path) -> None:
    """A cut merge kept its finished pieces (``journal`` names them) for the next run."""
    _resumable.append(journal)


def take_resumable() -> list[Path]:
    """The journals of cut merges noted since last asked that are still there (a remote
    output's staging directory, removed when its run stops, keeps none)."""
    found = [p for p in _resumable if p.exists()]
    _resumable.clear()
    return found


def _remove_abandoned(out_dir: Path) -> None:
    """Remove temporary files that a killed single-process run left in ``out_dir``, and note
    them. Called with the directory's lock held: every process that writes such files holds
    it while they exist, so a free lock proves they are abandoned."""
    try:
        entries = sorted(out_dir.iterdir())
    except OSError:
        return
    for p in entries:
        m = _PID_TEMPORARY.fullmatch(p.name)
        if m is None or int(m.group(1)) == os.getpid() or not p.is_file() or p.is_symlink():
            continue
        with contextlib.suppress(OSError):
            size = p.stat().st_size
            p.unlink()
            _removed_stale.append(f"{p}: removed a temporary file ({size:,} bytes) that a "
                                  "killed or crashed run left")


# A private staging directory (a remote output written locally before its upload) holds this
# file, locked (flock) by the run that made it for as long as that process lives.
STAGING_MARK = ".ckpttool-staging"
_staging_held: list[int] = []


def staging_dir(prefix: str) -> Path:
    """A new private directory under TMPDIR for a run's staged output, held by this process
    (an ``flock`` the kernel drops when the process dies). Staging directories of runs that
    died before removing theirs (``kill -9``, a lost node) are removed first, and noted
    (:func:`take_stale_notes`); one whose run is alive stays."""
    _remove_abandoned_staging(Path(tempfile.gettempdir()), prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    fd = os.open(path / STAGING_MARK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
    _staging_held.append(fd)  # open until the process ends: its lock says it is alive
    return path


def _remove_abandoned_staging(tmp: Path, prefix: str) -> None:
    if fcntl is None:
        return
    try:
        entries = sorted(p for p in tmp.iterdir() if p.name.startswith(prefix))
    except OSError:
        return
    for p in entries:
        mark = p / STAGING_MARK
        try:
            info = p.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            fd = os.open(mark, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue  # not ours, or made by a ckpttool that marks none: left alone
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its run is alive
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()
                       and not f.is_symlink())
            shutil.rmtree(p, ignore_errors=True)
            _removed_stale.append(f"{p}: removed the staging directory ({size:,} bytes) of a "
                                  "remote output that a killed run left")
        finally:
            os.close(fd)


_sigbus_installed = False


def _install_sigbus_guard() -> None:
    """Turn SIGBUS (a source file cut short while it is read through a mapping: the kernel's
    answer to touching a page past its new end) into the one-line error, with this process's
    temporary files removed, instead of a silent death with exit 135 that leaves them.

    Nothing of ours runs in the signal handler itself. The handler is CPython's own C-level
    one, which is async-signal-safe: it marks the signal and writes its number to the wakeup
    file descriptor (``signal.set_wakeup_fd``). A watchdog thread, blocked on the other end of
    that pipe, wakes in ordinary (non-signal) context, writes the message, unlinks the files
    and leaves by ``os._exit(3)``. Meanwhile the faulting thread re-runs the faulting load and
    is sent SIGBUS again, in a loop that only ends with the process: it holds no lock of ours
    and not the interpreter lock (the copies from mapped memory run in torch with it
    released), so the watchdog always gets to run. The Python-level handler does the same
    where the main thread runs it first (it never does when the main thread is the one that
    faults; nor does the watchdog wake when an event loop took the wakeup descriptor since).

    Not installed where the wakeup descriptor is taken already (an event loop's) or off the
    main thread (where handlers cannot be set): SIGBUS keeps its default there. A forked
    child gets the default back (:func:`_sigbus_default_in_child`): it dies of SIGBUS, and
    its parent reports that.
    """
    global _sigbus_installed
    if (_sigbus_installed or not hasattr(signal, "SIGBUS")
            or threading.current_thread() is not threading.main_thread()):
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        old = None
    if old is None or old != -1:  # taken (restore it) or refused: the default stays
        if old is not None:
            signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return
    _sigbus_installed = True
    signal.signal(signal.SIGBUS, _sigbus_exit)
    # The watchdog is born with every signal blocked (a thread takes its creator's mask):
    # a process-directed signal (Ctrl-C) must go to the main thread, which holds SIGINT back
    # while it publishes, never to a thread that would let it through.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        threading.Thread(target=_sigbus_watchdog, args=(r,), name="ckpttool-sigbus",
                         daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    os.register_at_fork(after_in_child=_sigbus_default_in_child)


def _sigbus_watchdog(r: int) -> None:
    """Wait for SIGBUS's byte on the wakeup pipe (other signals' bytes are passed over: their
    handlers run as usual), then end the process as :func:`_install_sigbus_guard` says."""
    while True:
        try:
            got = os.read(r, 512)
        except InterruptedError:  # pragma: no cover - retried by Python itself
            continue
        except OSError:
            return
        if not got:
            return
        if signal.SIGBUS in got:
            break
    _sigbus_exit()


def _sigbus_exit(*_: object) -> None:
    """The one-line error, this process's temporary files removed, exit 3 (from the watchdog,
    or from the Python-level handler where the main thread gets there first)."""
    where = mapped_file() or "a source file"
    os.write(2, (f"ckpttool: error: {where}: changed (cut short) while it was read; "
                 "nothing was written. Run again on a checkpoint nothing is writing "
                 "to\n").encode("utf-8", "replace"))
    for path in list(_LIVE):
        with contextlib.suppress(OSError):
            os.unlink(path)
    os._exit(InputError.exit_code)


def _sigbus_default_in_child() -> None:
    """In a forked child (core.runtime.forked): no watchdog thread came along, so SIGBUS gets
    its default action back, and the wakeup pipe (the parent's) is let go."""
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGBUS, signal.SIG_DFL)


class AtomicOutputs:
    """Files written under temporary names and renamed into place together by :meth:`commit`.

    Use as a context manager: entering it locks the output directory (``check``, if given, is
    run once the lock is held: whatever a concurrent run may have written since the caller
    last looked); leaving it without ``commit()`` removes every temporary file.
    """

    def __init__(self, out_dir: Path, *, check: Callable[[], None] | None = None,
                 lock: bool = True) -> None:
        self.out_dir = out_dir
        self._check = check
        self._lock = lock  # False: a process of a shared merge whose first process holds it
        self._adopted: list[Path] = []
        self._pending: list[tuple[Path, Path]] = []  # (temporary, final)
        self._fds: list[int] = []
        self._dir_fd: int | None = None

    def __enter__(self) -> AtomicOutputs:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._dir_fd = os.open(self.out_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as e:
            raise OutputError(f"{self.out_dir}: cannot open the output directory: "
                              f"{e.strerror}") from e
        if fcntl is not None and self._lock:
            try:
                fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(self._dir_fd)
                self._dir_fd = None
                raise OutputError(
                    f"{self.out_dir}: another ckpttool process is writing into this directory; "
                    "wait for it to finish or choose another output directory") from err
        try:
            if self._lock:
                _remove_abandoned(self.out_dir)
            if self._check is not None:
                self._check()
        except BaseException:
            self.abort()
            raise
        _install_sigbus_guard()
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def create(self, name: str, size: int | None = None, *, tag: str | None = None) -> int:
        """Open a new temporary file for ``name``; returns a writable descriptor. ``tag``
        names it instead of the process id (a run id other processes write into too)."""
        _step()
        final = self.out_dir / name
        tmp = self.out_dir / f".{name}.{tag or os.getpid()}{TMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # a killed run's leftover, or a planted link: never written through
            # 0o666 so the umask decides the permissions, as for any file a tool creates.
            fd = os.open(tmp, flags, 0o666)
        except OSError as e:
            raise OutputError(f"{tmp}: cannot create output file: {e.strerror}") from e
        self._pending.append((tmp, final))
        _LIVE.add(str(tmp))
        self._fds.append(fd)
        if size is not None:
            try:
                os.ftruncate(fd, size)
            except OSError as e:
                raise output_error(e) from e
        return fd

    def adopt(self, name: str, tmp: Path) -> None:
        """Take ``tmp``, a complete temporary file made elsewhere (by the slices of a shared
        merge), as ``name``'s: renamed by :meth:`commit`, kept by :meth:`abort` (it is the
        slices' work: a failed or interrupted ``--finish`` leaves it for the next one)."""
        self._pending.append((tmp, self.out_dir / name))
        self._adopted.append(tmp)

    def write_bytes(self, name: str, data: bytes) -> None:
        fd = self.create(name)
        pwrite_all(fd, data, 0)

    def commit(self, last: tuple[str, ...] = (),
               before_last: Callable[[], None] | None = None) -> list[Path]:
        """Sync every file to disk and rename it into place.

        Order, so that no moment shows a finished-looking but mixed output (a process killed
        at any step leaves either the previous output, or one without its index): a previous
        file named in ``last`` is removed first; the new files come in; ``before_last`` runs
        (removing a previous output's files the new one lacks); the directory is synced; the
        files in ``last`` come in. Ctrl-C waits until all of it is done.

        Args:
            last: names renamed after the rest (an index file, so that its presence means the
                shards it names are complete).
            before_last: run between the two (removing a previous output's stale files, so
                that they never stand beside a complete new index).
        """
        sync = _fsync_wanted()
        try:
            for fd in self._fds if sync else ():
                _step()
                os.fsync(fd)
            for tmp in self._adopted if sync else ():  # written by other processes: synced here
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            raise output_error(e) from e
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        ordered = sorted(self._pending, key=lambda p: p[1].name in last)
        with _signals_deferred():
            try:
                for name in last:
                    old = self.out_dir / name
                    if old.is_file() and not old.is_symlink():
                        _step()
                        old.unlink()
                for tmp, final in ordered:
                    if before_last is not None and final.name in last:
                        before_last()
                        before_last = None
                    if final.name in last and self._dir_fd is not None:
                        _fsync_dir(self._dir_fd)  # every name it indexes is on disk first
                    _step()
                    os.replace(tmp, final)
                    _LIVE.discard(str(tmp))
                    self._pending.remove((tmp, final))
                if before_last is not None:
                    before_last()
                if self._dir_fd is not None:
                    _fsync_dir(self._dir_fd)
            except OSError as e:
                # What was not renamed is removed by abort(); say which name failed.
                raise OutputError(f"{e.filename or self.out_dir}: cannot put the output in "
                                  f"place: {e.strerror}; check the output directory") from e
        return [final for _, final in ordered]

    @property
    def published(self) -> bool:
        """Whether every file was renamed into place (a signal held back while they were is
        delivered after: the output is complete even so)."""
        return not self._pending

    def abort(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        for tmp, _ in self._pending:
            if tmp in self._adopted:
                continue
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            _LIVE.discard(str(tmp))
        self._pending.clear()
        self._adopted.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # and the lock with it
            self._dir_fd = None


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back while the output is published (a Ctrl-C there
    would leave half of the new files in place); they are delivered when it is done.

    Blocking them in this thread is not enough: a process-directed signal goes to any thread
    that lets it through, and libraries start threads of their own (numpy's and torch's
    thread pools, born with the mask of their time), whose C-level handler then has the main
    thread run the Python one at its next step. So the Python handlers are swapped too, for
    one that only notes the signal, and a noted signal is raised again when the output is
    published."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    noted: list[int] = []

    def note(signum: int, frame: object) -> None:
        noted.append(signum)

    handlers = {s: signal.signal(s, note) for s in held}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    _deferred.append(noted)
    try:
        yield
    finally:
        _deferred.remove(noted)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # one held back here is delivered now
        for signum in dict.fromkeys(noted):
            signal.raise_signal(signum)


# The signals noted while an output is published (the test hook's pause ends on one).
_deferred: list[list[int]] = []


# --------------------------------------------------------------------------------------------
# Positional writes and copies


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
