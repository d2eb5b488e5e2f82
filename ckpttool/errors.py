"""The exception hierarchy. Imports nothing else from ckpttool.

The CLI maps each class to an exit code in one place (``ckpttool.cli``); library users catch
:class:`CkptError`. Messages are one line: what is wrong, where (path, tensor, byte offset) and
what to do next.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base of every error ckpttool raises on purpose."""

    exit_code = 3

    def __str__(self) -> str:
        # One line, whatever a message quotes (an exception text from a damaged file may hold
        # line breaks).
        return " ".join(super().__str__().splitlines())


class InputError(CkptError):
    """Missing path, not a checkpoint, truncated or corrupt file, unsafe content, bad option."""

    exit_code = 3


class UsageError(InputError):
    """Options that cannot work together, or with this input (``reshard`` of DCP without
    ``--ranks``, ``--slice 3/3``): the command line is wrong, not the checkpoint (exit 2, as
    for an unknown option)."""

    exit_code = 2


class UnreadableError(InputError):
    """A file that is there but this process may not read (permissions): a problem of the
    environment, not damage in the checkpoint, so ``verify`` stops on it (exit 3) instead of
    reporting every tensor stored in it."""

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


class AccessError(CkptError):
    """The store refused a request (access denied, bad or missing credentials): a problem
    of credentials or permissions, never damage in the checkpoint, so nothing that reports
    damage (``verify``'s findings, "corrupt" messages) catches it: one line, exit 3."""

    exit_code = 3


class UnsupportedError(CkptError):
    """A valid checkpoint that uses something ckpttool does not handle yet."""

    exit_code = 4


class IntegrityError(CkptError):
    """What verification finds: ties, dtypes, coverage, mismatches."""

    exit_code = 1


class OutputError(CkptError):
    """The output cannot be written: it exists already, no space, no permission."""

    exit_code = 3
