"""Python-bound work on several CPUs: shares of a job list run in forked processes.

A merge or verify of millions of kilobyte-sized chunks spends its time in Python, per chunk
(decoding a record, placing its bytes), where threads only take turns on the interpreter. A
forked child starts with everything the parent planned (the chunk columns, the open files)
without reading or pickling any of it, writes its share at the offsets the plan gave (merge)
or sends its findings back as JSON (verify), and reports progress through a pipe.

Used only where it is safe: Linux (``os.fork`` with no surprises from system libraries),
a local store (no client connections or threads to inherit), and torch not loaded in the
parent when a share needs it (its thread pools do not survive a fork); ``CKPTTOOL_FORK=0``
turns it off. A child never runs the parent's clean-up: it leaves by ``os._exit``; the
parent removes what the command wrote, as it does for its own failures.

Messages from a child: a type byte, a 4-byte length, then the body: ``P`` bytes done (8-byte
int), ``R`` the share's result (JSON), ``E`` an error (JSON: class name and message).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from ckpttool import errors, settings
from ckpttool.core.runtime.report import Progress

_HEAD = struct.Struct("<cI")
T = TypeVar("T")

# What a share does: given a progress callback and an event that says "stop", its result
# (JSON-able: it crosses the pipe from a child).
Share = Callable[[Progress, threading.Event], Any]


class WorkerFailed(Exception):
    """A child process ended without saying why (killed, or an error that is not ours)."""


_INDEX = struct.Struct("<I")


class Pulled(Generic[T]):
    """``items``, heaviest first, taken one at a time by whichever process asks next: this
    process and the children :func:`run` forks while it is open iterate the same object.

    A split made in advance ends when its slowest share does, and beside other work on one
    core of two (a CPU hog) one share is always the slow one. Here a process slowed by other
    work simply takes fewer items. The items are numbered in a pipe written before the fork;
    the kernel serialises reads of a pipe, so each read of 4 bytes gets one number whole,
    and every number goes to one process. More items than the pipe holds are taken in runs
    of consecutive ones."""

    def __init__(self, items: Sequence[T], weight: Callable[[T], int]) -> None:
        ordered = sorted(items, key=lambda x: -weight(x))
        r, w = os.pipe()
        try:
            room = _pipe_room(w) // _INDEX.size
            per = max(1, -(-len(ordered) // room))
            self.groups = [ordered[k : k + per] for k in range(0, len(ordered), per)]
            data = b"".join(map(_INDEX.pack, range(len(self.groups))))
            os.set_blocking(w, False)  # never waits: the pipe holds it all (else: an error)
            if os.write(w, data) != len(data):
                raise OSError("pipe")
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self._r = r

    def __iter__(self) -> Iterator[T]:
        while True:
            got = os.read(self._r, _INDEX.size)
            if len(got) < _INDEX.size:  # all taken (never a part of a number: see above)
                return
            yield from self.groups[_INDEX.unpack(got)[0]]

    def close(self) -> None:
        os.close(self._r)

    def __enter__(self) -> Pulled[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pipe_room(fd: int) -> int:
    """Bytes the pipe ``fd`` holds before a writer waits (Linux: 64 KB unless the system
    limits the user's pipes, then 4 KB)."""
    try:
        import fcntl

        return int(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
    except (ImportError, AttributeError, OSError):
        return 4096


# Threads that import packages while the caller works (the contract check beside the
# streaming): a child forked while one holds an import lock (torch half imported) would wait
# for it for ever, and "torch" in sys.modules says nothing about a module still being
# imported.
_importers: set[threading.Thread] = set()


def importing(thread: threading.Thread) -> None:
    """Fork nothing while ``thread`` is alive: it imports packages."""
    _importers.add(thread)


def available(*, needs_torch: bool = False) -> bool:
    """True if shares may run in forked processes here (see the module docstring)."""
    if not settings.fork() or not sys.platform.startswith("linux"):
        return False
    _importers.difference_update([t for t in _importers if not t.is_alive()])
    if _importers:
        return False
    return not (needs_torch and "torch" in sys.modules)


def run(shares: list[Share], report: Progress) -> list[Any]:
    """``shares[0]`` in this process and each other one in a forked child, at the same time;
    their results in order. The first failure (here or in a child) stops the others and is
    raised here: a child's :class:`~ckpttool.errors.CkptError` as the same class with the
    same message."""
    stop = threading.Event()
    children: list[_Child] = []
    readers: list[threading.Thread] = []
    try:
        for share in shares[1:]:
            child = _Child.start(share)
            children.append(child)
            readers.append(threading.Thread(target=child.listen, args=(report, stop),
                                            daemon=True))
            readers[-1].start()
        first = shares[0](report, stop)
        if stop.is_set():  # a child failed: the others need not finish
            _end(children)
        for t in readers:
            t.join()
        _end(children)
    except BaseException:
        stop.set()
        _end(children)
        raise
    for c in sorted(children, key=lambda c: c.error is None):  # one that said why first
        c.raise_failure()
    return [first] + [c.result for c in children]


class _Child:
    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self.fd = fd
        self.result: Any = None
        self.error: dict[str, object] | None = None  # errors.to_wire of a child's failure
        self.status: int | None = None

    @classmethod
    def start(cls, share: Share) -> _Child:
        r, w = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns on fork() with threads running (a progress bar's): the child
            # only runs the share, which takes no lock those threads may hold.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(r)
            _child_main(share, w)
        os.close(w)
        return cls(pid, r)

    def listen(self, report: Progress, stop: threading.Event) -> None:
        """Read the child's messages until it closes its end."""
        with os.fdopen(self.fd, "rb") as pipe:
            while True:
                head = pipe.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    return
                kind, n = _HEAD.unpack(head)
                body = pipe.read(n)
                if kind == b"P":
                    report(int.from_bytes(body, "little"))
                elif kind == b"R":
                    self.result = json.loads(body)
                elif kind == b"E":
                    self.error = json.loads(body)
                    stop.set()

    def raise_failure(self) -> None:
        if self.error is not None:
            error = errors.from_wire(self.error)
            if error is not None:
                raise error
            raise WorkerFailed(f"a worker process failed: {self.error.get('error')}")
        if self.status == -getattr(signal, "SIGBUS", 0):
            # A source file cut short while the child read it through a mapping (SIGBUS has
            # its default action in children: storage.outputs).
            raise errors.InputError("a source file changed (cut short) while a worker "
                                    "process read it; nothing was written. Run again on a "
                                    "checkpoint nothing is writing to")
        if self.status is not None and self.status != 0:
            raise WorkerFailed(f"a worker process ended with status {self.status}")


def _end(children: list[_Child]) -> None:
    """Every child gone: asked to stop (SIGTERM) where it is still running, then reaped."""
    for c in children:
        if c.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.pid, signal.SIGTERM)
    for c in children:
        if c.status is None:
            _, status = os.waitpid(c.pid, 0)
            c.status = os.waitstatus_to_exitcode(status)


def _child_main(share: Share, w: int) -> None:
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # the parent stops it (SIGTERM)

        def send(kind: bytes, body: bytes) -> None:
            os.write(w, _HEAD.pack(kind, len(body)) + body)

        result = share(lambda n: send(b"P", n.to_bytes(8, "little")), threading.Event())
        send(b"R", json.dumps(result).encode())
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        code = e.exit_code if isinstance(e, errors.CkptError) else errors.InternalError.exit_code
        if settings.debug():
            traceback.print_exc()
        try:
            body = json.dumps(errors.to_wire(e)).encode()
            os.write(w, _HEAD.pack(b"E", len(body)) + body)
        except BaseException:  # noqa: BLE001, S110 - the status still says it failed
            pass
    finally:
        os._exit(code)
