"""The ``ckpttool`` command line. Thin: each command validates flags, calls one library function
and renders its report. Nothing here imports torch at start-up, so ``--help`` and shell
completion stay fast."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
import warnings
from typing import Annotated, Any

import typer
import typer.core

from ckpttool.cli import failure
from ckpttool.cli.apply import EPILOG as APPLY_EPILOG
from ckpttool.cli.apply import apply_command
from ckpttool.cli.common import STOP_SIGNALS, err, interrupted_code, stopped
from ckpttool.cli.diff import EPILOG as DIFF_EPILOG
from ckpttool.cli.diff import diff_command
from ckpttool.cli.inspect import EPILOG as INSPECT_EPILOG
from ckpttool.cli.inspect import inspect_command
from ckpttool.cli.merge import EPILOG as MERGE_EPILOG
from ckpttool.cli.merge import merge_command
from ckpttool.cli.reshard import EPILOG as RESHARD_EPILOG
from ckpttool.cli.reshard import reshard_command
from ckpttool.cli.verify import EPILOG as VERIFY_EPILOG
from ckpttool.cli.verify import verify_command


class _Command(typer.core.TyperCommand):
    """Usage lines as click and POSIX write them, ``ckpttool merge [OPTIONS] SRC OUT``: typer
    0.27+ puts a required argument in braces (``{SRC}``), read as a set or a placeholder to
    type literally."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:  # click's or typer's vendored Context
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p
                for p in super().collect_usage_pieces(ctx)]


app = typer.Typer(
    name="ckpttool",
    help="Merge, inspect, verify and reshard sharded PyTorch (FSDP / DCP) checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
# short_help: the command list shows these whole (else a docstring is cut mid-sentence).
app.command("merge", cls=_Command, epilog=MERGE_EPILOG,
            short_help="Merge a checkpoint (any format) into Hugging Face safetensors.")(
    merge_command)
app.command("reshard", cls=_Command, epilog=RESHARD_EPILOG,
            short_help="Change a checkpoint's ranks, shard size or format.")(reshard_command)
app.command("inspect", cls=_Command, epilog=INSPECT_EPILOG,
            short_help="Show what a checkpoint holds.")(inspect_command)
app.command("verify", cls=_Command, epilog=VERIFY_EPILOG,
            short_help="Check a checkpoint is whole; compare it with another.")(verify_command)
app.command("diff", cls=_Command, epilog=DIFF_EPILOG,
            short_help="Show which tensors differ between two checkpoints.")(diff_command)
app.command("apply", cls=_Command, epilog=APPLY_EPILOG,
            short_help="Rebuild a checkpoint from its base and a delta of diff.")(apply_command)

# torch built without numpy warns "Failed to initialize NumPy" (two lines) when imported;
# ckpttool needs no numpy from torch, so the warning says nothing to a ckpttool user.
NUMPY_WARNING = "Failed to initialize NumPy"


def _version(value: bool) -> None:
    if value:
        from ckpttool.version import __version__

        print(f"ckpttool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True,
                                          help="Show the version and exit.")] = False,
) -> None:
    """Merge, inspect, verify and reshard sharded PyTorch (FSDP / DCP) checkpoints."""
    # Every command imports torch lazily, after this: the filter covers each import.
    warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)


def main() -> None:
    # A reader that goes away (ckpttool inspect X | head -1) ends us quietly, as it ends cat:
    # status 141, no traceback, never 1 (which verify uses for "errors found").
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # Ctrl-C at any moment exits 130 (SIGTERM 143, SIGHUP 129: the same clean-up): inside a
    # command exit_codes() says so and cleans up; before or after it (start-up, rendering,
    # shutdown) the status still says interrupted.
    interrupted = False

    def on_stop(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True
        stopped(signum)
        raise KeyboardInterrupt

    for s in STOP_SIGNALS:
        signal.signal(s, on_stop)
    if os.environ.get("_CKPTTOOL_COMPLETE"):
        # A shell asks for completions: Typer renders each description with rich, which wraps
        # it at the terminal width (80 columns when not a terminal), and fish and zsh cut a
        # description at the first newline. Each shell fits the one line to its own width.
        os.environ["COLUMNS"] = "100000"
    code: int | str | None = 0
    args = sys.argv[1:]
    failure.reset()
    try:
        # Not standalone: the parser's usage errors come here, to be said in one line.
        code = app(prog_name="ckpttool", args=args, standalone_mode=False)
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        interrupted = True
    except Exception as e:
        usage = failure.usage_line(e)
        if usage is None:
            raise
        code, message = usage
        if message.startswith("Usage:"):  # the help, for a command line with nothing on it
            print(message, file=sys.stderr, flush=True)
        else:
            err(f"ckpttool: error: {message}")
        failure.record(code, "usage", message)
    if interrupted:
        code = interrupted_code()
    if code is None:  # the command returned: success
        code = 0
    if isinstance(code, int):
        failure.finish(args, code)
    for s in STOP_SIGNALS:
        signal.signal(s, _interrupted_at_exit)
    # The command is over (its outputs closed, its context managers exited): what it made is
    # freed at shutdown by reference counts, and the collector's passes at shutdown would walk
    # all of it first (a 1M-chunk inspect: 0.09 -> 0.04 s from here to the exit). Frozen
    # objects are left to those counts.
    gc.freeze()
    sys.exit(interrupted_code() if interrupted else code)


def run() -> None:
    """The program (``ckpttool``, ``python -m ckpttool``): :func:`main`, then the process
    ends at once (:func:`_leave`). :func:`main` itself ends by raising ``SystemExit``, for
    callers that go on after it."""
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            _leave(e.code or 0)
        raise


def _leave(code: int) -> None:
    """End the process with ``code`` once the command is over, without tearing the interpreter
    down: the exit handlers run and the streams are flushed, then ``os._exit``. Tearing down
    frees every module's objects one by one and runs libtorch's static destructors, which
    nothing here needs (the outputs are closed and in place; no file object holds unwritten
    bytes): measured after a LoRA fold with torch loaded, 0.155-0.205 s of one core from
    here to the exit, 0.035-0.040 s this way. Returns (the caller then exits as usual) while
    a thread that an exit would wait for is alive, or if a stream cannot be flushed (the
    usual exit reports it)."""
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        return
    # atexit._run_exitfuncs is CPython's, not documented (here only; tests/cli/test_exit.py
    # fails loudly if it moves): the handlers registered with atexit (coverage's data, a
    # library's clean-up) run as a normal exit would run them.
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except (OSError, ValueError):
        return
    os._exit(code)


def _interrupted_at_exit(signum: int, frame: object) -> None:
    """Ctrl-C (SIGTERM, SIGHUP) while the interpreter shuts down: the work is done; exit
    128 + the signal at once."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)
