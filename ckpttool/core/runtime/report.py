"""What every operation's report shares: the JSON schema version and the progress callback."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# Version of every ``--json`` document (``"schema"``); bumped when a shape changes.
SCHEMA = 1

# Called with the number of bytes just read or written, as an operation goes.
Progress = Callable[[int], None]


def locked(progress: Progress | None) -> Progress:
    """``progress`` for worker threads to share: one call at a time, none for 0 bytes (a
    no-op when there is no ``progress``)."""
    lock = threading.Lock()

    def report(n: int) -> None:
        if progress is not None and n:
            with lock:
                progress(n)

    return report


def storage_note(storage: dict[str, Any]) -> str | None:
    """How a checkpoint was stored, in words, where it departs from the format's default
    (``CheckpointInfo.storage``): ``"safetensors records, zstd-compressed, rank-local
    metadata"``; None for the default."""
    words = []
    if storage.get("framework"):  # who wrote it and how it was laid out (Megatron's run)
        words.append(str(storage["framework"]))
    serialization = storage.get("serialization")
    if serialization not in (None, "torch_save"):
        words.append(f"{serialization} records")
    if storage.get("compression"):
        words.append(f"{storage['compression']}-compressed")
    if storage.get("metadata") not in (None, "global"):
        words.append(f"{storage['metadata']} metadata")
    return ", ".join(words) or None
