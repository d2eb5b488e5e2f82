"""The .metadata allow-list names classes by their torch module paths. If a torch upgrade moves
them, checkpoints it writes would be refused: this test fails first, loudly."""

from __future__ import annotations

import importlib

from ckpttool.formats.codecs import dtypes
from ckpttool.formats.dcp.metadata import _METADATA_CLASSES

MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


def test_metadata_classes_still_live_where_the_allow_list_expects() -> None:
    found = {name for m in MODULES for name in _METADATA_CLASSES
             if hasattr(importlib.import_module(m), name)}
    # _StoragePrefix is only written by old versions; everything else must exist.
    assert set(_METADATA_CLASSES) - found <= {"_StoragePrefix"}


def test_dtype_table_matches_torch() -> None:
    import torch

    for d in dtypes.BY_NAME.values():
        dt = getattr(torch, d.torch_name, None)
        if dt is not None:
            assert dt.itemsize == d.itemsize, d
            assert dt.is_floating_point == (d.kind in ("float", "float8")), d
