"""The exception hierarchy. Imports nothing else from ckpttool.

The CLI maps each class to an exit code in one place (``ckpttool.cli``); library users catch
:class:`CkptError`. Messages are one line: what is wrong, where (path, tensor, byte offset) and
what to do next.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base of every error ckpttool raises on purpose."""

    exit_code = 3


class InputError(CkptError):
    """Missing path, not a checkpoint, truncated or corrupt file, unsafe content, bad option."""

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
