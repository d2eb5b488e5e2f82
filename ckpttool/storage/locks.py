"""One writer per object-store output prefix: the object ``PREFIX/.ckpttool-lock``.

Every store's lock is this one class (:class:`ObjectLock`); a store gives it four calls (a
create-only put, a put, a get, a delete). The lock is created with the store's create-only put
and read back (a store that ignores the condition, fake-gcs-server, shows another run's win
there), renewed by a heartbeat while the run holds it, and removed at the end whatever the
outcome.

A run killed with ``kill -9`` (or a lost node) cannot remove its lock. The next run into the
same prefix takes it over, and says so, when the lock is a dead run's: written on this host
by a process that no longer exists, or not renewed for ``CKPTTOOL_LOCK_STALE`` seconds (10
minutes; a live run renews every quarter of that). Any other lock refuses the run with the
store's own command that removes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from ckpttool import settings
from ckpttool.errors import OutputError
from ckpttool.storage.places import Url

LOCK_NAME = ".ckpttool-lock"

# Notes for the run's report: locks of killed runs that this run removed.
_taken_over: list[str] = []


def take_notes() -> list[str]:
    """The notes of stale locks removed since the last call."""
    notes = list(_taken_over)
    _taken_over.clear()
    return notes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


class ObjectLock:
    """The lock of the output prefix ``url`` (see the module's notes).

    Raises (``acquire``):
        OutputError: another live run holds the prefix.
    """

    def __init__(self, url: Url) -> None:
        self.out = url
        self.url = url.child(LOCK_NAME)
        self.host = socket.gethostname()
        self.token = f"{self.host}:{os.getpid()}:{uuid.uuid4().hex}"
        self.held = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- what a store gives

    def _create(self, body: bytes) -> bool:
        """Put ``body`` unless the object exists; False when it does."""
        raise NotImplementedError

    def _put(self, body: bytes) -> None:
        raise NotImplementedError

    def _get(self) -> bytes | None:
        """The object's bytes; None where there is none."""
        raise NotImplementedError

    def _remove(self) -> None:
        raise NotImplementedError

    def remove_command(self) -> str:
        """The store's own command line that removes the lock object."""
        raise NotImplementedError

    # -- the protocol

    def _body(self, started: float) -> bytes:
        return json.dumps({"run": self.token, "host": self.host, "pid": os.getpid(),
                           "started": started, "beat": time.time()}).encode()

    def _holder(self) -> dict[str, Any]:
        try:
            raw = self._get()
            doc = json.loads(raw) if raw is not None else {}
        except (OutputError, ValueError, OSError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def _stale(self, doc: dict[str, Any]) -> str | None:
        """Why the lock ``doc`` is a dead run's, or None."""
        pid, host = doc.get("pid"), doc.get("host")
        if host == self.host and isinstance(pid, int) and pid > 0 and not _alive(pid):
            return f"process {pid} on this host has ended"
        beat = doc.get("beat", doc.get("started"))
        if isinstance(beat, (int, float)):
            age = time.time() - beat
            if age > settings.lock_stale():
                return f"not renewed for {age:.0f} s (CKPTTOOL_LOCK_STALE)"
        return None

    def _refused(self, doc: dict[str, Any]) -> OutputError:
        holder = str(doc.get("run") or "another run")
        return OutputError(
            f"{self.out}: another ckpttool run is writing this output ({LOCK_NAME} by "
            f"{holder}); wait for it to finish. If none is running (a killed run left the "
            "lock), check the output with ckpttool verify, then remove the lock: "
            f"{self.remove_command()}")

    def acquire(self) -> None:
        started = time.time()
        for attempt in range(2):
            if self._create(self._body(started)):
                doc = self._holder()
                if doc.get("run") != self.token:  # the store let another run's put win
                    raise self._refused(doc)
                self.held = True
                self._start_beat(started)
                return
            doc = self._holder()
            why = self._stale(doc) if attempt == 0 else None
            if why is None:
                raise self._refused(doc)
            self._remove()
            _taken_over.append(f"{self.url}: removed the lock of a killed run "
                               f"({doc.get('run', '?')}: {why})")
        raise self._refused(self._holder())  # pragma: no cover - the loop returns or raises

    def _start_beat(self, started: float) -> None:
        every = settings.lock_stale() / 4

        def beat() -> None:
            while not self._stop.wait(every):
                with contextlib.suppress(Exception):  # a missed beat is not the run's failure
                    if self._holder().get("run") != self.token:
                        return  # taken over: nothing of ours to renew
                    self._put(self._body(started))

        self._beat = threading.Thread(target=beat, name="ckpttool-lock-beat", daemon=True)
        self._beat.start()

    def release(self) -> None:
        """Remove the lock if it is still ours (best effort: a failure here is not the run's)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        if not self.held:
            return
        self.held = False
        with contextlib.suppress(Exception):
            if self._holder().get("run") == self.token:
                self._remove()
