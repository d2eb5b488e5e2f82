"""What every command shares: error-to-exit-code mapping, output streams, progress, sizes."""

from __future__ import annotations

import itertools
import json
import operator
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps' own escaper
from pathlib import Path
from typing import Annotated, Any

import typer

from ckpttool import settings
from ckpttool.cli import failure
from ckpttool.errors import (
    CkptError,
    InputError,
    IntegrityError,
    InternalError,
    MissingLibraryError,
    UnreadableError,
    UnsupportedError,
    UsageError,
)
from ckpttool.formats.codecs import dtypes
from ckpttool.units import human_bytes as human_bytes  # the one formatter

# Every status but success and an interrupt's is an error class's (ckpttool.errors).
EXIT_OK = 0
EXIT_PROBLEMS = IntegrityError.exit_code
EXIT_USAGE = UsageError.exit_code
EXIT_INPUT = InputError.exit_code
EXIT_UNSUPPORTED = UnsupportedError.exit_code
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C); SIGTERM 143, SIGHUP 129: 128 + the signal
EXIT_BUG = InternalError.exit_code

# What each exit status means, for every command (README's table is generated from this).
EXIT_MEANINGS: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success (`verify`: nothing at error severity)"),
    (EXIT_PROBLEMS, "`verify` found an error (`--strict`: or a warning); `diff`: a difference"),
    (EXIT_USAGE, "usage error: unknown option, bad value, options that do not go together"),
    (EXIT_INPUT, "bad input or output: missing path, not a checkpoint, truncated, corrupt or "
                 "unsafe file, unreadable file, output exists, no space"),
    (EXIT_UNSUPPORTED, "a valid checkpoint using something not supported yet, or a library it "
                       "needs that is not installed (torch, zstandard, boto3)"),
    (EXIT_BUG, "internal error: a bug in ckpttool (traceback shown; please report it)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C; SIGTERM: 143, SIGHUP: 129); temporary files "
                       "removed, a large local merge's pieces kept to resume"),
)

# Signals that stop a command as Ctrl-C does (clean-up, one line, 128 + the signal's number):
# what Slurm, Kubernetes, systemd and ``timeout`` send, and a closed terminal.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_stopped_by: list[int] = []


def stopped(signum: int) -> None:
    """Note the signal that stops the command (:data:`STOP_SIGNALS`), for its exit code."""
    _stopped_by.append(signum)


def interrupted_code() -> int:
    """128 + the number of the signal that stopped the command (130: Ctrl-C)."""
    return 128 + (_stopped_by[-1] if _stopped_by else signal.SIGINT)


def interrupted_message() -> str:
    """The one line for a stopped command: which signal, and what the next run finds (the
    finished pieces of a large merge only where they are still there: a remote output's
    staging directory is removed, so its merge starts again)."""
    from ckpttool.core.runtime import leftovers  # not at import: --help loads no core

    name = signal.Signals(interrupted_code() - 128).name
    kept = leftovers.resumable()
    line = (f"ckpttool: interrupted{'' if name == 'SIGINT' else f' ({name})'}; no incomplete "
            "output was put in place")
    if kept:
        return (f"{line}; the finished pieces of the merge are kept in {kept[0].parent}: the "
                "same command resumes from them")
    return line


# Characters a terminal acts on instead of showing: C0 and C1 controls and DEL (ESC sequences
# clear the screen or set the window title, CR and LF forge lines), and the bidirectional
# controls that reorder what is shown (U+202E), with the line and paragraph separators.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
                          "\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` for a terminal: every control or bidi character written as its Python escape
    (``\\x1b``, ``\\n``, ``\\u202e``), so a tensor name or file name from a checkpoint can
    neither run terminal commands nor forge a line. JSON output is never escaped this way: it
    stays exact."""
    return _UNPRINTABLE.sub(_escape, text)


def _escape(m: re.Match[str]) -> str:
    return repr(m.group())[1:-1]


def err(message: str) -> None:
    print(printable(message), file=sys.stderr, flush=True)


@contextmanager
def exit_codes() -> Iterator[None]:
    """Turn errors into one line on stderr and a documented exit code (no traceback unless
    ``CKPTTOOL_DEBUG=1``); unexpected exceptions are bugs: traceback and exit 70. A file this
    user may not read (exit 3) and a missing torch (exit 4) are never bugs, wherever they
    surface."""
    debug = settings.debug()
    try:
        yield
    except CkptError as e:
        raise _failed(e, debug=debug) from None
    except KeyboardInterrupt:
        message = interrupted_message()
        err(message)
        failure.record(interrupted_code(), "interrupted", message.removeprefix("ckpttool: "))
        raise typer.Exit(interrupted_code()) from None
    except (typer.Exit, typer.Abort, typer.BadParameter):
        raise
    except PermissionError as e:  # a file or directory this user may not read: not our bug
        raise _failed(UnreadableError.of(e.filename or '?', e), debug=debug) from None
    except ImportError as e:
        if (e.name or "").partition(".")[0] != "torch":
            raise _bug() from None
        raise _failed(MissingLibraryError(
            "this needs PyTorch (reading values, casting, writing DCP), which is not "
            "installed here; install it: pip install torch"), debug=debug) from None
    except Exception:  # noqa: BLE001 - anything else is our bug, reported as one
        raise _bug() from None


@contextmanager
def removes_new_dirs(out: str) -> Iterator[None]:
    """A command that fails (an error, Ctrl-C) leaves no empty output directory that it
    created: ``out`` and the parents it lacked are removed again where they are still empty.
    A directory that was there before, or holds anything (a slice's temporary files, another
    process's output), is left alone. Not for URLs."""
    from ckpttool.core.runtime import urls  # not at import: --help loads no core

    missing: list[Path] = []
    if not urls.is_url(out):
        p = Path(out).absolute()
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
    try:
        yield
    except BaseException:
        for d in missing:  # deepest first
            try:
                d.rmdir()
            except OSError:  # not empty (or gone): what is there is not ours to remove
                break
        raise


def _failed(e: CkptError, *, debug: bool) -> typer.Exit:
    """Report ``e`` (the exception being handled, or what it stands for): one line, the exit
    status and code of its class (the traceback with ``CKPTTOOL_DEBUG=1``)."""
    if debug:
        traceback.print_exc()
    err(f"ckpttool: error: {e}")
    failure.record(e.exit_code, e.code, str(e))
    return typer.Exit(e.exit_code)


def _bug() -> typer.Exit:
    """Report the exception being handled as a bug (traceback, exit 70)."""
    kind, text = sys.exc_info()[:2]
    traceback.print_exc()
    err("ckpttool: internal error (a bug in ckpttool); please report it with the traceback "
        "above")
    failure.record(InternalError.exit_code, InternalError.code,
                   f"{kind.__name__ if kind else 'error'}: {text}")
    return typer.Exit(InternalError.exit_code)


DTYPE_CHOICES = ", ".join(dtypes.CHOICES)


def epilog(examples: list[str], *notes: str) -> str:
    """A command's epilog: the examples as written, one per line (never re-wrapped to the
    terminal: a wrapped example breaks copy-paste), then paragraphs of notes."""
    # A paragraph after a line holding only "\b" is printed as is (the help formatter's
    # documented escape).
    block = "\n".join(f"  {e}" for e in examples)
    return "\n\n".join(["Examples:", f"\b\n{block}", *notes]) + "\n"


# Options every command that reads data takes, defined once.
FollowLinks = Annotated[bool, typer.Option(
    "--follow-links", help="Read data files that are links out of the checkpoint directory "
    "(shared-storage layouts); refused otherwise.")]
NoProgress = Annotated[bool, typer.Option(
    "--no-progress", help="No progress on stderr (--progress none).")]

JsonOutput = Annotated[bool, typer.Option(
    "--json", help="Print the report as one JSON document on stdout.")]
Iteration = Annotated[int | None, typer.Option(
    "--iteration", min=0, metavar="N", help="Of a Megatron-Core run directory: iteration N "
    "(iter_000000N/) instead of the one latest_checkpointed_iteration.txt names.")]
Workers = Annotated[int | None, typer.Option(
    min=1, metavar="N", help="Threads reading (and writing) data in parallel (default: the CPUs "
    "this process may use).")]


def completer(*choices: tuple[str, str]) -> Callable[[str], list[tuple[str, str]]]:
    """An ``autocompletion=`` function for an option's values: the choices that begin with
    what was typed, each with a one-line description (shells show it beside the value)."""

    # Typer's zsh completion loses an ASCII apostrophe in a description (it doubles it, and
    # zsh reads the pair as an empty quote): the typographic one shows in every shell.
    shown = [(value, about.replace("'", "\u2019")) for value, about in choices]

    def complete(incomplete: str) -> list[tuple[str, str]]:
        return [(value, about) for value, about in shown if value.startswith(incomplete)]

    return complete


def _progress_choice(value: str | None) -> str | None:
    if value is None or value in ("auto", "bar", "plain", "none"):
        return value
    raise typer.BadParameter(f"'{value}' is not one of auto, bar, plain, none")


ProgressMode = Annotated[str | None, typer.Option(
    "--progress", metavar="[auto|bar|plain|none]", callback=_progress_choice,
    autocompletion=completer(("auto", "a bar on a terminal, plain lines elsewhere"),
                             ("bar", "a bar, redrawn in place"),
                             ("plain", "a line every 10% or 30 s, for logs"),
                             ("none", "no progress")),
    help="Progress on stderr: auto (default; CKPTTOOL_PROGRESS) draws a bar on a terminal and "
    "writes a plain line every 10% or 30 s (bytes, rate, time left) to a log or pipe.")]


# --dtype's values (dtypes.CHOICES, in its order; a test keeps them equal) with descriptions.
DTYPE_VALUES = (("auto", "config.json's torch_dtype"), ("keep", "as stored"),
                ("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"))
complete_dtype = completer(*DTYPE_VALUES)
complete_expect_dtype = completer(*(v for v in DTYPE_VALUES if v[0] != "keep"))


Verbose = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Also print, on stderr: the checkpoint and the side files used, "
    "what was planned, and the time each phase took (planning, then moving the bytes).")]


Strict = Annotated[bool, typer.Option(
    "--strict", help="Exit 1 when there is any warning, for CI (a merge still writes its "
    "output; verify counts its warnings as errors).")]


def strict_exit(strict: bool, num_warnings: int) -> None:
    """``--strict``: warnings make the exit status 1 (after the report is printed)."""
    if strict and num_warnings:
        err(f"ckpttool: error: {count(num_warnings, 'warning')} and --strict: exit 1")
        raise typer.Exit(EXIT_PROBLEMS)


def quiet_or_verbose(quiet: bool, verbose: bool) -> None:
    """-q and -v together is a usage error (exit 2): one asks for less, the other for more."""
    if quiet and verbose:
        raise typer.BadParameter("pass one of --quiet and --verbose", param_hint="--verbose")


class Phases:
    """The wall time of a command's two phases, taken from the library's ``on_start`` call:
    planning (recognising the checkpoint, reading its metadata, the checks, the plan, importing
    torch where needed) until the first byte, then moving the bytes. For ``--verbose``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.began = time.perf_counter()
        self.started: float | None = None
        self.total = 0

    def callbacks(self, on_start: Callable[[int], None] | None,
                  progress: Callable[[int], None] | None
                  ) -> tuple[Callable[[int], None] | None, Callable[[int], None] | None]:
        """(on_start, progress) for the library: ``on_start`` also noted here."""
        if not self.enabled:
            return on_start, progress

        def start(total: int) -> None:
            self.started, self.total = time.perf_counter(), total
            if on_start is not None:
                on_start(total)

        return start, progress

    def line(self, doing: str, idle: str = "reading metadata only") -> str:
        """``timings: planning 0.42 s, writing 1.20 s (2.50 GB/s); 1.62 s in all``."""
        end = time.perf_counter()
        if self.started is None:  # nothing moved: metadata only, or a dry run
            return f"timings: {end - self.began:.2f} s in all, {idle}"
        moving = end - self.started
        rate = f" ({human_bytes(int(self.total / moving))}/s)" if moving > 0 else ""
        return (f"timings: planning {self.started - self.began:.2f} s, {doing} {moving:.2f} s"
                f"{rate}; "
                f"{end - self.began:.2f} s in all")


def verbose_lines(lines: list[str]) -> None:
    for line in lines:
        err(f"ckpttool: {line}")


def dtype_choice(value: str | None) -> str | None:
    """Typer callback for ``--dtype``-like options: one of ``dtypes.CHOICES``, also spelled as
    config.json and torch spell it (``bfloat16``, ``float16``, ``torch.float32``)."""
    if value is None:
        return None
    choice = dtypes.normalize_choice(value)
    if choice is None:
        raise typer.BadParameter(f"'{value}' is not one of {DTYPE_CHOICES} (or bfloat16, "
                                 "float16, float32)")
    return choice


def size_option(value: str) -> str:
    """Typer callback for ``--max-shard-size``: a malformed size is a usage error (exit 2)."""
    from ckpttool.errors import InputError
    from ckpttool.units import parse_size

    try:
        parse_size(value)
    except InputError as e:
        raise typer.BadParameter(str(e)) from None
    return value


def print_json(doc: dict[str, Any]) -> None:
    """``doc`` indented, except that each object of a top-level list (inspect's tensors,
    verify's problems) is one line, ``json.dumps`` of it: greppable, and written by C code,
    which a document of 15,000 tensors needs (``indent`` takes Python's: 4x slower)."""
    from ckpttool._gc import gc_paused

    failure.printed_document()
    with gc_paused():  # a string per row, none of them garbage: not worth walking the heap
        text = _layout(doc)
    sys.stdout.write(text)
    sys.stdout.write("\n")


def _layout(doc: dict[str, Any]) -> str:
    # Pieces joined once: the rows are most of the text (20 MB for 15,000 tensors), and each
    # copy of them costs its page faults.
    out: list[str] = []
    for key, value in doc.items():
        out.append(",\n  " if out else "{\n  ")
        out.append(json.dumps(key) + ": ")
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            rows = _table(value)
            if rows is None:
                encoded: dict[tuple[str, ...], str] = {}
                rows = [_item(v, encoded) for v in value]
            out.append("[\n    ")
            out += itertools.chain.from_iterable(zip(rows, itertools.repeat(",\n    ")))
            out[-1] = "\n  ]"
        else:
            out.append(json.dumps(value, indent=2).replace("\n", "\n  "))
    if not out:
        return "{}"
    out.append("\n}")
    return "".join(out)


def _table(items: list[dict[str, Any]]) -> list[str] | None:
    """Each item's ``json.dumps``, the same text, written a column at a time where the items
    have one set of string keys in one order (inspect's tensor rows): a column of strings by
    json's own C escaper, of ints by ``int.__repr__`` (what its encoder calls), lists of
    strings or of ints once per distinct list, anything else by ``json.dumps``; then each row
    by one ``%``. Python runs per column, not per value (15,000 rows: the whole layout took
    0.25 s of CPU, now 0.13). None where the items differ in their keys."""
    keys = items[0].keys()
    if not keys or set(map(type, keys)) - {str} or len(set(map(tuple, items))) != 1:
        return None
    columns = []
    for key in keys:
        column = list(map(operator.itemgetter(key), items))
        kinds = set(map(type, column))
        if kinds == {str}:
            columns.append(list(map(_json_str, column)))
        elif kinds == {int}:
            columns.append(list(map(int.__repr__, column)))
        elif kinds == {type(None)}:
            columns.append(["null"] * len(column))
        elif kinds == {list} and (lists := _same_json(column)) is not None:
            text = {t: json.dumps(list(t)) for t in dict.fromkeys(lists)}
            columns.append(list(map(text.__getitem__, lists)))
        else:
            columns.append(list(map(json.dumps, column)))
    row = "{" + ", ".join(_json_str(k).replace("%", "%%") + ": %s" for k in keys) + "}"
    return list(map(row.__mod__, zip(*columns, strict=True)))


def _same_json(column: list[list[Any]]) -> list[tuple[Any, ...]] | None:
    """The lists as tuples, where equal tuples have the same JSON: lists of strings or of
    ints only. 1 == 1.0 == True, so for ints every value's type is looked at; a string
    equals only strings, so for strings the values of the distinct lists are enough. None
    otherwise."""
    try:
        lists = list(map(tuple, column))
        kinds = set(map(type, itertools.chain.from_iterable(dict.fromkeys(lists))))
    except TypeError:  # an unhashable value in a list
        return None
    if kinds <= {str}:
        return lists
    if kinds == {int} and set(map(type, itertools.chain.from_iterable(column))) == {int}:
        return lists
    return None


_LONG = 16  # names in a list worth encoding once for every item that has the same
_KEYS: dict[str, str] = {}  # a key's JSON and the ": " after it, by the key


def _item(v: dict[str, Any], encoded: dict[tuple[str, ...], str]) -> str:
    """``json.dumps(v)``, the same text, a value at a time: strings, ints and None written by
    json's own C escaper and ``int.__repr__`` (what its encoder calls), a long list of names
    (inspect's data files: 64 in each of 15,000 rows, most of the document) encoded once per
    distinct list, anything else by ``json.dumps``. For items whose keys differ (where
    :func:`_table` cannot take them)."""
    parts = []
    for k, x in v.items():
        key = _KEYS.get(k) if type(k) is str else None
        if key is None:
            if type(k) is not str:
                return json.dumps(v)  # json's own conversion of the key
            key = _KEYS[k] = _json_str(k) + ": "
        t = type(x)
        if t is str:
            parts.append(key + _json_str(x))
        elif t is int:
            parts.append(key + int.__repr__(x))
        elif x is None:
            parts.append(key + "null")
        elif t is list and len(x) >= _LONG and all(type(n) is str for n in x):
            names = tuple(x)
            got = encoded.get(names)
            if got is None:
                got = encoded[names] = json.dumps(x)
            parts.append(key + got)
        else:
            parts.append(key + json.dumps(x))
    return "{" + ", ".join(parts) + "}"


def count(n: int, word: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"



# Below this terminal width the progress line drops the transfer columns (sizes, speed):
# rich wraps a line wider than the terminal into two rows, redrawn on every refresh.
NARROW_COLUMNS = 72


class ProgressBar:
    """Progress on stderr: a rich bar on a terminal, plain lines anywhere else (a log file, a
    pipe, ``TERM=dumb``: :mod:`ckpttool.cli.progress`), as ``--progress`` / ``CKPTTOOL_PROGRESS``
    choose (``auto`` by default).

    :meth:`begin` shows "planning" with the time spent (recognising the checkpoint, reading
    its metadata, importing torch: seconds before the first byte moves, which a bar at 0%
    would not explain); the library's ``on_start`` then turns it into the bar. The bar fits
    the terminal: below :data:`NARROW_COLUMNS` columns it keeps the bar, the percentage and
    the time left."""

    def __init__(self, description: str, enabled: bool, *, console: Any = None,
                 mode: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        from ckpttool.cli import progress

        chosen = mode if mode is not None else settings.progress()
        shown = progress.resolve(chosen, terminal=sys.stderr.isatty() if console is None
                                 else console.is_terminal)
        self.enabled = enabled and shown != "none"
        self.plain = shown == "plain"
        self._force = chosen == "bar" and console is None  # a bar asked for, not a terminal
        self._lines = progress.PlainLines(description, err, clock=clock)
        self.description = description
        self._console = console
        self._progress: Any = None
        self._task: Any = None

    def _make(self, *columns: Any) -> Any:
        from rich.console import Console
        from rich.progress import Progress

        if self._console is None:
            self._console = Console(stderr=True, force_terminal=self._force or None)
        progress = Progress(*columns, console=self._console, transient=True)
        progress.start()
        return progress

    def begin(self) -> None:
        """Show the planning phase (nothing is known of the size yet)."""
        if not self.enabled:
            return
        if self.plain:
            self._lines.planning()
            return
        from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = self._make(SpinnerColumn(), TextColumn("{task.description}"),
                                    TimeElapsedColumn())
        self._task = self._progress.add_task(f"{self.description}: planning", total=None)

    def start(self, total: int) -> None:
        if not self.enabled:
            return
        if self.plain:
            self._lines.start(total)
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.stop()  # the planning line
        width = self._width()
        if width < NARROW_COLUMNS:
            columns: tuple[Any, ...] = (
                TextColumn("{task.description}"), BarColumn(bar_width=None),
                TaskProgressColumn(), TimeRemainingColumn())
        else:
            columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                       TransferSpeedColumn(), TimeRemainingColumn())
        self._progress = self._make(*columns)
        self._task = self._progress.add_task(self.description, total=total)

    def _width(self) -> int:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True, force_terminal=self._force or None)
        return int(self._console.width)

    def advance(self, n: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)
            task = self._progress.tasks[0]
            if task.total is not None and task.completed > task.total:  # as Lines.advance
                self._progress.update(self._task, total=task.completed)
        elif self.plain:
            self._lines.advance(n)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def rendered(self) -> str:
        """The progress line as drawn now (for tests)."""
        if self._progress is None:
            return ""
        import io

        from rich.console import Console

        out = io.StringIO()
        Console(file=out, width=self._width(), color_system=None).print(
            self._progress.make_tasks_table(self._progress.tasks))
        return out.getvalue()

    @property
    def callbacks(self) -> tuple[Callable[[int], None] | None, Callable[[int], None] | None]:
        """(on_start, progress) to hand to a library call; both None when hidden."""
        if not self.enabled:
            return None, None
        return self.start, self.advance
