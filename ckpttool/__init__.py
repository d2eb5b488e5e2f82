"""ckpttool: merge, inspect and verify sharded PyTorch checkpoints.

The library API. Importing it does not import torch.
"""

from __future__ import annotations

from ckpttool.core.merge import MergeReport, merge
from ckpttool.errors import CkptError, InputError, IntegrityError, OutputError, UnsupportedError

__version__ = "0.1.0"

__all__ = [
    "CkptError",
    "InputError",
    "IntegrityError",
    "MergeReport",
    "OutputError",
    "UnsupportedError",
    "merge",
]
