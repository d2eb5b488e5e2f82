"""The exception hierarchy. Imports nothing else from ckpttool.

Each class carries its exit code, and the CLI reads it from the error (``ckpttool.cli``):
every exit status ckpttool chooses comes from a class here (:class:`InternalError` for a bug),
but an interrupt's (128 + the signal). Library users catch :class:`CkptError`. Messages are
one line: what is wrong, where (path, tensor, byte offset) and what to do next.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base of every error ckpttool raises on purpose. Each class carries its exit status
    and the stable ``code`` of a failed command's ``--json`` document: the CLI reads both
    from the error, and keeps no table of its own."""

    exit_code = 3
    code = "input"

    def __str__(self) -> str:
        # One line, whatever a message quotes (an exception text from a damaged file may hold
        # line breaks).
        return " ".join(super().__str__().splitlines())


class InputError(CkptError):
    """Missing path, not a checkpoint, truncated or corrupt file, unsafe content, bad option."""

    exit_code = 3
    code = "input"


class UsageError(InputError):
    """Options that cannot work together, or with this input (``reshard`` of DCP without
    ``--ranks``, ``--slice 3/3``): the command line is wrong, not the checkpoint (exit 2, as
    for an unknown option)."""

    exit_code = 2
    code = "usage"


class UnreadableError(InputError):
    """A file that is there but this process may not read (permissions): a problem of the
    environment, not damage in the checkpoint, so ``verify`` stops on it (exit 3) instead of
    reporting every tensor stored in it."""

    code = "unreadable"

    @classmethod
    def of(cls, path: object, e: OSError) -> UnreadableError:
        """The one message for ``path`` that ``e`` (a ``PermissionError``...) kept us from
        reading."""
        return cls(f"{path}: cannot read it: {e.strerror or e}; make it readable for this "
                   "user (chmod a+r, and a+x on its directories) or run as its owner")


class TransportError(CkptError):
    """The storage a checkpoint is on did not answer properly (a reset connection, a
    timeout, a short body, a server error, throttling) after bounded retries: a problem of
    the network or the store, never damage in the checkpoint, so nothing that reports damage
    (``verify``'s findings, "corrupt" messages) catches it."""

    exit_code = 3
    code = "transport"


class AccessError(CkptError):
    """The store refused a request (access denied, bad or missing credentials): a problem
    of credentials or permissions, never damage in the checkpoint, so nothing that reports
    damage (``verify``'s findings, "corrupt" messages) catches it: one line, exit 3."""

    exit_code = 3


class UnsupportedError(CkptError):
    """A valid checkpoint that uses something ckpttool does not handle yet."""

    exit_code = 4
    code = "unsupported"


class MissingLibraryError(UnsupportedError):
    """A library this needs is not installed (torch, zstandard, boto3): exit 4, the message
    naming the install line."""

    code = "missing-library"


class IntegrityError(CkptError):
    """What verification finds: ties, dtypes, coverage, mismatches."""

    exit_code = 1
    code = "integrity"


class OutputError(CkptError):
    """The output cannot be written: it exists already, no space, no permission."""

    exit_code = 3
    code = "output"


class InternalError(CkptError):
    """A bug in ckpttool. Never raised on purpose: the exit status and code of any exception
    that is not a :class:`CkptError` (the CLI's traceback, a sweep's failed checkpoint, a
    forked worker's status), kept here so that every exit status comes from this module."""

    exit_code = 70
    code = "bug"


# --------------------------------------------------------------------------------------------
# The one codec of an error that crosses to another process (a forked share's pipe,
# torchrun's gather): JSON-able, and raised again there as the same class.


def to_wire(e: BaseException) -> dict[str, str]:
    """``e`` as another process reads it: ``kind``, the name of a ckpttool error class
    (``"internal"`` for any other exception), and ``error``, its message."""
    if isinstance(e, CkptError):
        return {"error": str(e) or type(e).__name__, "kind": type(e).__name__}
    return {"error": repr(e), "kind": "internal"}


def from_wire(doc: dict[str, object], context: str = "") -> CkptError | None:
    """The error :func:`to_wire` sent, as this process raises it (its message after
    ``context``); None for an exception that is not ckpttool's. Only the classes of this
    module are made: the name comes from another process."""
    kind = doc.get("kind")
    cls = next((c for c in _classes() if c.__name__ == kind), None)
    return None if cls is None else cls(f"{context}{doc.get('error')}")


def _classes() -> list[type[CkptError]]:
    found: list[type[CkptError]] = [CkptError]
    for cls in found:
        found += [c for c in cls.__subclasses__() if c.__module__ == __name__]
    return found
