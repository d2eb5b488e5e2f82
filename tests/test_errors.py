"""The one codec of an error crossing processes (errors.to_wire / from_wire): a forked
share's pipe and torchrun's gather both use it."""

from __future__ import annotations

import json

import pytest

from ckpttool import errors


@pytest.mark.parametrize("cls", [errors.CkptError, errors.InputError, errors.UsageError,
                                 errors.UnreadableError, errors.TransportError,
                                 errors.AccessError, errors.UnsupportedError,
                                 errors.IntegrityError, errors.OutputError])
def test_every_class_comes_back_as_itself(cls: type[errors.CkptError]) -> None:
    doc = json.loads(json.dumps(errors.to_wire(cls("x.bin: truncated; copy it again"))))
    back = errors.from_wire(doc, "rank 1 failed: ")
    assert type(back) is cls and str(back) == "rank 1 failed: x.bin: truncated; copy it again"
    assert back.exit_code == cls.exit_code


def test_other_exceptions_are_not_ours() -> None:
    doc = errors.to_wire(ValueError("boom"))
    assert doc == {"error": "ValueError('boom')", "kind": "internal"}
    assert errors.from_wire(doc) is None


@pytest.mark.parametrize("kind", ["Exception", "SystemExit", "system", "__class__", None, 3])
def test_only_this_modules_classes_are_made(kind: object) -> None:
    # The name comes from another process: nothing outside errors.py is looked up.
    assert errors.from_wire({"kind": kind, "error": "x"}) is None


@pytest.mark.parametrize(("cls", "exit_code", "code"), [
    (errors.CkptError, 3, "input"), (errors.InputError, 3, "input"),
    (errors.UsageError, 2, "usage"), (errors.UnreadableError, 3, "unreadable"),
    (errors.TransportError, 3, "transport"), (errors.AccessError, 3, "input"),
    (errors.UnsupportedError, 4, "unsupported"), (errors.IntegrityError, 1, "integrity"),
    (errors.OutputError, 3, "output")])
def test_the_class_carries_exit_status_and_code(cls: type[errors.CkptError], exit_code: int,
                                                code: str) -> None:
    # What a failed command's --json document says (cli/failure.py reads both from here).
    assert (cls.exit_code, cls.code) == (exit_code, code)
