"""merge's options in four typed groups: what to read, how to cast and name, where and how to
write, how to share the work. The CLI builds them once; ``merge()``, the sweep (``merge
--all``) and the processes of a shared merge pass them on whole, so a new option is a field
here, a keyword of ``merge()`` and a flag, not a parameter of every function on the way.
``ckpttool.merge(...)``'s keywords build them (:meth:`MergeOptions.of` does from a dict)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ckpttool import units

if TYPE_CHECKING:
    from collections.abc import Callable

    from ckpttool.core.merge.plan import MergePlan
    from ckpttool.core.merge.sharing import Sharing
    from ckpttool.core.runtime.report import Progress
    from ckpttool.formats.base import Reader


@dataclass(frozen=True)
class ReadOptions:
    """What to read: the config.json, the part of a training checkpoint, the iteration of a
    Megatron run, a LoRA adapter (how to take it, where it is, its config and alpha), and how
    the data files are read (links out of the checkpoint, CRC-32 checks)."""

    config: str | os.PathLike[str] | None = None
    part: str | None = None
    iteration: int | None = None
    lora: str | None = None
    adapter: str | os.PathLike[str] | None = None
    adapter_config: str | os.PathLike[str] | None = None
    lora_alpha: float | None = None
    follow_links: bool = False
    check_crc: bool = True


@dataclass(frozen=True)
class CastOptions:
    """How to cast and name: the dtype, the name map and layout, the tied copy, and the
    quantization (decoded or encoded)."""

    dtype: str = "auto"
    names: str | None = None
    layout: str = "hub"
    keep_tied: bool = False
    dequantize: bool = False
    quantize: str | None = None
    quantize_ignore: tuple[str, ...] = ()


@dataclass(frozen=True)
class WriteOptions:
    """Where and how to write: the largest shard, whether weights already there are
    replaced, whether anything is written at all, and whether the output is held against
    the model config.json names."""

    max_shard_size: str | int = "5GB"
    overwrite: bool = False
    dry_run: bool = False
    weights_only: bool = False


@dataclass(frozen=True)
class ShareOptions:
    """How to share the work: copy threads, and this process's part in a merge several
    processes share (:mod:`ckpttool.core.merge.multihost`; None: this process alone)."""

    workers: int | None = None
    shared: Shared | None = None


class Shared(Protocol):
    """How this process takes part in a merge that several processes share (the ways are
    in :mod:`ckpttool.core.merge.multihost` and, into object storage,
    :mod:`ckpttool.core.merge.multihost_objects`)."""

    @property
    def first(self) -> bool:
        """This process decides, reports and commits (rank 0)."""

    @property
    def commits_slices(self) -> bool:
        """This process commits what earlier processes wrote (``--finish``): it checks OUT's
        files itself, knowing which of them a finish that did not complete put in place."""

    def once(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` (JSON-able, may read tensor data) run once, its result on every
        process; an error raised there is raised on every process."""

    def write(self, plan: MergePlan, reader: Reader, out: Path, extra: list[tuple[str, bytes]],
              stem: str, writing: WriteOptions, share: ShareOptions, *,
              progress: Progress | None, on_start: Callable[[int], None] | None) -> Sharing:
        """Write this process's part of ``plan`` (and commit, where it is the one to), with
        the merge's write and share options whole; ``stem`` names the weight files
        (``model``), ``extra`` the side files written beside them. Returns what the report
        says about the sharing."""

    def preview(self, plan: MergePlan) -> Sharing | None:
        """For a dry run: what :meth:`write` would report, with ``tensors``, the names of
        the tensors this process would write (some of them in part); None: all of them."""


# merge()'s keywords that change what it writes, recorded in a sweep's receipts (in this
# order), and those recorded only where given (absent from receipts written before them).
RECORDED = ("dtype", "max_shard_size", "config", "keep_tied", "lora", "adapter",
            "adapter_config", "part", "names", "layout")
RECORDED_IF_GIVEN = ("dequantize", "quantize", "quantize_ignore")


@dataclass(frozen=True)
class MergeOptions:
    """Every option of a merge, by group; the defaults are ``ckpttool.merge``'s."""

    read: ReadOptions = field(default_factory=ReadOptions)
    cast: CastOptions = field(default_factory=CastOptions)
    write: WriteOptions = field(default_factory=WriteOptions)
    share: ShareOptions = field(default_factory=ShareOptions)

    @classmethod
    def of(cls, **keywords: Any) -> MergeOptions:
        """The options ``ckpttool.merge``'s keywords name (``dtype="bf16"``,
        ``overwrite=True``...), each in its group; the rest at their defaults.

        Raises:
            TypeError: a keyword merge does not take, as Python says it of a call.
        """
        groups: dict[str, Any] = {}
        left = dict(keywords)
        for group in dataclasses.fields(cls):
            kind = _GROUPS[group.name]
            names = {f.name for f in dataclasses.fields(kind)}
            groups[group.name] = kind(**{k: left.pop(k) for k in list(left) if k in names})
        if left:
            raise TypeError(f"merge() got an unexpected keyword argument '{sorted(left)[0]}'")
        return cls(**groups)

    def recorded(self) -> dict[str, Any]:
        """The options a sweep's receipt records: those that change the output, as JSON
        values (sizes in bytes, paths given as path objects absolute), so that the library
        and the command line record the same."""
        given = self._by_name()
        defaults = MergeOptions()._by_name()
        doc: dict[str, Any] = {}
        for key in RECORDED:
            value = given[key]
            if key == "max_shard_size" and value is not None:
                value = units.parse_size(str(value))
            elif isinstance(value, os.PathLike):
                value = str(Path(value).resolve())
            doc[key] = value
        for key in RECORDED_IF_GIVEN:
            value = given[key]
            if value != defaults[key] and value:
                doc[key] = list(value) if isinstance(value, tuple) else value
        return doc

    def _by_name(self) -> dict[str, Any]:
        return {f.name: getattr(group, f.name)
                for group in (self.read, self.cast, self.write, self.share)
                for f in dataclasses.fields(group)}


_GROUPS: dict[str, type[Any]] = {"read": ReadOptions, "cast": CastOptions,
                                  "write": WriteOptions, "share": ShareOptions}
