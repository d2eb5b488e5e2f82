"""The merge plan, pure: every output tensor's name, dtype, file and byte range, decided from
the metadata alone before any data moves (:func:`plan_merge`). A leaf of the merge room:
the engine, the operation and the several-process machinery (partition, multihost) all
import it, and it imports none of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ckpttool.core.dtype_policy import DTypePolicy
from ckpttool.core.runtime.report import Section, section
from ckpttool.core.transforms.derive import Derived
from ckpttool.formats import safetensors
from ckpttool.formats.base import Tensor
from ckpttool.formats.codecs.dtypes import DType

# What an output tensor is made from: a stored tensor (copied, or cast on the way), or a tensor
# computed from whole stored ones (a LoRA update folded in, a fused projection split).
Source = Tensor | Derived


@dataclass(frozen=True)
class OutTensor:
    name: str
    source: Source
    dtype: DType  # as written
    slot: safetensors.Slot

    @property
    def cast(self) -> bool:
        return self.dtype != self.source.dtype


@dataclass(frozen=True)
class OutFile:
    name: str
    layout: safetensors.Layout
    tensors: tuple[OutTensor, ...]

    @property
    def size(self) -> int:
        return self.layout.file_size


@dataclass(frozen=True)
class MergePlan:
    files: tuple[OutFile, ...]
    index: bytes | None  # model.safetensors.index.json, when sharded
    dropped: tuple[str, ...]  # canonical names left out (a deduplicated tied weight)
    index_name: str = safetensors.INDEX_NAME

    @property
    def total_bytes(self) -> int:
        return sum(t.slot.nbytes for f in self.files for t in f.tensors)

    @property
    def file_bytes(self) -> int:
        return sum(f.size for f in self.files) + len(self.index or b"")


def plan_merge(
    tensors: list[tuple[str, Source]],
    *,
    policy: DTypePolicy,
    max_shard_size: int,
    drop: frozenset[str] = frozenset(),
    stem: str = "model",
) -> MergePlan:
    """Assign every tensor to an output file and a byte range. Pure: no I/O.

    Args:
        tensors: (canonical name, source entry) in model order.
        policy: which dtype each tensor is written in.
        max_shard_size: shard limit in tensor bytes, as transformers counts it.
        drop: canonical names not to write (a deduplicated tied weight).
        stem: output file stem: "model", or "optimizer" for optimizer state.
    """
    kept = [(name, entry) for name, entry in tensors if name not in drop]
    by_name = {name: entry for name, entry in kept}
    file_plans, index = safetensors.plan_files(
        [(name, policy.output_dtype(entry.dtype, name), entry.shape) for name, entry in kept],
        max_shard_size,
        stem,
    )
    files = tuple(
        OutFile(f.name, f.layout, tuple(OutTensor(s.name, by_name[s.name], s.dtype, s)
                                        for s in f.layout.slots))
        for f in file_plans
    )
    return MergePlan(files, index, tuple(sorted(drop)), safetensors.index_name(stem))


@section
class OutputFile(Section):
    """A file a merge wrote, for its report: its name, bytes and tensors (0: an index,
    optimizer.json). A slice's temporary file names the ``final`` file it becomes and its
    ``header`` bytes; a weight file a ``--finish`` put in place was ``written_by`` the
    slices (``placed_before``: by an earlier, cut finish)."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset(
        {"final", "header", "written_by", "placed_before"})

    name: str
    bytes: int
    tensors: int
    final: str | None = None
    header: int | None = None
    written_by: str | None = None
    placed_before: bool | None = None
