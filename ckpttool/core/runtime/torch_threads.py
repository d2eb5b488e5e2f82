"""One torch thread while ckpttool's own workers run torch operations, and how many workers.

Merge (casting) and verify (value checks) spread their work over their own threads, a block
at a time between reads and writes. Torch's intra-op pool on top of them only contends for the
same cores, and its OpenMP threads spin through every gap (measured: 4x the CPU, half the
speed). ``torch.set_num_threads`` is process-wide, so the setting is reference-counted: the
first operation in saves it, the last one out restores it, however many run at once.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ckpttool._gc import gc_paused


def default_workers() -> int:
    """Threads to use when not told: the CPUs this process may run on (a SLURM job or a
    taskset gets its share, not the machine's ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Below this mean chunk size, one thread does all the work.
THREADED_CHUNK = 64 << 10


def workers_for(workers: int, *, nbytes: int, chunks: int) -> int:
    """``workers``, or 1 when the chunks are kilobyte-sized: the work is then Python per
    chunk, and threads only contend for the interpreter (measured on 1M chunks: merge takes
    25 s on one thread, 31 s on two)."""
    return 1 if chunks and nbytes / chunks < THREADED_CHUNK else workers


def _import_torch() -> None:
    """``import torch`` without the cyclic collector walking the hundreds of thousands of
    objects it makes (measured: 1.25 s of CPU -> 1.05 s): made with collection paused, then
    moved unscanned to the oldest generation (``freeze`` then ``unfreeze``), where they live
    as long as the process, as modules do."""
    with gc_paused():
        import torch  # noqa: F401
    gc.freeze()
    gc.unfreeze()


_lock = threading.Lock()
_users = 0
_saved = 0


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Hold torch at one intra-op thread for the duration (imports torch)."""
    global _users, _saved
    if "torch" not in sys.modules:
        _import_torch()
    import torch

    with _lock:
        if _users == 0:
            _saved = torch.get_num_threads()
            torch.set_num_threads(1)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                torch.set_num_threads(_saved)
