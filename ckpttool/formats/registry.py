"""Every format ckpttool reads, in the order they are tried on a path.

Order matters only where two could claim one path: Megatron's iteration directories are DCP
directories with more beside them, so they come first; the layouts that are directories of
safetensors or ``torch.save`` files with their own markers (DCP sharding offsets in the headers,
per-rank files of DTensors or ShardedTensors) come before plain safetensors and ``torch.save``.
"""

from __future__ import annotations

from pathlib import Path

from ckpttool.errors import InputError
from ckpttool.formats import (
    bin_index,
    deepspeed,
    hf_dcp,
    megatron,
    rank_files,
    safetensors,
    torchfile,
)
from ckpttool.formats.base import Format
from ckpttool.formats.dcp import reader as dcp

FORMATS: tuple[Format, ...] = (
    megatron, dcp, hf_dcp, rank_files, bin_index, safetensors, deepspeed, torchfile)


def detect(path: Path) -> Format | None:
    """The format that claims ``path`` (a file or directory), or None."""
    for fmt in FORMATS:
        if fmt.detect(path):
            return fmt
    return None


def select_iteration(path: Path, iteration: int) -> Path:
    """The directory of iteration ``iteration`` of the training run at ``path`` (Megatron-Core's
    ``iter_NNNNNNN/``: the only format whose directory holds a run of iterations).

    Raises:
        InputError: ``path`` is not such a run, or has no such iteration (those it has are
            named).
    """
    if not megatron.detect(path):
        raise InputError(
            f"{path}: --iteration {iteration} picks one iteration of a Megatron-Core run "
            f"directory ({megatron.TRACKER} beside iter_*/); this is not one: pass the "
            "checkpoint without --iteration")
    return megatron.resolve(path, iteration)


def by_name(name: str) -> Format:
    """The format whose ``NAME`` is ``name``."""
    for fmt in FORMATS:
        if name == fmt.NAME:
            return fmt
    raise KeyError(name)


def is_format(name: str) -> bool:
    """True if ``name`` is a format's NAME (not "pickle", "json", "directory"...)."""
    return any(name == fmt.NAME for fmt in FORMATS)
