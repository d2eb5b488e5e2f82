"""What every command shares: error-to-exit-code mapping, output streams, progress, sizes."""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from ckpttool.errors import CkptError, UnreadableError
from ckpttool.formats.codecs import dtypes

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_UNSUPPORTED = 4
EXIT_INTERRUPTED = 130
EXIT_BUG = 70


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


def printable_doc(doc: Any) -> Any:
    """A report document (``to_json()``) with every string, key and value, made
    :func:`printable`, for the human renderers."""
    if isinstance(doc, str):
        return printable(doc)
    if isinstance(doc, dict):
        return {printable_doc(k): printable_doc(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return type(doc)(printable_doc(v) for v in doc)
    return doc


def err(message: str) -> None:
    print(printable(message), file=sys.stderr, flush=True)


@contextmanager
def exit_codes() -> Iterator[None]:
    """Turn errors into one line on stderr and a documented exit code (no traceback unless
    ``CKPTTOOL_DEBUG=1``); unexpected exceptions are bugs: traceback and exit 70. A file this
    user may not read (exit 3) and a missing torch (exit 4) are never bugs, wherever they
    surface."""
    debug = os.environ.get("CKPTTOOL_DEBUG") == "1"
    try:
        yield
    except CkptError as e:
        if debug:
            traceback.print_exc()
        err(f"ckpttool: error: {e}")
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        err("ckpttool: interrupted; temporary output files were removed")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (typer.Exit, typer.Abort, typer.BadParameter):
        raise
    except PermissionError as e:  # a file or directory this user may not read: not our bug
        if debug:
            traceback.print_exc()
        err(f"ckpttool: error: {UnreadableError.of(e.filename or '?', e)}")
        raise typer.Exit(EXIT_INPUT) from None
    except ImportError as e:
        if (e.name or "").partition(".")[0] != "torch":
            raise _bug() from None
        if debug:
            traceback.print_exc()
        err("ckpttool: error: this needs PyTorch (reading values, casting, writing DCP), which "
            "is not installed here; install it: pip install torch")
        raise typer.Exit(EXIT_UNSUPPORTED) from None
    except Exception:  # noqa: BLE001 - anything else is our bug, reported as one
        raise _bug() from None


def _bug() -> typer.Exit:
    """Report the exception being handled as a bug (traceback, exit 70)."""
    traceback.print_exc()
    err("ckpttool: internal error (a bug in ckpttool); please report it with the traceback "
        "above")
    return typer.Exit(EXIT_BUG)


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
    "--no-progress", help="No progress display on stderr (it shows on a terminal; plain "
    "lines when TERM=dumb).")]
JsonOutput = Annotated[bool, typer.Option(
    "--json", help="Print the report as one JSON document on stdout.")]
Workers = Annotated[int | None, typer.Option(
    min=1, metavar="N", help="Threads reading (and writing) data in parallel (default: the CPUs "
    "this process may use).")]


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
    from ckpttool.formats.safetensors import parse_size  # no torch, no core

    try:
        parse_size(value)
    except InputError as e:
        raise typer.BadParameter(str(e)) from None
    return value


def print_json(doc: dict[str, Any]) -> None:
    """``doc`` indented, except that each object of a top-level list (inspect's tensors,
    verify's problems) is one line: greppable, and written by json's C encoder, which a
    document of 15,000 tensors needs (``indent`` takes Python's: 4x slower)."""
    sys.stdout.write(_layout(doc) + "\n")


def _layout(doc: dict[str, Any]) -> str:
    lines = []
    for key, value in doc.items():
        name = json.dumps(key)
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            items = ",\n".join("    " + json.dumps(v) for v in value)
            lines.append(f"  {name}: [\n{items}\n  ]")
        else:
            lines.append(f"  {name}: " + json.dumps(value, indent=2).replace("\n", "\n  "))
    return "{\n" + ",\n".join(lines) + "\n}" if lines else "{}"


def count(n: int, word: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


class ProgressBar:
    """A rich progress bar on stderr, shown only when stderr is a terminal; on a dumb terminal
    (``TERM=dumb``: no cursor control) a plain line every tenth of the way instead."""

    def __init__(self, description: str, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.plain = os.environ.get("TERM") == "dumb"
        self.description = description
        self._progress: Any = None
        self._task: Any = None
        self._total = 0
        self._done = 0
        self._shown = 0  # tenths reported so far

    def start(self, total: int) -> None:
        if not self.enabled:
            return
        if self.plain:
            self._total = total
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(self.description, total=total)

    def advance(self, n: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)
        elif self.plain and self._total:
            self._done += n
            tenths = min(10, self._done * 10 // self._total)
            if tenths > self._shown:
                self._shown = tenths
                err(f"{self.description}: {tenths * 10}% ({human_bytes(self._done)} of "
                    f"{human_bytes(self._total)})")

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    @property
    def callbacks(self) -> tuple[Callable[[int], None] | None, Callable[[int], None] | None]:
        """(on_start, progress) to hand to a library call; both None when hidden."""
        if not self.enabled:
            return None, None
        return self.start, self.advance


def lora_line(lo: dict[str, Any]) -> str:
    """A LoRA adapter in one line: rank, alpha, variant, targets."""
    rank = lo["rank"] if isinstance(lo["rank"], int) else "/".join(map(str, lo["rank"]))
    alpha = "unknown (no adapter_config.json)" if lo["alpha"] is None else f"{lo['alpha']:g}"
    return (f"LoRA adapter: rank {rank}, alpha {alpha}, {lo['variant']}, {lo['modules']} "
            f"modules ({', '.join(lo['targets'])})"
            + (f", modules_to_save {', '.join(lo['modules_to_save'])}"
               if lo["modules_to_save"] else ""))
