"""What inspect, merge and verify report of a LoRA adapter."""

from __future__ import annotations

from dataclasses import field
from typing import TYPE_CHECKING, Any

from ckpttool.core.checkpoint import hf, tensors
from ckpttool.core.runtime.report import Section, section
from ckpttool.core.transforms.lora.layout import AdapterConfig, Layout
from ckpttool.formats.base import Problem, Reader, Tensor, warning

if TYPE_CHECKING:

    pass


# --------------------------------------------------------------------------------------------
# Reports


@section
class AdapterSummary(Section):
    """An adapter in a few fields, for inspect, merge and verify reports (``lora``)."""

    modules: int
    targets: list[str]
    rank: int | list[int]
    alpha: float | None
    alpha_pattern: dict[str, float] | None
    rank_pattern: dict[str, int] | None
    variant: str  # lora, rslora or dora
    modules_to_save: list[str]
    config: str | None  # where adapter_config.json came from (or what was done instead)
    parameters: int

    def line(self) -> str:
        """The adapter in one line: rank, alpha, variant, targets."""
        rank = self.rank if isinstance(self.rank, int) else "/".join(map(str, self.rank))
        alpha = ("unknown (no adapter_config.json)" if self.alpha is None
                 else f"{self.alpha:g}")
        return (f"LoRA adapter: rank {rank}, alpha {alpha}, {self.variant}, {self.modules} "
                f"modules ({', '.join(self.targets)})"
                + (f", modules_to_save {', '.join(self.modules_to_save)}"
                   if self.modules_to_save else ""))


@section
class LoraMerge(Section):
    """merge's ``lora``: what was done with the adapter (``mode``: ``fuse`` or ``adapter``),
    the adapter (``summary``: its fields are this section's), the ``--adapter`` path, the
    tensors folded, the other way to merge it, and for a written adapter where its
    adapter_config.json came from and what was assumed in it."""

    mode: str
    summary: AdapterSummary
    adapter: str | None = None  # --adapter, as given
    fused: int = 0
    other: str | None = None
    config_from: str | None = None
    assumed: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"mode": self.mode}
        if self.adapter is not None:
            doc["adapter"] = self.adapter
        doc.update(self.summary.to_json())
        if self.mode == "fuse":
            doc["fused"] = self.fused
            if self.other is not None:
                doc["other"] = self.other
        else:
            doc.update(other=self.other, config_from=self.config_from, assumed=self.assumed)
        return doc


def describe(layout: Layout, config: AdapterConfig | None) -> AdapterSummary:
    """The adapter in a few fields, for inspect and merge reports."""
    ranks = sorted({m.rank for m in layout.modules.values() if m.rank is not None})
    targets = sorted({m.name.rsplit(".", 1)[-1] for m in layout.modules.values()})
    variant = ("dora" if any(m.magnitude is not None for m in layout.modules.values())
               or (config is not None and config.use_dora)
               else "rslora" if config is not None and config.use_rslora else "lora")
    return AdapterSummary(
        modules=len(layout.modules),
        targets=targets,
        rank=ranks[0] if len(ranks) == 1 else ranks,
        alpha=None if config is None else config.alpha,
        alpha_pattern=None if config is None else config.alpha_pattern or None,
        rank_pattern=None if config is None else config.rank_pattern or None,
        variant=variant,
        modules_to_save=sorted(layout.trained),
        config=None if config is None else config.source,
        parameters=sum(t.numel for m in layout.modules.values()
                       for t in (m.a, m.b, m.b_bias) if t is not None),
    )


def never_trained(reader: Reader, layout: Layout) -> list[Problem]:
    """A warning when lora_B is all zeros: PEFT initialises B to zero, so such an adapter
    never trained and folding it changes nothing."""
    zero = [m.name for m in layout.modules.values() if m.b is not None and _all_zero(reader, m.b)]
    if not zero:
        return []
    return [warning("lora-untrained",
                    f"lora_B is all zeros in {len(zero)} of {len(layout.modules)} modules "
                    f"(first: '{zero[0]}'): the adapter never trained, and folding it leaves "
                    "the base weights unchanged")]


def _all_zero(reader: Reader, tensor: Tensor) -> bool:
    """Every byte of ``tensor`` is zero (+0.0 in any float dtype), read block by block."""
    return all(block.count(0) == len(block) for _, block in tensors.blocks(reader, tensor))




def assumed_warning(report: LoraMerge) -> str:
    """One line for a merge that wrote an ``adapter_config.json`` it partly assumed."""
    source = report.config_from
    built = f"built from {source} and the weights" if source else "built from the weights"
    return (f"{hf.ADAPTER_CONFIG} {built}; assumed: {'; '.join(report.assumed)}. Check "
            "them against the training run and edit the file if they differ")
