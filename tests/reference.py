"""What PyTorch's own DCP loader reads from a checkpoint directory: the tests' reference.

``reference_state_dict(dcp_dir)`` returns a flat dict keyed exactly like the checkpoint's
``.metadata`` (``model.model.embed_tokens.weight`` with accelerate's ``model`` wrapper,
``step``, ``meta.run``, ...).  Tensors are full CPU tensors assembled by
``torch.distributed.checkpoint.load`` itself (no process group: ``no_dist=True``).
Non-tensor entries are unpickled with ``torch.load(weights_only=True)`` only; those that
need arbitrary unpickling (e.g. ``OpaqueThing`` in the ``mixed`` checkpoint) are left out
and listed by :func:`reference_skipped_keys`.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["reference_skipped_keys", "reference_state_dict"]

_UNREAD = object()  # placeholder for non-tensor entries; the planner fills them in


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner on a flat state dict whose non-tensors load weights-only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.loaded: dict[str, Any] = {}
        self.skipped: dict[str, str] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
            self.skipped[fqn] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        else:
            self.loaded[fqn] = obj
            self.state_dict[fqn] = obj


def _load(dcp_dir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    reader = FileSystemReader(Path(dcp_dir))
    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            state[key] = _UNREAD
        else:  # pragma: no cover - future metadata kinds
            raise TypeError(f"{key}: unexpected metadata {type(md).__name__}")
    planner = _WeightsOnlyLoadPlanner()
    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming ... a single process": intended.
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(Path(dcp_dir)), planner=planner,
                 no_dist=True)
    # Tensors are loaded in place; non-tensors are what the planner could unpickle.
    result: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            result[key] = state[key]
        elif key in planner.loaded:
            result[key] = planner.loaded[key]
    missing = set(metadata.state_dict_metadata) - set(result) - set(planner.skipped)
    if missing:
        raise AssertionError(f"DCP load left entries unread: {sorted(missing)}")
    return result, planner.skipped


def reference_state_dict(dcp_dir: Path) -> dict[str, object]:
    """Every entry PyTorch's DCP loader reads from ``dcp_dir``, flat keys as in ``.metadata``.

    Tensors come back as CPU tensors of the saved dtype and full (global) shape.
    Non-tensor entries that load weights-only (ints, floats, strings, lists, dicts of
    those) are included; the others are omitted (see :func:`reference_skipped_keys`).
    """
    return _load(dcp_dir)[0]


def reference_skipped_keys(dcp_dir: Path) -> dict[str, str]:
    """Non-tensor entries of ``dcp_dir`` that do not load weights-only: key -> error."""
    return _load(dcp_dir)[1]
