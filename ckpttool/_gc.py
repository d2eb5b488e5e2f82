"""The cyclic garbage collector paused around a build of millions of objects: a ground
module (standard library only), used by every layer that unpickles or converts large
metadata."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a pickle of millions of objects is built and
    converted: every collection would walk all that survived so far, and none of it is garbage
    (measured on a 1M-chunk ``.metadata``: unpickling 16.0 s -> 2.8 s, converting 6.5 -> 3.8 s).
    The collector's state is restored after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
