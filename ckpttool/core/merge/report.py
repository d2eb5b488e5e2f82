"""merge's report: :class:`MergeReport` and the sections only it has (the dtype chosen, the
config used, the renames, the other checkpoints of a directory, a dry run's tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ckpttool.core import ties
from ckpttool.core.checkpoint import architecture, non_tensor
from ckpttool.core.checkpoint.copies import Copies
from ckpttool.core.checkpoint.discover import Part
from ckpttool.core.checkpoint.parts import Content
from ckpttool.core.contract import Contract
from ckpttool.core.merge import resume
from ckpttool.core.merge.plan import OutputFile
from ckpttool.core.runtime.report import Section, document, section
from ckpttool.core.transforms import hub_layout, megatron_config
from ckpttool.core.transforms.lora.report import LoraMerge

if TYPE_CHECKING:
    from ckpttool.core.merge.sharing import Sharing
    from ckpttool.core.transforms.namemaps import Mapped


@section
class DTypeChoice(Section):
    """The dtype asked for (``--dtype``), the one written (None: each tensor's own), and why."""

    requested: str
    target: str | None
    source: str


@section
class ConfigUsed(Section):
    """The config.json used; ``found_in`` None when beside the checkpoint or given."""

    path: str
    found_in: str | None


@section
class Rename(Section):
    """A tensor's stored name and the name written (wrapper segments removed)."""

    KEYS: ClassVar[dict[str, str]] = {"stored": "from", "written": "to"}

    stored: str
    written: str


@section
class OtherCheckpoint(Section):
    """A checkpoint of a training directory that was not the one merged."""

    path: str
    kind: str


@section
class PlannedTensor(Section):
    """A dry run's tensor as it would be written: byte ``offsets`` [begin, end) in ``file``."""

    name: str
    file: str
    dtype: str
    source_dtype: str
    shape: list[int]
    bytes: int
    offsets: list[int]


@dataclass
class MergeReport:
    """What a merge did, for people (CLI) and programs (``to_json``)."""

    src: str
    checkpoint: str
    out: str
    kind: str = "model"  # or "optimizer"
    format: str = ""  # the source format's NAME
    storage: dict[str, Any] = field(default_factory=dict)  # CheckpointInfo.storage
    files: list[OutputFile] = field(default_factory=list)
    num_tensors: int = 0
    num_parameters: int = 0
    total_bytes: int = 0
    dtype: DTypeChoice = field(default_factory=lambda: DTypeChoice("auto", None, ""))
    bytes_before: dict[str, int] = field(default_factory=dict)
    bytes_after: dict[str, int] = field(default_factory=dict)
    renames: list[Rename] = field(default_factory=list)
    wrappers_removed: list[str] = field(default_factory=list)
    tie: ties.Tie | None = None
    name_map: Mapped | None = None  # --names: the map and what it did to each tensor
    # transformers 5's runtime names and fused experts turned into save_pretrained's layout
    # (core.transforms.hub_layout): the families, counts and examples; None: nothing to do
    layout: hub_layout.Converted | None = None
    # A directory holding the model twice (core.checkpoint.copies): the copy read, the
    # others and why; None: one copy
    copies: Copies | None = None
    # The config.json used; None: none found, the output is weights only
    config: ConfigUsed | None = None
    # A Megatron-Core run merged without a config.json: the one derived from its args
    # (core.transforms.megatron_config), written beside the weights; None: not derived
    derived_config: megatron_config.DerivedConfig | None = None
    # Names no transformers model of config.json's architecture has (a training framework's
    # own, core.checkpoint.architecture): whose, how many, the --names maps; None: they fit
    foreign_names: architecture.NameCheck | None = None
    lora: LoraMerge | None = None  # the adapter found, and what was done with it
    non_tensor: list[non_tensor.Entry] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    config_changes: list[str] = field(default_factory=list)
    parts: list[Part] = field(default_factory=list)  # a training directory's entries
    skipped: list[OtherCheckpoint] = field(default_factory=list)  # its other checkpoints
    part: str = "model"  # what was written: "model" or "optimizer" (core.parts)
    contents: list[Content] = field(default_factory=list)  # every part of the source
    left_out: list[Content] = field(default_factory=list)  # the parts not written
    warnings: list[str] = field(default_factory=list)
    dry_run: bool = False  # nothing was written: files and tensors are what would be
    # dry_run only: every tensor as it would be written
    tensors: list[PlannedTensor] = field(default_factory=list)
    # The output held against the model config.json names (core.contract); None: no model
    # written (optimizer state, a LoRA adapter)
    contract: Contract | None = None
    # A merge several processes shared (core.multihost): how, and the bytes each wrote.
    distributed: Sharing | None = None
    # A merge written in pieces (core.merge.resume); None: written whole.
    resumed: resume.Resumed | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return document("merge", self)
