"""The one module that touches ``torch.distributed``: a gloo group of ckpttool's own over the
processes a launcher started (torchrun, or anything that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` the same way), with its own timeout.

Only small JSON messages travel (a run id, a decision, each process's status); they are sent as
bytes in tensors, never pickled. Torch is imported only when a group is joined.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from datetime import timedelta
from types import FrameType
from typing import Any

from ckpttool import settings
from ckpttool.errors import OutputError

__all__ = ["DEFAULT_TIMEOUT", "DISABLE_ENV", "TIMEOUT_ENV", "Group", "launched"]

# How long a collective waits for the slowest process (seconds): the copy between two
# collectives is balanced, so this bounds a hung peer, not the merge.
DEFAULT_TIMEOUT = int(settings.DIST_TIMEOUT_DEFAULT)
TIMEOUT_ENV = "CKPTTOOL_DIST_TIMEOUT"
# Set to 0 to ignore the launcher's variables (a ckpttool run started from inside one rank of a
# training job inherits them, and must not wait for the others).
DISABLE_ENV = "CKPTTOOL_DISTRIBUTED"


def launched() -> bool:
    """True when a launcher started this process as one of several (``WORLD_SIZE`` > 1)."""
    if not settings.distributed():
        return False
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def timeout_seconds() -> float:
    return settings.dist_timeout()


class Group:
    """This process's place in a gloo group: ``rank`` of ``size``."""

    def __init__(self, group: Any, rank: int, size: int, own: bool) -> None:
        self._group = group
        self.rank = rank
        self.size = size
        self._own = own

    @classmethod
    def join(cls, timeout: float | None = None) -> Group:
        """Join the launcher's processes in a new gloo group (a collective: every process
        calls it). Where a process group exists already (a training job calling the library),
        a separate gloo group is made on the same processes, with this timeout.

        Raises:
            OutputError: the group cannot be formed (unreachable ``MASTER_ADDR``, timeout).
        """
        import torch.distributed as dist

        limit = timedelta(seconds=timeout if timeout is not None else timeout_seconds())
        try:
            if dist.is_initialized():
                group = dist.new_group(backend="gloo", timeout=limit)
                own = False
            else:
                dist.init_process_group("gloo", timeout=limit)
                group = dist.group.WORLD
                own = True
        except (RuntimeError, ValueError) as e:
            raise OutputError(
                f"cannot join the other processes (MASTER_ADDR={os.environ.get('MASTER_ADDR')} "
                f"MASTER_PORT={os.environ.get('MASTER_PORT')}): {str(e).splitlines()[0]}; "
                f"check the launcher, or set {DISABLE_ENV}=0 to run alone") from e
        _terminate_as_interrupt()
        return cls(group, dist.get_rank(group), dist.get_world_size(group), own)

    def gather(self, message: Any) -> list[Any]:
        """Every process's ``message`` (JSON-able), in rank order; a collective.

        Raises:
            OutputError: a process is gone (its connection closed) or the timeout passed.
        """
        import torch
        import torch.distributed as dist

        data = json.dumps(message).encode()
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
            dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64),
                            group=self._group)
            longest = max(int(s.item()) for s in sizes)
            mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
            if data:
                mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            everyone = [torch.empty_like(mine) for _ in range(self.size)]
            dist.all_gather(everyone, mine, group=self._group)
        except RuntimeError as e:  # gloo: a peer's connection closed, or the timeout
            raise OutputError(f"rank {self.rank}: lost contact with the other processes "
                              f"({_gist(e)}); one of them failed or was killed: see its own "
                              "error") from e
        return [json.loads(bytes(t[: int(n.item())].tolist())) for t, n in zip(
            everyone, sizes, strict=True)]

    def broadcast(self, message: Any) -> Any:
        """Rank 0's ``message`` (JSON-able), on every process; a collective."""
        return self.gather(message if self.rank == 0 else None)[0]

    def close(self) -> None:
        import torch.distributed as dist

        if self._own and dist.is_initialized():
            # Tear down together: a process that destroys the group while a peer is still
            # using it can make gloo abort the peer (seen as SIGABRT after a failed share).
            with contextlib.suppress(RuntimeError):
                dist.barrier(group=self._group)
            dist.destroy_process_group()


def _gist(e: BaseException) -> str:
    """gloo's message without its source location and advice: "Read error [host]:port:
    Connection reset by peer"."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")


def _terminate_as_interrupt() -> None:
    """torchrun stops the other processes with SIGTERM when one fails: make that an interrupt,
    so that each leaves as Ctrl-C leaves (temporary files removed), not killed outright."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):  # not the main thread: leave the default
        signal.signal(signal.SIGTERM, handler)
