"""transformers 5's runtime layout to what ``save_pretrained`` writes
(:mod:`ckpttool.core.transforms.hub_layout`).

* the tables agree with transformers' own: every alias shares its family's table there, and
  for each family a model built by transformers (on the meta device, from its default config
  made small) comes out with the names and shapes transformers' ``revert_weight_conversion``
  gives;
* real merges: tiny Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, Qwen2-VL and LLaVA models
  saved under FSDP2 (:mod:`tests.hub_layouts`) merge to ``save_pretrained``'s output, key
  for key and byte for byte.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpttool.core.merge.operation import merge
from ckpttool.core.transforms import hub_layout
from ckpttool.errors import InputError
from ckpttool.formats.base import Tensor
from ckpttool.formats.codecs.dtypes import BY_NAME
from tests import hub_layouts

# --------------------------------------------------------------------------------------------
# The tables against transformers'


def _signature(key: str) -> list[tuple[Any, ...]] | None:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    table = get_checkpoint_conversion_mapping(key)
    if table is None:
        return None
    return [(type(t).__name__, tuple(t._original_source_patterns),
             tuple(t._original_target_patterns),
             tuple(type(o).__name__ for o in getattr(t, "operations", ())))
            for t in table]


@pytest.mark.parametrize("alias", sorted(hub_layout.ALIASES))
def test_each_alias_shares_its_family_table_in_transformers(alias: str) -> None:
    family = hub_layout.ALIASES[alias]
    if alias in ("qwen2_vl", "qwen2_5_vl"):  # by model_type, where config.json names no class
        assert _signature(alias) is None
        return
    assert _signature(family) is not None
    assert _signature(alias) == _signature(family), (
        f"transformers' table for {alias} is no longer {family}'s: give it its own Layout")


# Families each table is checked on (their default config, made small); the last ones have
# no conversion in transformers, and none here.
MODEL_TYPES = (
    "mixtral", "minimax_m2", "phimoe", "qwen2_moe", "deepseek_v2", "ernie4_5_moe",
    "granitemoe", "aria", "llava", "llava_next", "video_llava", "mllama", "fuyu", "gemma3",
    "qwen2_audio", "granite_speech", "qwen2_5_vl",
    "qwen3_vl_moe", "smolvlm",
)


def _small(d: dict[str, Any]) -> None:
    for key in ("num_hidden_layers", "depth", "num_layers"):
        if isinstance(d.get(key), int):
            d[key] = min(d[key], 2)
    layers = d.get("num_hidden_layers")
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(d.get(key), list) and isinstance(layers, int):
            d[key] = d[key][:layers]
    if isinstance(d.get("first_k_dense_replace"), int):
        d["first_k_dense_replace"] = 1
    for value in d.values():
        if isinstance(value, dict) and "model_type" in value:
            _small(value)


def _meta_model(model_type: str) -> Any:
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto as auto

    d = AutoConfig.for_model(model_type).to_dict()
    _small(d)
    d.pop("model_type", None)
    config = AutoConfig.for_model(model_type, **d)
    # The model with a language-model head, whichever auto mapping lists it.
    classes = [getattr(auto, n).get(model_type) for n in dir(auto) if n.endswith("_MAPPING_NAMES")
               and isinstance(getattr(auto, n), dict)]
    name = next(c for c in sorted({c for c in classes if isinstance(c, str)}, key=len, reverse=True)
                if c.endswith(("ForConditionalGeneration", "ForCausalLM")))
    cls = getattr(transformers, name)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls._from_config(config)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_names_and_shapes_are_save_pretrained_s(model_type: str) -> None:
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model = _meta_model(model_type)
    state = remove_tied_weights_from_state_dict(dict(model.state_dict()), model)
    expected = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, state).items()}
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    sources: list[tuple[str, hub_layout.Source]] = [
        (k, Tensor(k, (k,), BY_NAME["F32"], tuple(v.shape), ())) for k, v in state.items()]
    converted = hub_layout.convert(sources, config)
    got = {k: s.shape for k, s in (converted.sources if converted else sources)}
    assert sorted(got) == sorted(expected)
    assert got == expected
    assert (converted is not None) == (expected.keys() != state.keys())


# --------------------------------------------------------------------------------------------
# Real merges against save_pretrained


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache: dict[str, Path] = {}

    class Lazy(dict[str, Path]):
        def __missing__(self, family: str) -> Path:
            cache[family] = hub_layouts.write(tmp_path_factory.mktemp(family), family)
            return cache[family]

    return Lazy()


def _load_dir(out: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        state.update(load_file(f))
    return state


@pytest.mark.parametrize("family", hub_layouts.FAMILIES)
def test_merge_writes_what_save_pretrained_writes(family: str, written: dict[str, Path],
                                                  tmp_path: Path) -> None:
    ckpt = written[family]
    report = merge(ckpt, tmp_path / "out")
    expected = _load_dir(ckpt.parent / hub_layouts.REFERENCE)
    got = _load_dir(tmp_path / "out")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert report.layout is not None
    assert report.layout.families
    assert not [w for w in report.warnings if "fused experts" in w]
    if family in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        assert report.layout.split
    else:
        assert not report.layout.split and report.layout.renamed


def test_stored_layout_keeps_the_runtime_names(written: dict[str, Path],
                                               tmp_path: Path) -> None:
    report = merge(written["mixtral"], tmp_path / "out", layout="stored")
    assert report.layout is None
    names = set(_load_dir(tmp_path / "out"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any("block_sparse_moe" in n for n in names)


def test_without_config_fused_experts_are_warned_about(written: dict[str, Path],
                                                       tmp_path: Path) -> None:
    src = tmp_path / "alone"  # the DCP directory alone, no config.json above it
    shutil.copytree(written["qwen3_moe"] / hub_layouts.MODEL_DIR, src)
    report = merge(src, tmp_path / "out", dry_run=True, weights_only=True)
    assert report.layout is None
    assert any("fused experts" in w and "--config" in w for w in report.warnings)
    report = merge(src, tmp_path / "out", dry_run=True,
                   config=written["qwen3_moe"] / "config.json")
    assert report.layout is not None and report.layout.families == ["qwen2_moe"]


# --------------------------------------------------------------------------------------------
# Plans


def _t(name: str, shape: tuple[int, ...]) -> tuple[str, hub_layout.Source]:
    return name, Tensor(name, (name,), BY_NAME["BF16"], shape, ())


def test_a_checkpoint_in_the_hub_layout_is_left_alone() -> None:
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    sources = [_t("model.layers.0.block_sparse_moe.experts.0.w1.weight", (4, 2)),
               _t("model.layers.0.block_sparse_moe.gate.weight", (3, 2))]
    assert hub_layout.convert(sources, config) is None
    assert hub_layout.convert(sources, None) is None


def test_both_layouts_at_once_are_refused() -> None:
    config = {"model_type": "qwen3_moe"}
    sources = [_t("model.layers.0.mlp.experts.gate_up_proj", (2, 8, 4)),
               _t("model.layers.0.mlp.experts.1.gate_proj.weight", (4, 4))]
    with pytest.raises(InputError, match=r"'model\.layers\.0\.mlp\.experts\.1\.gate_proj\."
                       r"weight' would be written twice.*--layout stored"):
        hub_layout.convert(sources, config)


def test_a_fused_tensor_of_odd_rows_is_refused() -> None:
    with pytest.raises(InputError, match=r"shape \[2, 7, 4\] cannot be a fused tensor of 2 "
                       "parts"):
        hub_layout.convert([_t("model.layers.0.mlp.experts.gate_up_proj", (2, 7, 4))],
                           {"model_type": "qwen2_moe"})


def test_each_part_reads_one_range() -> None:
    converted = hub_layout.convert(
        [_t("model.layers.3.mlp.experts.gate_up_proj", (3, 8, 5))], {"model_type": "olmoe"})
    assert converted is not None
    names = [n for n, _ in converted.sources]
    assert names[:3] == ["model.layers.3.mlp.experts.0.gate_proj.weight",
                         "model.layers.3.mlp.experts.0.up_proj.weight",
                         "model.layers.3.mlp.experts.1.gate_proj.weight"]
    spans = [s.spans for _, s in converted.sources]  # type: ignore[union-attr]
    assert spans[3] == ((60, 80, (4, 5)),)  # expert 1, up: rows 4-7 of source[1]
    assert json.dumps(converted.to_json())


def test_every_moe_and_vlm_table_of_transformers_is_converted_or_listed() -> None:
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping

    uncovered = set()
    for key, table in _build_checkpoint_conversion_mapping().items():
        ops = {type(o).__name__ for t in table for o in getattr(t, "operations", ())}
        vlm = any("language_model" in p for t in table
                  for p in (*t._original_source_patterns, *t._original_target_patterns))
        if ("MergeModulelist" in ops or vlm) and hub_layout.layout_for(key) is None:
            uncovered.add(key)
    # The "...Model" classes are the inner models of composite ones, whose rules the
    # composite's Layout holds (the names-and-shapes test checks them together).
    inner = {k for k in uncovered if k.endswith("Model")}
    assert uncovered - inner == hub_layout.NO_TABLE, (
        "transformers' conversion tables changed: give the new family a Layout (or list it)")


def test_a_family_without_a_table_is_warned_about() -> None:
    sources = [_t("model.language_model.layers.0.mlp.up_proj.weight", (4, 2))]
    assert hub_layout.convert(sources, {"model_type": "paddleocr_vl"}) is None
    warning, = hub_layout.unconverted(sources, {"model_type": "paddleocr_vl"})
    assert "save_pretrained converts paddleocr_vl" in warning
    # A family whose runtime layout is its hub layout (gpt-oss keeps its experts fused).
    fused = [_t("model.layers.0.mlp.experts.gate_up_proj", (2, 4, 4))]
    assert hub_layout.unconverted(fused, {"model_type": "gpt_oss"}) == []
