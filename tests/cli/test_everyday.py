"""Everyday use (issue 38): ``--json`` on failure, one-line usage errors, progress in logs,
run directories given as a checkpoint, flag spellings, the API's names.

Each test here failed (or the feature was missing) before the change it pins. The program is
run through :func:`ckpttool.cli.main`, as the ``ckpttool`` command runs it (a ``CliRunner``
bypasses the program's own handling of the parser's errors)."""

from __future__ import annotations

import gc
import json
import signal
import sys
from pathlib import Path

import pytest

import ckpttool
from ckpttool.cli import main


class Ran:
    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        self.code, self.stdout, self.stderr = code, stdout, stderr

    def doc(self) -> dict[str, object]:
        doc = json.loads(self.stdout)
        assert isinstance(doc, dict)
        return doc


def program(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
            *args: str | Path) -> Ran:
    """``ckpttool ARGS`` as the program runs it, in this process."""
    monkeypatch.setattr(sys, "argv", ["ckpttool", *map(str, args)])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGPIPE)}
    capsys.readouterr()
    try:
        main()
    except SystemExit as e:
        code = 0 if e.code is None else e.code
    else:
        raise AssertionError("main() returned")
    finally:
        gc.unfreeze()
        for s, h in handlers.items():
            signal.signal(s, h)
    out, err = capsys.readouterr()
    assert isinstance(code, int)
    return Ran(code, out, err)


# -- --json on failure: one document, whatever failed


def failure_doc(r: Ran, command: str | None, exit_code: int, code: str) -> str:
    assert r.code == exit_code, r.stderr
    doc = r.doc()
    assert doc["ok"] is False and doc["command"] == command and doc["exit_code"] == exit_code
    assert doc["schema"] == 1
    error = doc["error"]
    assert isinstance(error, dict) and error["code"] == code, error
    assert isinstance(error["message"], str)
    return error["message"]


def test_json_on_a_missing_input(capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for command in ("merge", "reshard"):
        extra = ("--to", "safetensors") if command == "reshard" else ()
        r = program(capsys, monkeypatch, command, tmp_path / "nosuch", tmp_path / "o",
                    *extra, "--json")
        message = failure_doc(r, command, 3, "input")
        assert message == f"{tmp_path / 'nosuch'}: no such file or directory"
        assert r.stderr == f"ckpttool: error: {message}\n"
    for command in ("inspect", "verify"):
        r = program(capsys, monkeypatch, command, tmp_path / "nosuch", "--json")
        failure_doc(r, command, 3, "input")


def test_json_on_usage_errors_of_the_parser_and_of_a_command(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    r = program(capsys, monkeypatch, "merge", tmp_path, tmp_path / "o", "--dtype", "x",
                "--json")
    message = failure_doc(r, "merge", 2, "usage")
    assert message == ("Invalid value for '--dtype': 'x' is not one of auto, keep, bf16, fp16, "
                       "fp32 (or bfloat16, float16, float32); see 'ckpttool merge --help'")
    # One line in ckpttool's words, not the parser's four (Usage / Try / blank / Error).
    assert r.stderr == f"ckpttool: error: {message}\n"
    r = program(capsys, monkeypatch, "inspect", tmp_path, "--bogus", "--json")
    assert "No such option: --bogus" in failure_doc(r, "inspect", 2, "usage")
    r = program(capsys, monkeypatch, "merge", tmp_path, "--json")
    assert failure_doc(r, "merge", 2, "usage") == ("Missing argument 'OUT'; see 'ckpttool "
                                                   "merge --help'")
    r = program(capsys, monkeypatch, "verify", tmp_path, "--write-manifest", "a",
                "--check-manifest", "b", "--json")
    assert "pass one of --write-manifest and --check-manifest" in failure_doc(
        r, "verify", 2, "usage")
    r = program(capsys, monkeypatch, "merge", tmp_path, tmp_path / "o", "--slice", "3/3",
                "--json")
    failure_doc(r, "merge", 2, "usage")  # the library's UsageError


def test_without_json_a_usage_error_prints_nothing_on_stdout(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    r = program(capsys, monkeypatch, "merge", tmp_path, tmp_path / "o", "--dtype", "x")
    assert r.code == 2 and r.stdout == ""
    assert r.stderr.startswith("ckpttool: error: Invalid value for '--dtype'")
    assert r.stderr.count("\n") == 1
    # No arguments at all: the help, as before (exit 2).
    r = program(capsys, monkeypatch)
    assert r.code == 2 and r.stderr.startswith("Usage: ckpttool [OPTIONS] COMMAND")


def test_json_on_output_unsupported_bug_and_interrupt(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        uneven_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert program(capsys, monkeypatch, "merge", uneven_ckpt, out).code == 0
    r = program(capsys, monkeypatch, "merge", uneven_ckpt, out, "--json")
    assert "--overwrite" in failure_doc(r, "merge", 3, "output")

    def raising(e: BaseException):  # type: ignore[no-untyped-def]
        def boom(*args: object, **kwargs: object) -> None:
            raise e
        return boom

    for e, exit_code, code in ((ckpttool.UnsupportedError("not yet"), 4, "unsupported"),
                               (RuntimeError("boom"), 70, "bug"),
                               (KeyboardInterrupt(), 130, "interrupted")):
        monkeypatch.setattr("ckpttool.core.merge.operation.plan_merge", raising(e))
        r = program(capsys, monkeypatch, "merge", uneven_ckpt, tmp_path / "o2", "--json")
        message = failure_doc(r, "merge", exit_code, code)
        assert {"unsupported": "not yet", "bug": "RuntimeError: boom"}.get(code, message) \
            == message


def test_json_of_a_failed_verify_is_its_report(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        uneven_ckpt: Path, tmp_path: Path) -> None:
    r = program(capsys, monkeypatch, "verify", uneven_ckpt, "--expect-dtype", "fp16", "--json")
    assert r.code == 1
    doc = r.doc()  # one document: the report, not a failure document after it
    assert doc["ok"] is False and "problems" in doc


def test_version_short_flag(capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    for flag in ("--version", "-V"):
        r = program(capsys, monkeypatch, flag)
        assert (r.code, r.stdout) == (0, f"ckpttool {ckpttool.__version__}\n")
