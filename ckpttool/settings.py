"""Every ``CKPTTOOL_*`` environment variable, read in one place with one rule each.

Each knob is a function read at call time (not at import), so a forked child and its parent
see the same value and a test can set the variable for one call. Booleans follow one rule:
``1``, ``true``, ``yes`` or ``on`` turns a knob on, ``0``, ``false``, ``no`` or ``off`` turns it
off (in any case), unset or empty is the default, and anything else is the default too, with a
warning on stderr that the value was ignored; the README's table of variables is generated
from :data:`KNOBS`.

Test-only hooks (``CKPTTOOL_TEST_*``) inject faults at named steps; they are read here too,
so that no other module reads the environment for ckpttool's own variables.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ckpttool.errors import OutputError


@dataclass(frozen=True, slots=True)
class Knob:
    name: str
    default: str  # as a user would write it; "" for unset
    meaning: str
    test_only: bool = False


KNOBS: tuple[Knob, ...] = (
    Knob("CKPTTOOL_DEBUG", "0", "1 (or true/yes/on): show the traceback behind an error, "
         "in every process"),
    Knob("CKPTTOOL_PROGRESS", "auto", "--progress's default: auto, bar, plain or none"),
    Knob("CKPTTOOL_FSYNC", "1", "0: do not fsync outputs before publishing them (scratch "
         "outputs a power cut may lose)"),
    Knob("CKPTTOOL_FORK", "1", "0: keep per-chunk work in one process instead of forked "
         "shares"),
    Knob("CKPTTOOL_DISTRIBUTED", "1", "0: ignore a launcher's RANK/WORLD_SIZE (a ckpttool "
         "run started from inside one rank of a training job)"),
    Knob("CKPTTOOL_DIST_TIMEOUT", "1800", "seconds to wait for the other processes of a "
         "shared merge"),
    Knob("CKPTTOOL_RESUME_PIECE", str(1 << 30), "bytes of output per piece of a resumable "
         "merge; merges larger than one piece are written resumably"),
    Knob("CKPTTOOL_ZSTD_MAX_RATIO", "1024", "how many times its compressed size a zstd "
         "record may claim (past 64 MiB) before it is refused unread; raise it for "
         "checkpoints of constant tensors"),
    # Documented in docs/multihost.md rather than README (README's size cap).
    Knob("CKPTTOOL_PART_SIZE", str(16 << 20), "bytes per part of a shared merge into object "
         "storage (raised to the store's minimum and to fit its part count)", test_only=True),
    Knob("CKPTTOOL_REQUEST_TIMEOUT", "30", "object-store request timeout (s); retries stop "
         "at 4x"),
    Knob("CKPTTOOL_LOCK_STALE", "600", "seconds without a heartbeat after which an object-"
         "store output lock counts as a killed run's"),
    Knob("CKPTTOOL_TEST_FAULT", "", "test hook: kill or pause at a publishing step "
         "(kill:N, pause:N:PIDFILE)", test_only=True),
    Knob("CKPTTOOL_TEST_FAIL_RANK", "", "test hook: fail one process of a shared merge "
         "(WHO:HOW)", test_only=True),
    Knob("CKPTTOOL_TEST_RESUME_KILL", "", "test hook: a resumable merge kills itself after "
         "recording N pieces", test_only=True),
    Knob("CKPTTOOL_TEST_REMOTE_FAULT", "", "test hook: fail or kill at a step of a remote "
         "upload", test_only=True),
)


TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
_warned: set[tuple[str, str]] = set()


def ignored(name: str, raw: str, expected: str) -> None:
    """Say on stderr, once per process, that ``name=raw`` was ignored and what it takes."""
    if (name, raw) in _warned:
        return
    _warned.add((name, raw))
    try:
        sys.stderr.write(f"ckpttool: warning: {name}={raw!r} ignored: expected {expected}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # no stderr to say it on
        pass


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    ignored(name, raw, "1, true, yes or on; 0, false, no or off")
    return default


PROGRESS_MODES = ("auto", "bar", "plain", "none")


def progress() -> str:
    """How progress shows on stderr (``CKPTTOOL_PROGRESS``): auto, bar, plain or none; a value
    that is none of them is ignored (auto), with a warning."""
    raw = os.environ.get("CKPTTOOL_PROGRESS")
    if raw is None or not raw.strip():
        return "auto"
    value = raw.strip().lower()
    if value in PROGRESS_MODES:
        return value
    ignored("CKPTTOOL_PROGRESS", raw, ", ".join(PROGRESS_MODES))
    return "auto"


def debug() -> bool:
    """Tracebacks behind errors (``CKPTTOOL_DEBUG=1``), in the parent and in forked children."""
    return _flag("CKPTTOOL_DEBUG", False)


def fsync() -> bool:
    """Sync outputs before publishing them (``CKPTTOOL_FSYNC=0`` skips it)."""
    return _flag("CKPTTOOL_FSYNC", True)


def fork() -> bool:
    """Per-chunk work may run in forked processes (``CKPTTOOL_FORK=0`` keeps one process)."""
    return _flag("CKPTTOOL_FORK", True)


def distributed() -> bool:
    """A launcher's variables are honoured (``CKPTTOOL_DISTRIBUTED=0`` ignores them)."""
    return _flag("CKPTTOOL_DISTRIBUTED", True)


def _positive(name: str, default: float, kind: type[float] | type[int], what: str
              ) -> float:
    """``name``'s value as a positive number of ``kind`` (finite), else ``default`` where
    unset (an empty ``CKPTTOOL_PART_SIZE`` too).

    Raises:
        OutputError: set, and not such a number (the message gives the default).
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if not 0 < value < float("inf"):
        shown = f"{default:g}" if kind is float else str(int(default))
        raise OutputError(f"{name}={raw!r}: expected {what} above 0, e.g. {shown}")
    return value


DIST_TIMEOUT_DEFAULT = 1800.0


def dist_timeout() -> float:
    """Seconds to wait for the other processes of a shared merge (``CKPTTOOL_DIST_TIMEOUT``).

    Raises:
        OutputError: the value is not a number of seconds above 0.
    """
    return _positive("CKPTTOOL_DIST_TIMEOUT", DIST_TIMEOUT_DEFAULT, float, "a number of seconds")


LOCK_STALE_DEFAULT = 600.0


def lock_stale() -> float:
    """Seconds after its last heartbeat that an object-store output lock is taken as a killed
    run's and removed (``CKPTTOOL_LOCK_STALE``); a run renews its lock every quarter of it.

    Raises:
        OutputError: the value is not a number of seconds above 0.
    """
    return _positive("CKPTTOOL_LOCK_STALE", LOCK_STALE_DEFAULT, float, "a number of seconds")


RESUME_PIECE_DEFAULT = 1 << 30  # a piece costs a pass of the engine: at 256 MiB, 5-8% on 1.5 GB


def resume_piece() -> int:
    """Bytes of output per piece of a resumable merge (``CKPTTOOL_RESUME_PIECE``); a merge
    of one piece or less is written whole (quicker to redo than to check).

    Raises:
        OutputError: the value is not a positive number of bytes.
    """
    return int(_positive("CKPTTOOL_RESUME_PIECE", RESUME_PIECE_DEFAULT, int,
                         "a positive number of bytes"))


REQUEST_TIMEOUT_DEFAULT = 30.0
# A request and its retries give up once this many request timeouts have passed.
REQUEST_DEADLINE_TIMES = 4
PART_SIZE_DEFAULT = 16 << 20


def part_size() -> int:
    """Bytes per part of a shared merge into object storage (``CKPTTOOL_PART_SIZE``).

    Raises:
        OutputError: not a positive whole number.
    """
    return int(_positive("CKPTTOOL_PART_SIZE", PART_SIZE_DEFAULT, int,
                         "a positive number of bytes"))


def request_timeout() -> float:
    """Seconds a request to object storage may wait to connect or for the next bytes of its
    answer (``CKPTTOOL_REQUEST_TIMEOUT``); every store's client takes it.

    Raises:
        OutputError: the value is not a number of seconds above 0.
    """
    return _positive("CKPTTOOL_REQUEST_TIMEOUT", REQUEST_TIMEOUT_DEFAULT, float,
                     "a number of seconds")


def request_deadline() -> float:
    """Seconds after which a request and its retries give up: a store that accepts requests
    and never answers ends the command (exit 3) instead of keeping it silent."""
    return REQUEST_DEADLINE_TIMES * request_timeout()


def test_resume_kill() -> int | None:
    """Test hook: a resumable merge kills itself (SIGKILL) after recording this many pieces
    (core.merge.resume)."""
    raw = os.environ.get("CKPTTOOL_TEST_RESUME_KILL", "")
    return int(raw) if raw.isdigit() else None


def zstd_max_ratio() -> int | None:
    """How many times its compressed size a zstd record may claim (``CKPTTOOL_ZSTD_MAX_RATIO``,
    a positive integer); None: the default bound."""
    raw = os.environ.get("CKPTTOOL_ZSTD_MAX_RATIO", "")
    if raw.strip().isdigit() and int(raw) > 0:
        return int(raw)
    if raw.strip():
        ignored("CKPTTOOL_ZSTD_MAX_RATIO", raw, "a whole number above 0")
    return None


def test_remote_fault() -> str:
    """Test hook: a fault at a step of a remote upload (storage.outputs)."""
    return os.environ.get("CKPTTOOL_TEST_REMOTE_FAULT", "")


def test_fault() -> str:
    """Test hook: ``kill:N`` or ``pause:N:PIDFILE`` at publishing step N (storage.outputs)."""
    return os.environ.get("CKPTTOOL_TEST_FAULT", "")


def test_fail_rank() -> str:
    """Test hook: ``WHO:HOW``, one process of a shared merge fails (core.merge.multihost)."""
    return os.environ.get("CKPTTOOL_TEST_FAIL_RANK", "")


def table() -> str:
    """The README's table of variables (markdown), generated from :data:`KNOBS`."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k.name}` | `{k.default}` | {k.meaning} |" for k in KNOBS if not k.test_only]
    return "\n".join(rows) + "\n"
