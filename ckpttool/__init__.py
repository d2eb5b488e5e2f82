"""ckpttool: merge, inspect, verify and reshard sharded PyTorch checkpoints.

The library API. Importing it imports neither torch nor the operations themselves: each is
loaded on first use, so the command line (``--help``, shell completion) starts fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ckpttool.errors import (
    CkptError,
    InputError,
    IntegrityError,
    OutputError,
    UnsupportedError,
    UsageError,
)
from ckpttool.version import __version__ as __version__  # the public name

if TYPE_CHECKING:
    from ckpttool.core.diff.apply import ApplyReport, apply
    from ckpttool.core.diff.operation import DiffReport, diff
    from ckpttool.core.inspect import InspectReport, inspect
    from ckpttool.core.merge.operation import merge
    from ckpttool.core.merge.report import MergeReport
    from ckpttool.core.reshard import ReshardReport, reshard
    from ckpttool.core.verify.operation import Problem, VerifyReport, verify


_LAZY = {
    "apply": "ckpttool.core.diff.apply",
    "ApplyReport": "ckpttool.core.diff.apply",
    "diff": "ckpttool.core.diff.operation",
    "DiffReport": "ckpttool.core.diff.operation",
    "inspect": "ckpttool.core.inspect",
    "InspectReport": "ckpttool.core.inspect",
    "merge": "ckpttool.core.merge.operation",
    "MergeReport": "ckpttool.core.merge.report",
    "reshard": "ckpttool.core.reshard",
    "ReshardReport": "ckpttool.core.reshard",
    "verify": "ckpttool.core.verify.operation",
    "VerifyReport": "ckpttool.core.verify.operation",
    "Problem": "ckpttool.core.verify.operation",
}


def __dir__() -> list[str]:
    """The public names (``dir(ckpttool)``), loaded or not: the API, not this module's
    imports."""
    return sorted({*__all__, "__version__"})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpttool' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ApplyReport",
    "CkptError",
    "DiffReport",
    "InputError",
    "InspectReport",
    "IntegrityError",
    "MergeReport",
    "OutputError",
    "Problem",
    "ReshardReport",
    "UnsupportedError",
    "UsageError",
    "VerifyReport",
    "apply",
    "diff",
    "inspect",
    "merge",
    "reshard",
    "verify",
]
