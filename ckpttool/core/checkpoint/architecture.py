"""Whether a model's tensor names are the ones transformers gives the architecture its
config.json names, or a training framework's own.

torchtitan, torchtune and Megatron keep their own parameter names (``tok_embeddings.weight``,
``layers.0.attn.q_proj.weight``, ``decoder.layers.0.self_attention...``). Merged as stored,
they make safetensors that ``from_pretrained`` loads *without an error* and with every weight
left at its random initialisation. A merge and ``verify`` say so, and name the ``--names``
map that converts them (:mod:`ckpttool.core.transforms.namemaps`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.core.runtime.report import Section, section
from ckpttool.formats import megatron
from ckpttool.formats.base import Problem, warning

if TYPE_CHECKING:
    from ckpttool.core.checkpoint.discover import Checkpoint


@dataclass(frozen=True)
class Native:
    framework: str
    maps: tuple[str, ...]  # --names maps for its families
    pattern: re.Pattern[str]  # a name only this framework gives


NATIVE = (
    Native("torchtitan", ("torchtitan-llama3", "torchtitan-qwen3", "torchtitan-deepseek-v3",
                          "torchtitan-gpt-oss"),
           re.compile(r"^layers\.\d+\.(attention|feed_forward|moe)\.")),
    Native("torchtune", ("torchtune-llama", "torchtune-qwen2"),
           re.compile(r"^layers\.\d+\.(attn|sa_norm|mlp_norm|mlp\.w[123])\.|^norm\.scale$")),
    Native("Megatron", (), re.compile(r"^(decoder\.layers\.\d+\.|embedding\.word_embeddings\.)")),
    # PEFT's wrapped names; an adapter's own tensors (lora_A/B, ...) are PEFT's to load, no
    # from_pretrained's: they are not held to a model's names.
    Native("PEFT", (), re.compile(r"^base_model\.model\.(?!.*\.lora_)")),
)

# Frameworks whose names `ckpttool merge` maps itself, unasked: what it does, for the advice.
MAPPED_BY_MERGE = {
    "Megatron": "ckpttool merge maps Megatron-Core names itself (its megatron-* map for the "
                "model's family, from config.json or the run's args)",
    "PEFT": "ckpttool merge maps PEFT's names itself (base_model.model. and .base_layer "
            "removed, the adapter folded or written for PEFT)",
}

# Decoder families whose transformers models name every weight model.* or lm_head.*.
_MODEL_PREFIXED = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
    "gemma2", "gemma3_text", "phi3", "deepseek_v2", "deepseek_v3", "gpt_oss", "olmo", "olmo2",
    "olmoe", "granite", "granitemoe", "cohere", "starcoder2", "glm4", "glm4_moe", "minimax"})


@section(frozen=True)
class NameCheck(Section):
    """Names that no transformers model of the config's architecture has."""

    framework: str | None  # whose names they look like; None: unknown
    maps: tuple[str, ...]
    example: str
    count: int
    total: int
    model_type: str | None

    def to_json(self) -> dict[str, Any]:
        return {"framework": self.framework, "maps": list(self.maps), "example": self.example,
                "count": self.count, "total": self.total, "model_type": self.model_type}

    def message(self) -> str:
        config = (f"transformers' model_type {self.model_type!r}" if self.model_type
                  else "any transformers model (and no config.json says which)")
        if self.framework:
            whose = f"{self.framework}'s own names, not {config}"
        else:  # names that fit no framework we know, and not the config's architecture
            whose = (f"not the names {config} gives its weights (model.* and lm_head.*)"
                     if self.model_type else f"not the names of {config}")
        if self.maps:
            fix = f"merge with --names {' or '.join(self.maps)} (and --config)"
        else:
            fix = MAPPED_BY_MERGE.get(self.framework or "", "rename them to the Hugging Face "
                                      "architecture's names first")
        return (f"{self.count} of {self.total} tensor names (e.g. '{self.example}') are "
                f"{whose}: from_pretrained would load none of them and leave those weights "
                f"randomly initialised; {fix}")


def check(names: Collection[str], config: Mapping[str, Any] | None) -> NameCheck | None:
    """A :class:`NameCheck` when ``names`` (a model's canonical names) are a training
    framework's own, or do not fit the config's architecture; None when they fit (or nothing
    tells)."""
    if not names:
        return None
    model_type = config.get("model_type") if config is not None else None
    model_type = model_type if isinstance(model_type, str) else None
    for native in NATIVE:
        hits = sorted(n for n in names if native.pattern.search(n))
        if len(hits) * 2 >= len(names):
            return NameCheck(native.framework, native.maps, hits[0], len(hits), len(names),
                             model_type)
    if model_type in _MODEL_PREFIXED:
        off = sorted(n for n in names if not n.startswith(("model.", "lm_head.")))
        if len(off) * 2 >= len(names):
            return NameCheck(None, (), off[0], len(off), len(names), model_type)
    return None


def problems(names: Collection[str], config: Mapping[str, Any] | None) -> list[Problem]:
    """:func:`check` as a ``verify`` finding (a warning: the bytes are intact)."""
    found = check(names, config)
    if found is None:
        return []
    return [warning("names-not-hf", found.message(), tensor=found.example)]


def problems_of(model: Checkpoint) -> list[Problem]:
    """:func:`problems` for a checkpoint's model weights (nothing for optimizer state, nor
    for a Megatron-Core checkpoint: no loader reads one, and merge maps its names whether
    its layers are stored stacked or one by one)."""
    if model.kind != "model" or model.format == megatron.NAME:
        return []
    return problems([t.name for t in model.tensors if t.part == "model"], model.hf.config)
