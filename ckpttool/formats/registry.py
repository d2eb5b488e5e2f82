"""Every format ckpttool reads, in the order they are tried on a path.

Order matters only where two could claim one path: Megatron's iteration directories are DCP
directories with more beside them, so they come first; the layouts that are directories of
safetensors or ``torch.save`` files with their own markers (DCP sharding offsets in the headers,
per-rank files of DTensors or ShardedTensors) come before plain safetensors and ``torch.save``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ckpttool.errors import UsageError
from ckpttool.formats.base import Format
from ckpttool.storage.store import LOCAL, Stores

# Each format module is imported when it is first tried on a path (or asked for by name), not
# when the registry is: the merge of a Megatron run needs the megatron and DCP modules only,
# and a file is never tried against the formats of directories.

if TYPE_CHECKING:  # mypy checks each module against the Format protocol; nothing at run time
    from ckpttool.formats import (
        bin_index,
        deepspeed,
        hf_dcp,
        megatron,
        rank_files,
        safetensors,
        torchfile,
    )
    from ckpttool.formats.dcp import reader

    _CHECKED: tuple[Format, ...] = (
        megatron, reader, hf_dcp, rank_files, bin_index, safetensors, deepspeed, torchfile)


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str  # the module's NAME (tests/formats/test_contract.py checks they agree)
    module: str  # imported when the format is first tried (one of _CHECKED's modules)
    files: bool  # it may claim a file; every format may claim a directory but torchfile

    def load(self) -> Format:
        return cast("Format", importlib.import_module(self.module))


_ENTRIES: tuple[_Entry, ...] = (
    _Entry("megatron", "ckpttool.formats.megatron", files=False),
    _Entry("dcp", "ckpttool.formats.dcp.reader", files=False),
    _Entry("dcp-safetensors", "ckpttool.formats.hf_dcp", files=False),
    _Entry("rank-files", "ckpttool.formats.rank_files", files=False),
    _Entry("torch-save-sharded", "ckpttool.formats.bin_index", files=False),
    _Entry("safetensors", "ckpttool.formats.safetensors", files=True),
    _Entry("deepspeed", "ckpttool.formats.deepspeed", files=False),
    _Entry("torch-save", "ckpttool.formats.torchfile", files=True),
)

NAMES: tuple[str, ...] = tuple(e.name for e in _ENTRIES)


def formats() -> Iterator[Format]:
    """Every format, in detection order (each module imported as it is reached)."""
    return (e.load() for e in _ENTRIES)


def detect(path: Path, stores: Stores = LOCAL) -> Format | None:
    """The format that claims ``path`` (a file or directory), or None. Formats are tried in
    order, each imported when its turn comes; a path that is not a directory is tried only
    against the formats that claim files (the others' ``detect`` begins by refusing it).
    ``stores``: where the bytes below ``path`` are (what lists and reads it)."""
    is_dir = stores.is_dir(path)
    if not is_dir and stores.file_size(path) is None:
        return None
    for entry in _ENTRIES:
        if is_dir or entry.files:
            fmt = entry.load()
            if fmt.detect(path, stores):
                return fmt
    return None


def select_iteration(path: Path, iteration: int, stores: Stores = LOCAL) -> Path:
    """The directory of iteration ``iteration`` of the training run at ``path`` (Megatron-Core's
    ``iter_NNNNNNN/``: the only format whose directory holds a run of iterations).

    Raises:
        UsageError: ``path`` is not such a run (exit 2: the option does not apply).
        InputError: no such iteration (those it has are named).
    """
    from ckpttool.formats import megatron

    if not megatron.detect(path, stores):
        raise UsageError(
            f"{path}: --iteration {iteration} picks one iteration of a Megatron-Core run "
            f"directory ({megatron.TRACKER} beside iter_*/); this is not one: pass the "
            "checkpoint without --iteration")
    return megatron.resolve(path, iteration, stores)


def by_name(name: str) -> Format:
    """The format whose ``NAME`` is ``name`` (only its module is imported)."""
    for entry in _ENTRIES:
        if name == entry.name:
            return entry.load()
    raise KeyError(name)


def is_format(name: str) -> bool:
    """True if ``name`` is a format's NAME (not "pickle", "json", "directory"...)."""
    return name in NAMES
