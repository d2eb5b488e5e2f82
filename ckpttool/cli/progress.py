"""Progress where no bar can be drawn: plain lines on stderr, for logs (a Slurm ``.out`` file,
a CI log, ``2>&1 | tee``) and dumb terminals.

``--progress`` (or ``CKPTTOOL_PROGRESS``) chooses: ``auto`` draws rich's bar on a terminal and
writes these lines anywhere else; ``bar``, ``plain`` and ``none`` say which, wherever stderr
goes. A line is written at each tenth of the way or every :data:`EVERY` seconds, whichever
comes first (never more than one a second but the last), with the bytes, the rate and the time
left; while the command plans (recognising the checkpoint, reading its metadata, checks) one
line says "planning" instead of a rate that counts the planning time."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ckpttool.units import human_bytes

MODES = ("auto", "bar", "plain", "none")
EVERY = 30.0  # seconds between lines at most, however slow the tenths
LEAST = 1.0  # seconds between lines at least (a quick command says less)


def resolve(mode: str, *, terminal: bool) -> str:
    """What ``mode`` means here: ``bar``, ``plain`` or ``none``. ``auto`` draws the bar on a
    terminal that can take it, and plain lines elsewhere (a pipe, a file, ``TERM=dumb``)."""
    if mode != "auto":
        return mode
    return "bar" if terminal and os.environ.get("TERM") != "dumb" else "plain"


def clock_text(seconds: float) -> str:
    """``0:01:05``: hours, minutes, seconds."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class PlainLines:
    """The plain lines of one command's progress, written through ``say``."""

    def __init__(self, description: str, say: Callable[[str], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.description = description
        self._say = say
        self._clock = clock
        self._total = 0
        self._done = 0
        self._tenths = 0
        self._started = 0.0
        self._last = 0.0

    def planning(self) -> None:
        self._say(f"{self.description}: planning (recognising the checkpoint, reading its "
                  "metadata, checks)")

    def start(self, total: int) -> None:
        self._total = total
        self._started = self._last = self._clock()

    def advance(self, n: int) -> None:
        if not self._total:
            return
        self._done += n
        # The total is what the command expected to read; records' own bytes (headers, a
        # checksummed storage larger than its view) may add to it: never "490 B of 172 B".
        self._total = max(self._total, self._done)
        now = self._clock()
        tenths = min(10, self._done * 10 // self._total)
        due = (tenths > self._tenths or now - self._last >= EVERY) and now - self._last >= LEAST
        if due or (tenths == 10 and self._tenths < 10):
            self._tenths = tenths
            self._last = now
            self._say(self.line(now))

    def line(self, now: float) -> str:
        """``merging: 40% (1.20 GB of 3.00 GB, 250.00 MB/s, 0:00:07 left)``."""
        spent = now - self._started
        pct = min(100, self._done * 100 // self._total)
        sizes = f"{human_bytes(self._done)} of {human_bytes(self._total)}"
        if spent <= 0 or not self._done:
            return f"{self.description}: {pct}% ({sizes})"
        rate = self._done / spent
        left = max(0, self._total - self._done) / rate
        when = (f"done in {clock_text(spent)}" if self._done >= self._total
                else f"{clock_text(left)} left")
        return f"{self.description}: {pct}% ({sizes}, {human_bytes(int(rate))}/s, {when})"
