"""What a run leaves for the command line to say once it has stopped: the leftovers of a
killed run that this one removed (warnings), and the journals of a cut merge whose finished
pieces are kept for the next run (the line after Ctrl-C). The outputs layer notes both as it
works (:mod:`ckpttool.storage.outputs`); the CLI asks here, so it never reaches into storage.
"""

from __future__ import annotations

from pathlib import Path

from ckpttool.storage import locks, outputs


def removed_stale() -> list[str]:
    """What this process removed as a killed run's leftovers since last asked (staged
    files, and object-store locks)."""
    return outputs.take_stale_notes() + locks.take_notes()


def resumable() -> list[Path]:
    """The journals of cut merges noted since last asked that are still there."""
    return outputs.take_resumable()
