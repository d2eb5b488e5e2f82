"""Training directories that hold the model twice, and which copy a merge reads.

Trainers write a second copy of the weights beside their sharded state: the HF Trainer with
``FULL_STATE_DICT`` writes ``model.safetensors`` at the top of ``checkpoint-N/``, where a run
that also saved ``SHARDED_STATE_DICT`` left ``pytorch_model_fsdp_0/``; verl writes an
``hf_model/`` (or a ``huggingface/`` holding weights) beside its rank files. ckpttool reads one
of them (full weights at the top of a directory; else the sharded training state the path
names) and says which, and why, so that nobody publishes the wrong step or dtype unawares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpttool.core.checkpoint.discover import Checkpoint, kind_of
from ckpttool.core.runtime.report import Section, section
from ckpttool.errors import CkptError
from ckpttool.formats import registry
from ckpttool.formats.base import CheckpointInfo


@section(frozen=True)
class Copy(Section):
    path: str  # the copy's path
    format: str  # its format's NAME
    num_tensors: int
    sharded: bool

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "tensors": self.num_tensors,
                "sharded": self.sharded}

    def describe(self) -> str:
        return f"{self.path} ({self.format}, {'sharded' if self.sharded else 'full weights'})"


@section(frozen=True)
class Copies(Section):
    """The copy read, the others, and why that one."""

    used: Copy
    others: tuple[Copy, ...]
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"used": self.used.to_json(), "others": [c.to_json() for c in self.others],
                "why": self.why}

    def message(self, command: str) -> str:
        out = " OUT" if command in ("merge", "reshard") else ""
        others = "; ".join(c.describe() for c in self.others)
        return (f"{len(self.others) + 1} copies of the model here: {command} reads "
                f"{self.used.describe()}, {self.why}; not read: {others}. To "
                f"{command} another: ckpttool {command} {self.others[0].path}{out}")


def _copy(info: CheckpointInfo) -> Copy:
    return Copy(str(info.root), info.format, len(info.tensors), info.sharded)


def model_copies(ckpt: Checkpoint) -> Copies | None:
    """The other model checkpoints beside or below the one ``ckpt`` chose; None when there
    is only one. Reads metadata only (of subdirectories a format recognises)."""
    info = ckpt.info
    if info is None or ckpt.kind != "model":
        return None
    others = [i for _, i in ckpt.others if kind_of(i) == "model"]
    seen = {Path(i.root).resolve() for i in others} | {Path(info.root).resolve()}
    root = Path(info.root)
    stores = ckpt.stores
    if stores.is_dir(root):
        for sub in sorted(root / n for n, size in stores.listdir(root).items()
                          if size is None and stores.is_dir(root / n)):
            if sub.resolve() in seen or registry.detect(sub, stores) is None:
                continue
            try:
                found = registry.detect(sub, stores)
                assert found is not None
                sub_info = found.read_info(sub, stores=stores)
            except CkptError:
                continue  # a damaged copy is not the one read: verify reports it
            if kind_of(sub_info) == "model" and sub_info.tensors:
                others.append(sub_info)
    if not others:
        return None
    if not info.sharded:
        why = ("the full weights at the top of the directory, which from_pretrained would "
               "load from it")
    elif any(not o.sharded for o in others):
        why = ("the sharded training state the path names; the full weights beside it are "
               "an export the trainer wrote from it, maybe at another step or in another dtype")
    else:
        why = "the checkpoint the path names"
    return Copies(_copy(info), tuple(_copy(o) for o in others), why)
