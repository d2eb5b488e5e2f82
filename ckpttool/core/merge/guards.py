"""Checks a caller asks for just before a merge publishes its output (after every byte is
written, before the first file is renamed into place).

``merge --all --overwrite`` uses it to re-check the source's identity (names, sizes,
modification and change times, inodes of its files): a checkpoint re-saved in place while it
was merged must not become an output that mixes both saves. A check that fails raises
:class:`SourceChanged`; nothing is published (the temporary files are removed as on any
error) and the caller reports the checkpoint as still being written.

The checks live in a context variable: set around one ``merge()`` call by whoever wants them,
run by the engine where it publishes, seen by nothing else (another thread's merge has its
own context).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from ckpttool.errors import InputError


class SourceChanged(InputError):
    """The source changed while it was merged: the output was not published."""


_CHECKS: contextvars.ContextVar[tuple[Callable[[], None], ...]] = contextvars.ContextVar(
    "ckpttool_publish_checks", default=())


@contextlib.contextmanager
def before_publish(check: Callable[[], None]) -> Iterator[None]:
    """Run ``check`` before any merge in this block publishes (it raises to stop it)."""
    token = _CHECKS.set((*_CHECKS.get(), check))
    try:
        yield
    finally:
        _CHECKS.reset(token)


def check() -> None:
    """Run the checks set for this context (the engine calls it just before publishing).

    Raises:
        SourceChanged: (or any error a check raises) nothing may be published.
    """
    for fn in _CHECKS.get():
        fn()
