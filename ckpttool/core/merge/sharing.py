"""The report's ``distributed`` section: how processes shared a merge. A leaf, so that the
report, the options (whose :class:`~ckpttool.core.merge.options.Shared` returns it) and the
ways of sharing (:mod:`ckpttool.core.merge.multihost`) each import it without a circle."""

from __future__ import annotations

from typing import ClassVar

from ckpttool.core.merge.plan import OutputFile
from ckpttool.core.runtime.report import Section, section

__all__ = ["Sharing"]


@section
class Sharing(Section):
    """The report's ``distributed``: how processes shared a merge (``torchrun``, ``slice``,
    ``slices`` for a finish), the bytes each wrote and how even that was; this process's
    rank or slice, the plan's key, the tensors a dry run's process would write, the files a
    slice wrote, the weights a finish put in place and the temporary files it removed."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset(
        {"tensors", "rank", "slice", "plan", "files", "committed", "placed_before",
         "removed_temporary", "local_bytes"})

    mode: str
    processes: int
    bytes: list[int]
    balance: float
    tensors: list[str] | None = None
    rank: int | None = None
    slice: int | None = None
    plan: str | None = None
    files: list[OutputFile] | None = None  # a slice's: what it wrote (the report's files)
    committed: list[str] | None = None  # a finish's: the weights it put in place
    placed_before: list[str] | None = None  # a finish's: those an earlier finish had placed
    removed_temporary: list[str] | None = None
    # Into object storage: the most bytes this process's part buffer held on local disk.
    local_bytes: int | None = None
