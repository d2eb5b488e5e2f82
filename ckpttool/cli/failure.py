"""How a failed command ends: one ``ckpttool: error:`` line on stderr and, with ``--json``, one
JSON document on stdout as well (``ok: false``, the exit code, the error's code and text), so
that ``ckpttool merge ... --json | jq .`` reads a document whatever happened.

:func:`ckpttool.cli.common.exit_codes` records each error it maps (:func:`record`); the
program's :func:`ckpttool.cli.main` prints the document once the command is over, for the
errors raised before a command runs too (an unknown option, a bad value: Typer's usage
errors, made one line here by :func:`usage_line`)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from ckpttool import errors

# The error codes of the failure document, by exit status where nothing more is known: each
# status's class (ckpttool.errors), and an interrupt's.
CODE_BY_EXIT = {c.exit_code: c.code for c in (
    errors.IntegrityError, errors.UsageError, errors.InputError, errors.UnsupportedError,
    errors.InternalError)} | {130: "interrupted"}

COMMANDS = ("merge", "inspect", "verify", "reshard")


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a command failed: its exit status, a stable code for scripts, the message."""

    exit_code: int
    code: str
    message: str


_recorded: list[Failure] = []
_printed: list[bool] = []


def record(exit_code: int, code: str, message: str) -> None:
    """Note why the command fails (the first reason wins: later ones are consequences)."""
    if not _recorded:
        _recorded.append(Failure(exit_code, code, message))


def printed_document() -> None:
    """Note that the command printed its own document on stdout (verify's failed report, a
    sweep's lines): no failure document is added after it."""
    _printed.append(True)


def reset() -> None:
    """Forget what an earlier command in this process recorded (the program runs one)."""
    _recorded.clear()
    _printed.clear()


def wants_json(args: list[str]) -> bool:
    """``--json`` among the options (before a ``--``)."""
    for a in args:
        if a == "--":
            return False
        if a == "--json":
            return True
    return False


def command_of(args: list[str]) -> str | None:
    """The command named on the command line (merge, inspect, verify, reshard), if any."""
    for a in args:
        if a in COMMANDS:
            return a
        if not a.startswith("-"):
            return None
    return None


def usage_line(e: BaseException) -> tuple[int, str] | None:
    """(exit status, one-line message) for a usage error of the command-line parser (Typer's
    ``BadParameter``, an unknown option, a missing argument; the help itself where nothing
    was given); None for any other exception.
    Read through the documented attributes of these exceptions (``exit_code``,
    ``format_message()``, ``ctx``): no parser internals."""
    exit_code = getattr(e, "exit_code", None)
    format_message = getattr(e, "format_message", None)
    if not isinstance(exit_code, int) or not callable(format_message):
        return None
    text = str(format_message())
    if text.startswith("Usage:"):  # no arguments at all: the help is the message, as it is
        return exit_code, text.rstrip("\n")
    message = " ".join(text.split("\n")).strip()
    ctx = getattr(e, "ctx", None)
    path = getattr(ctx, "command_path", None) if ctx is not None else None
    if isinstance(path, str) and path:
        message = message.rstrip(".") + f"; see '{path} --help'"
    return exit_code, message


def document(command: str | None, exit_code: int) -> dict[str, Any]:
    """The ``--json`` document of a failed command."""
    from ckpttool.core.runtime.report import SCHEMA

    failure = _recorded[0] if _recorded else Failure(
        exit_code, CODE_BY_EXIT.get(exit_code, "error"), "")
    return {"schema": SCHEMA, "command": command, "ok": False, "exit_code": exit_code,
            "error": {"code": failure.code, "message": failure.message}}


def finish(args: list[str], exit_code: int) -> None:
    """At the end of the program: with ``--json``, a failed command that printed no document
    of its own prints the failure document."""
    if exit_code == 0 or _printed or not wants_json(args):
        return
    try:
        sys.stdout.write(json.dumps(document(command_of(args), exit_code), indent=2) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):  # stdout went away: the exit status still says it
        pass
