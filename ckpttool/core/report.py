"""What every operation's report shares: the JSON schema version and the progress callback."""

from __future__ import annotations

from collections.abc import Callable

# Version of every ``--json`` document (``"schema"``); bumped when a shape changes.
SCHEMA = 1

# Called with the number of bytes just read or written, as an operation goes.
Progress = Callable[[int], None]
