"""The layout ``save_pretrained`` writes, from transformers 5's runtime layout.

transformers 5 keeps a mixture of experts fused at run time (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) and nests a vision-language model's
parts under ``model.`` (``model.language_model.*``, ``model.vision_tower.*``); a training state
dict holds those names. ``save_pretrained`` turns them back into the layout on the Hugging
Face Hub (``block_sparse_moe.experts.N.w1.weight`` for Mixtral, ``mlp.experts.N.gate_proj.
weight`` for Qwen2-MoE and its kin, ``language_model.model.*`` for LLaVA...), which is what
transformers 4, vLLM and every other loader read. transformers 4 loads the fused names
*without an error*, with the experts left randomly initialised.

The rules here are those of transformers' own declarative conversion tables
(``transformers/conversion_mapping.py``), reversed as ``revert_weight_conversion`` reverses
them, written down as data so that a merge needs neither torch nor transformers to plan them:
per family, the fused tensors split per expert (:class:`Unfuse`) and the regex renames
(:class:`Rename`), looked up by ``config.json``'s ``architectures`` then ``model_type``, and
for a composite model its text model's (``text_config``) rules under its prefix.
``tests/core/test_hub_layout.py`` checks every table against transformers' own on the
installed version: names and shapes for each family, values for one of each kind.

A renamed tensor is still copied file to file. A split part of a fused tensor is one
contiguous range of it (expert ``e``, part ``k``), read alone: memory is bounded by one output
tensor (:class:`~ckpttool.core.transforms.derive.Derived` with ``spans``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from ckpttool.core.runtime.report import Section, section
from ckpttool.core.transforms.derive import Derived
from ckpttool.errors import InputError
from ckpttool.formats.base import Tensor

if TYPE_CHECKING:
    import torch

Source = Tensor | Derived

# --------------------------------------------------------------------------------------------
# Rules


@dataclass(frozen=True)
class Rename:
    """The first match of ``pattern`` (a regex searched in a runtime name) becomes
    ``target``."""

    pattern: str
    target: str


@dataclass(frozen=True)
class Unfuse:
    """A fused ``[E, ...]`` tensor whose name matches ``pattern``, split into one tensor per
    expert and per part: the match becomes each of ``targets`` ("*": the expert number), in
    order along the expert's dim 0 (gate rows, then up rows)."""

    pattern: str
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    """One family's rules, as transformers' table of the same ``key`` holds them."""

    key: str  # transformers' table: a model_type or a class name
    unfuse: tuple[Unfuse, ...] = ()
    renames: tuple[Rename, ...] = ()  # applied in order, after the unfuse


def _experts(gate: str, up: str, down: str, at: str = r"\.experts\.") -> tuple[Unfuse, ...]:
    """The two fused expert tensors of a family whose hub layout names experts
    ``experts.N.<gate|up|down>.weight``."""
    plain = at.replace("\\", "")
    return (Unfuse(rf"{at}gate_up_proj(?!\w)",
                   (f"{plain}*.{gate}.weight", f"{plain}*.{up}.weight")),
            Unfuse(rf"{at}down_proj(?!\w)", (f"{plain}*.{down}.weight",)))


def _towers(*towers: str, language: str = "language_model.model",
            head: str = "language_model.lm_head") -> tuple[Rename, ...]:
    """A vision (or audio) language model: ``model.language_model`` back to ``language``,
    ``lm_head`` to ``head``, and each ``model.<tower>`` to ``<tower>``."""
    renames = [Rename(r"^model\.language_model(?!\w)", language)]
    if head != "lm_head":
        renames.append(Rename(r"^lm_head(?!\w)", head))
    renames += [Rename(rf"^model\.{t}(?!\w)", t) for t in towers]
    return tuple(renames)


LAYOUTS: dict[str, Layout] = {lay.key: lay for lay in (
    Layout("mixtral", _experts("w1", "w3", "w2"), (Rename(r"\.mlp\.", ".block_sparse_moe."),)),
    Layout("phimoe", _experts("w1", "w3", "w2"),
           (Rename(r"\.router\.weight(?!\w)", ".gate.weight"),
            Rename(r"\.mlp\.", ".block_sparse_moe."))),
    Layout("minimax_m2", _experts("w1", "w3", "w2"),
           (Rename(r"\.mlp\.e_score_correction_bias(?!\w)",
                   ".block_sparse_moe.e_score_correction_bias"),
            Rename(r"\.mlp\.", ".block_sparse_moe."))),
    Layout("qwen2_moe", _experts("gate_proj", "up_proj", "down_proj", r"mlp\.experts\.")),
    Layout("ernie4_5_moe", _experts("gate_proj", "up_proj", "down_proj", r"mlp\.experts\."),
           (Rename(r"mlp\.gate\.moe_statics\.e_score_correction_bias(?!\w)",
                   "mlp.moe_statics.e_score_correction_bias"),)),
    Layout("exaone_moe", _experts("gate_proj", "up_proj", "down_proj", r"mlp\.experts\."),
           (Rename(r"mlp\.gate\.e_score_correction_bias(?!\w)", "mlp.e_score_correction_bias"),)),
    # Older fused names of the same layout.
    Layout("aria_text", renames=(
        Rename(r"mlp\.experts\.gate_up_proj(?!\w)", "mlp.experts.fc1.weight"),
        Rename(r"mlp\.experts\.down_proj(?!\w)", "mlp.experts.fc2.weight"))),
    Layout("granitemoe", renames=(
        Rename(r"block_sparse_moe\.router\.weight(?!\w)", "block_sparse_moe.router.layer.weight"),
        Rename(r"block_sparse_moe\.experts\.down_proj(?!\w)",
               "block_sparse_moe.output_linear.weight"),
        Rename(r"block_sparse_moe\.experts\.gate_up_proj(?!\w)",
               "block_sparse_moe.input_linear.weight"))),
    Layout("llava", renames=_towers("vision_tower", "multi_modal_projector")),
    Layout("llava_next", renames=_towers("vision_tower", "multi_modal_projector",
                                         "image_newline")),
    Layout("video_llava", renames=_towers("image_tower", "video_tower",
                                          "multi_modal_projector")),
    Layout("mllama", renames=_towers("vision_model", "multi_modal_projector")),
    Layout("fuyu", renames=_towers("vision_embed_tokens")),
    Layout("qwen2_audio", renames=_towers("audio_tower", "multi_modal_projector")),
    Layout("granite_speech", renames=_towers("encoder", "projector")),
    Layout("Qwen2VLForConditionalGeneration",
           renames=_towers("visual", language="model", head="lm_head")),
)}

# transformers' own aliases (``_MODEL_TO_CONVERSION_PATTERN``) for the tables above: the
# families that share them.
ALIASES: dict[str, str] = {
    "minimax": "mixtral",
    **dict.fromkeys(("granitemoeshared", "granitemoehybrid"), "granitemoe"),
    **dict.fromkeys((
        "afmoe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "glm4_moe",
        "glm4_moe_lite", "glm_moe_dsa", "glm4v_moe", "longcat_flash", "solar_open", "mellum",
        "qwen3_moe", "beam", "qwen3_next", "hunyuan_v1_moe", "flex_olmo", "olmoe",
        "cohere2_moe"), "qwen2_moe"),
    **dict.fromkeys(("aria", "paligemma", "aya_vision", "got_ocr2", "gemma3", "internvl",
                     "vipllava", "mistral3", "pp_chart2table"), "llava"),
    **dict.fromkeys(("llava_next_video", "llava_onevision"), "llava_next"),
    **dict.fromkeys(("voxtral", "voxtral_realtime", "audioflamingo3", "glmasr",
                     "musicflamingo"), "qwen2_audio"),
    **dict.fromkeys(("Qwen2_5_VLForConditionalGeneration", "qwen2_vl", "qwen2_5_vl"),
                    "Qwen2VLForConditionalGeneration"),
}

# Where a composite model keeps its text model at run time: its rules apply under these.
TEXT_SCOPES = ("model.language_model.", "language_model.")


def layout_for(key: str | None) -> Layout | None:
    if not key:
        return None
    return LAYOUTS.get(ALIASES.get(key, key))


def _scoped(config: Mapping[str, Any]) -> list[tuple[tuple[str, ...], Layout]]:
    """The layouts a model's config calls for: its text model's (under its prefix) first,
    then its own, as transformers reverts them (sub-models first)."""
    out: list[tuple[tuple[str, ...], Layout]] = []
    text = config.get("text_config")
    if isinstance(text, Mapping):
        nested = layout_for(text.get("model_type"))
        if nested is not None:
            out.append((TEXT_SCOPES, nested))
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    own = layout_for(arch) or layout_for(config.get("model_type")
                                         if isinstance(config.get("model_type"), str) else None)
    if own is not None and all(own is not lay for _, lay in out):
        out.append(((), own))
    return out


# --------------------------------------------------------------------------------------------
# Applying them


@section
class Converted(Section):
    """The hub-layout tensors, and what was done, for the report."""

    families: list[str]
    sources: list[tuple[str, Source]]
    renamed: dict[str, str] = field(default_factory=dict)  # runtime name -> hub name
    split: dict[str, int] = field(default_factory=dict)  # fused runtime name -> tensors made

    def to_json(self) -> dict[str, Any]:
        examples = [{"from": a, "to": b} for a, b in list(self.renamed.items())[:3]]
        examples += [{"from": a, "to": f"{n} tensors"} for a, n in list(self.split.items())[:3]]
        return {"from": "transformers runtime layout", "to": "save_pretrained layout",
                "families": self.families, "renamed": len(self.renamed),
                "split": len(self.split),
                "written": sum(self.split.values()) + len(self.renamed), "examples": examples}


def _match(pattern: str, name: str, scopes: tuple[str, ...]) -> tuple[str, re.Match[str]] | None:
    """``pattern`` searched in ``name`` past one of ``scopes`` (none: the whole name)."""
    prefix = "" if not scopes else next((s for s in scopes if name.startswith(s)), None)
    if prefix is None:
        return None
    m = re.search(pattern, name[len(prefix):])
    return (prefix, m) if m else None


def _sub(name: str, prefix: str, m: re.Match[str], target: str) -> str:
    rest = name[len(prefix):]
    return prefix + rest[: m.start()] + target + rest[m.end():]


def _rename(name: str, layouts: list[tuple[tuple[str, ...], Layout]]) -> str:
    for scopes, lay in layouts:
        for r in lay.renames:
            found = _match(r.pattern, name, scopes)
            if found is not None:
                name = _sub(name, *found, r.target)
    return name


def convert(sources: list[tuple[str, Source]], config: Mapping[str, Any] | None
            ) -> Converted | None:
    """The tensors ``save_pretrained`` would write for ``sources`` (runtime names, model
    order); None where the config's family has no conversion or nothing in ``sources`` needs
    one (a checkpoint already in the hub layout). Pure: no data read.

    Raises:
        InputError: a fused tensor that cannot be split as the family's table says (its
            dim 1 not a multiple of its parts), or two tensors that would get one name.
    """
    if config is None:
        return None
    layouts = _scoped(config)
    if not layouts:
        return None
    out = Converted([lay.key for _, lay in layouts], [])
    for name, source in sources:
        parts = _unfuse(name, source, layouts)
        if parts is None:
            hub = _rename(name, layouts)
            if hub != name:
                out.renamed[name] = hub
            out.sources.append((hub, source))
            continue
        out.split[name] = len(parts)
        out.sources += [(_rename(part, layouts), derived) for part, derived in parts]
    if not out.renamed and not out.split:
        return None
    seen: dict[str, int] = {}
    for hub, _ in out.sources:
        seen[hub] = seen.get(hub, 0) + 1
    twice = sorted(n for n, k in seen.items() if k > 1)
    if twice:
        raise InputError(
            f"'{twice[0]}' would be written twice when converting to the save_pretrained "
            f"layout ({', '.join(out.families)}): the checkpoint holds some weights both fused "
            "and per expert. Merge with --layout stored to keep the names as stored")
    return out


def _unfuse(name: str, source: Source, layouts: list[tuple[tuple[str, ...], Layout]]
            ) -> list[tuple[str, Derived]] | None:
    for scopes, lay in layouts:
        for u in lay.unfuse:
            found = _match(u.pattern, name, scopes)
            if found is None:
                continue
            return _parts(name, source, u, _sub(name, *found, "\0"))
    return None


def _parts(name: str, source: Source, u: Unfuse, template: str) -> list[tuple[str, Derived]]:
    """Expert ``e``'s part ``k`` of the fused ``source`` (``[E, P*R, ...]`` for P parts):
    rows ``[k*R, (k+1)*R)`` of ``source[e]``, as transformers' reversed ``Concatenate(dim=1)``
    and ``MergeModulelist(dim=0)`` (``chunk`` then ``unbind``) make them."""
    num = len(u.targets)
    if len(source.shape) < 2 or source.shape[1] % num:
        raise InputError(
            f"'{name}': shape {list(source.shape)} cannot be a fused tensor of {num} parts per "
            "expert (dim 1 must divide by it); merge with --layout stored to keep it as stored")
    experts, rows = source.shape[0], source.shape[1] // num
    shape = (rows, *source.shape[2:])
    inner = math.prod(shape)
    out = []
    for e in range(experts):
        for k, target in enumerate(u.targets):
            hub = template.replace("\0", target.replace("*", str(e)))
            what = f"expert {e} part {k + 1}/{num} of {name}"
            start = (e * num + k) * inner
            if isinstance(source, Tensor):
                derived = Derived(hub, (source,), source.dtype, shape, _first, what,
                                  spans=((start, start + inner, shape),))
            else:  # a tensor computed itself (a LoRA fold): computed whole, then sliced
                derived = Derived(hub, source.inputs, source.dtype, shape,
                                  partial(_part_of, base=source, e=e, k=k, num=num), what,
                                  readers=source.readers, select=source.select,
                                  spans=source.spans)
            out.append((hub, derived))
    return out


def _first(inputs: list[torch.Tensor]) -> torch.Tensor:
    return inputs[0]


def _part_of(inputs: list[torch.Tensor], *, base: Derived, e: int, k: int, num: int
             ) -> torch.Tensor:
    return base.compute(inputs)[e].chunk(num, dim=0)[k]


CHOICES = ("hub", "stored")

_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")

# transformers' conversion tables for mixtures of experts and vision-language models that
# ckpttool has no Layout for yet (transformers 5.23): such a model is written in its runtime
# layout, with a warning. Pinned by a test, so that an upgrade that adds one says so.
NO_TABLE = frozenset({
    "axk1", "axk2", "bailing_hybrid", "cosmos3_edge", "cosmos3_omni", "deepseek_ocr2",
    "deepseek_v4", "dots3_note_vision_encoder", "ernie4_5_vl_moe", "flint", "gemma3n_text",
    "glm5_next", "glm5_next_text", "granite_speech_plus", "hunyuan_vl", "hy_v3",
    "hyperclovax_vision_v2", "inkling2", "inkling_mm_model", "jamba", "kimi_k25",
    "kimi_linear", "kolibri1", "laguna", "legacy", "lfm2_moe", "mimo_v2_flash",
    "minimax_m3_vl", "mistral_large4", "mistral_large4_text", "molmo2", "nemo_speechlm",
    "nemotron_h", "paddleocr_vl", "pi0", "qianfan_ocr", "qwen2_5_omni_thinker",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_omni_moe", "qwen3_omni_moe_text",
    "qwen3_omni_moe_thinker", "qwen4_exp_text", "step3p7", "unlimited_ocr", "vibevoice_asr",
    "Qwen2_5OmniThinkerForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration",
})


def unconverted(sources: list[tuple[str, Source]], config: Mapping[str, Any] | None
                ) -> list[str]:
    """A warning where a model stays in its runtime layout although save_pretrained would
    convert it: fused experts and no config.json to tell the family, or a family whose
    transformers table ckpttool lacks (:data:`NO_TABLE`)."""
    if config is None:
        fused = next((name for name, _ in sources if _FUSED.search(name)), None)
        if fused is None:
            return []
        return [f"'{fused}' and the other fused experts are written as transformers 5 holds "
                "them at run time: without config.json the model family, and so the layout "
                "save_pretrained writes, is unknown; pass the model's config.json with --config"]
    archs = config.get("architectures")
    text = config.get("text_config")
    keys = [archs[0] if isinstance(archs, list) and archs else None, config.get("model_type"),
            text.get("model_type") if isinstance(text, Mapping) else None]
    family = next((k for k in keys if isinstance(k, str) and k in NO_TABLE), None)
    if family is None:
        return []
    return [f"written in transformers 5's runtime layout: save_pretrained converts {family} "
            "to another layout, for which ckpttool has no table yet; transformers 5 loads "
            "it, transformers 4 and vLLM may not (--layout stored silences this)"]
