"""``merge --quantize fp8-block``'s config as transformers, vLLM and SGLang read it (issue 39,
item 3: "an output vLLM and SGLang load as DeepSeek-style FP8").

vLLM and SGLang cannot run here (no GPU on CI). What their FP8 loaders read of
``quantization_config``, and how they decide that a layer is kept unquantized, is written
below as data (facts read from their sources, no code taken), each rule with the file and
commit it comes from. transformers' rule is its own function, imported. Each output of a
real model (transformers' Llama and DeepSeek-V3, written by ``save_pretrained``) is held
against every loader: the keys it requires are there and valid, and every layer it builds
is skipped exactly when its stored weights are unquantized, without the error a fused layer
with some shards kept raises.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import merge
from tests.helpers import FP8, invoke, weight_dequant

# --- the loaders' rules, as data --------------------------------------------------------------
#
# vLLM, vllm/model_executor/layers/quantization/fp8.py, Fp8Config.from_config and
# get_quant_method; utils/quant_utils.py, is_layer_skipped:
#   0071b24bf8fe (mid 2025): "quant_method" and "activation_scheme" required (get_from_keys),
#     "ignored_layers" only; a Linear skipped when its name is in the list, a fused layer
#     (packed_modules_mapping) when all its shards are, ValueError when only some are;
#     FusedMoE never skipped.
#   1436674bcb3f (late 2025) and 01693a61cbed's quant_utils: "ignored_layers", else
#     "modules_to_not_convert"; FusedMoE ("...experts") skipped when a listed name that
#     contains "experts" contains the layer's name.
# SGLang, python/sglang/srt/layers/quantization/fp8.py (00563d368df9, 2026): the first of
#   "ignored_layers", "modules_to_not_convert" present, each name also with and without a
#   leading "model."; "activation_scheme" required; utils.py is_layer_skipped:
#   006d09616c51: exact names, fused shards as vLLM; between that and PR #23467 (merged
#   2026-04-22) a listed name anywhere in the layer's name (substring); since #23467: equal,
#   the layer under a listed name, or the listed name as whole segments of it.
# Fused layers (vLLM's and SGLang's models' packed_modules_mapping): Llama qkv_proj <- q/k/v,
#   gate_up_proj <- gate/up; DeepSeek-V2/V3 gate_up_proj, fused_qkv_a_proj <- q_a_proj,
#   kv_a_proj_with_mqa; the experts of one layer are one FusedMoE named "...experts".
# transformers 5.23, utils/quantization_config.py FineGrainedFP8Config: modules_to_not_convert,
#   "ignored_layers" as its alias when that is absent; quantizers/quantizers_utils.py
#   should_convert_module; its default kept modules (the head, tied weights) are added only
#   when the config lists none (quantizers/base.py get_modules_to_not_convert); MoE experts
#   are one module "...experts" (its conversion mapping).
# Held conservatively: lm_head and the routers (mlp.gate) are held as Linear layers too,
# although vLLM and SGLang build them unquantized whatever the list says (the head is no
# LinearBase; DeepSeek's, Qwen's and Mixtral's routers are built without quant_config).

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}


def _exact(name: str, listed: list[str]) -> bool:
    return name in listed


def _substring(name: str, listed: list[str]) -> bool:
    return any(x in name for x in listed)


def _segments(name: str, listed: list[str]) -> bool:
    return any(x == name or name.startswith(x + ".") or f".{x}." in f".{name}."
               for x in listed)


def _transformers(name: str, listed: list[str]) -> bool:
    from transformers.quantizers.quantizers_utils import should_convert_module

    return not should_convert_module(name, listed)


def _first(*keys: str, fallback: bool = False) -> Callable[[dict[str, Any]], list[str]]:
    """The list a loader reads: the first key present (``fallback``: the first non-empty)."""
    def read(qc: dict[str, Any]) -> list[str]:
        for k in keys:
            if k in qc and (qc[k] or not fallback):
                return list(qc[k] or [])
        return []
    return read


def _with_model_prefix(names: list[str]) -> list[str]:
    return [v for n in names for v in (n.removeprefix("model."), "model." + n.removeprefix(
        "model."))]


@dataclass(frozen=True)
class Loader:
    name: str
    read: Callable[[dict[str, Any]], list[str]]
    match: Callable[[str, list[str]], bool]
    fuses: bool  # builds vLLM's fused layers (else: one layer per stored Linear)
    moe: str  # how a FusedMoE "...experts" is skipped: "never", "vllm", "match"
    normalise: Callable[[list[str]], list[str]] = list


LOADERS = [
    Loader("vLLM 0071b24", _first("ignored_layers"), _exact, True, "never"),
    Loader("vLLM 1436674", _first("ignored_layers", "modules_to_not_convert", fallback=True),
           _exact, True, "vllm"),
    Loader("SGLang 006d096 (exact)", _first("ignored_layers", "modules_to_not_convert"),
           _exact, True, "match", _with_model_prefix),
    Loader("SGLang before #23467 (substring)", _first("ignored_layers", "modules_to_not_convert"),
           _substring, True, "match", _with_model_prefix),
    Loader("SGLang since #23467 (segments)", _first("ignored_layers", "modules_to_not_convert"),
           _segments, True, "match", _with_model_prefix),
    Loader("transformers 5.23", _first("modules_to_not_convert", "ignored_layers"),
           _transformers, False, "match"),
]


def _moe(module: str) -> str | None:
    parts = module.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "experts" and parts[i + 1].isdecimal():
            return ".".join(parts[:i + 1])
    return None


def layers(modules: set[str], fuses: bool) -> dict[str, list[str]]:
    """The layers a loader builds from the stored Linear modules: name -> the modules in it."""
    out: dict[str, list[str]] = {}
    for m in sorted(modules):
        layer = _moe(m) or m
        if fuses and layer == m:
            parent, _, last = m.rpartition(".")
            layer = next((f"{parent}.{f}" for f, shards in PACKED.items() if last in shards), m)
        out.setdefault(layer, []).append(m)
    return out


def skipped(loader: Loader, layer: str, members: list[str], listed: list[str]) -> bool:
    """Whether ``loader`` keeps ``layer`` unquantized; raises as the loader does."""
    if layer.endswith(".experts"):
        if loader.moe == "never":
            return False
        if loader.moe == "vllm":
            return any(layer in x for x in listed if "experts" in x)
        return loader.match(layer, listed)
    if loader.fuses and len(members) > 1 or layer.rpartition(".")[2] in PACKED:
        verdicts = {loader.match(m, listed) for m in members}
        if len(verdicts) > 1:
            raise ValueError(f"{loader.name}: some but not all shards of {layer} are quantized")
        return verdicts.pop()
    return loader.match(layer, listed)


def hold(out: Path, loaders: list[Loader] = LOADERS) -> None:
    """The config written in ``out`` against every loader's rules; ``verify`` finds it whole
    and no fused layer stored in part."""
    r = invoke("verify", out)
    assert r.exit_code == 0 and "quant-" not in r.output, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "fp8" in qc["quant_method"] and qc["activation_scheme"] == "dynamic"
    assert len(qc["weight_block_size"]) == 2 and qc.get("fmt", "e4m3") == "e4m3"
    got = load_file(out / "model.safetensors")
    linear = {n.removesuffix(".weight"): t for n, t in got.items()
              if n.endswith(".weight") and t.dim() == 2 and "embed" not in n
              and "norm" not in n.rpartition(".")[0].rpartition(".")[2]}
    for loader in loaders:
        listed = loader.normalise(loader.read(qc))
        for layer, members in layers(set(linear), loader.fuses).items():
            quantized = {linear[m].dtype == FP8 for m in members}
            assert len(quantized) == 1, (layer, members)  # a layer is quantized whole
            assert skipped(loader, layer, members, listed) != quantized.pop(), (loader.name,
                                                                                 layer)


# --- real models ------------------------------------------------------------------------------

def _deepseek(tmp: Path) -> Path:
    """A bf16 DeepSeek-V3 (MLA with q_lora_rank, one dense layer, one layer of 4 routed
    experts and a shared one) written by save_pretrained; every Linear a multiple of 128."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=128,
        qk_nope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1,
        max_position_embeddings=64, tie_word_embeddings=False)
    out = tmp / "deepseek"
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def deepseek_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _deepseek(tmp_path_factory.mktemp("q-serving"))


def test_plain_config_holds_for_every_loader(llama_hf: Path, deepseek_hf: Path,
                                             tmp_path: Path) -> None:
    for src in (llama_hf, deepseek_hf):
        out = tmp_path / src.name
        merge(src, out, quantize="fp8-block")
        hold(out)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["modules_to_not_convert"] == qc["ignored_layers"]
    qc = json.loads((tmp_path / "deepseek" / "config.json").read_text())["quantization_config"]
    # the head and the routers (vLLM and SGLang build them unquantized anyway)
    assert qc["ignored_layers"] == ["lm_head", "model.layers.1.mlp.gate"]


def test_a_kept_shard_keeps_its_fused_layer(llama_hf: Path, tmp_path: Path) -> None:
    """Keeping q_proj alone would make vLLM and SGLang refuse the model ("some but not all
    shards of ...qkv_proj are quantized"): k_proj and v_proj are kept with it, and said so."""
    out = tmp_path / "out"
    report = merge(llama_hf, out, quantize="fp8-block",
                   quantize_ignore=("model.layers.0.self_attn.q_proj",
                                    "model.layers.1.mlp.up_proj"))
    hold(out)
    got = load_file(out / "model.safetensors")
    for kept in ("model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
                 "model.layers.1.mlp.gate_proj"):
        assert got[kept + ".weight"].dtype == torch.bfloat16, kept
    assert got["model.layers.1.self_attn.q_proj.weight"].dtype == FP8
    said = " ".join(report.warnings)
    assert "model.layers.0.self_attn.qkv_proj" in said and "model.layers.1.mlp.gate_up_proj" in said


def test_a_kept_expert_keeps_its_layer(deepseek_hf: Path, tmp_path: Path) -> None:
    """One expert kept keeps the layer's experts (one FusedMoE to vLLM and SGLang, one module
    to transformers 5), listed by the layer's name; DeepSeek's q_a / kv_a pair likewise."""
    out = tmp_path / "out"
    report = merge(deepseek_hf, out, quantize="fp8-block",
                   quantize_ignore=("model.layers.1.mlp.experts.2.down_proj",
                                    "model.layers.0.self_attn.q_a_proj"))
    hold(out, [x for x in LOADERS if x.moe != "never"])
    # vLLM 0071b24 builds every FusedMoE quantized: it cannot load kept experts (docs say so)
    with pytest.raises(AssertionError):
        hold(out, [LOADERS[0]])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.experts" in qc["ignored_layers"]
    assert not any(".experts." in x for x in qc["ignored_layers"])
    got = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for n, t in got.items() if ".experts." in n)
    assert got["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.bfloat16
    assert got["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == FP8
    assert any("model.layers.1.mlp.experts" in w for w in report.warnings)


def test_deepseek_output_loads_in_transformers(deepseek_hf: Path, tmp_path: Path) -> None:
    """transformers 5 loads the MoE output with its FP8 config on CPU, the kept experts as
    stored and the quantized ones as DeepSeek's weight_dequant of what was written."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    report = merge(deepseek_hf, out, quantize="fp8-block",
                   quantize_ignore=("model.layers.1.mlp.experts.0.up_proj",))
    assert not [w for w in report.warnings if "edge" in w]
    got = load_file(out / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out)
    params = dict(model.named_parameters())
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.1.mlp.shared_experts.up_proj.weight"):
        want = weight_dequant(got[name], got[name + "_scale_inv"])
        assert torch.allclose(params[name].float(), want.float(), rtol=2 ** -7, atol=0), name
    source = load_file(deepseek_hf / "model.safetensors")
    experts = [p for n, p in params.items() if n.startswith("model.layers.1.mlp.experts.")]
    assert experts and all(p.dtype != FP8 for p in experts)
    ids = torch.tensor([[1, 5, 9]])
    assert torch.isfinite(model(ids).logits).all()
    assert torch.equal(params["lm_head.weight"].to(torch.bfloat16), source["lm_head.weight"])


def test_verify_names_a_fused_layer_stored_in_part(tmp_path: Path) -> None:
    """A checkpoint whose q_proj is plain and whose k_proj / v_proj are block FP8 (one
    fused layer to vLLM and SGLang), or with one expert of a layer plain: a warning naming
    the layer; merge's own output never has one."""
    from ckpttool.core import quantization as qz
    from ckpttool.formats.codecs import dtypes

    f8, f32, bf16 = dtypes.get("F8_E4M3"), dtypes.get("F32"), dtypes.get("BF16")
    stored: dict[str, Any] = {}
    for m in ("self_attn.k_proj", "self_attn.v_proj", "mlp.experts.0.up_proj",
              "mlp.experts.1.up_proj", "mlp.shared_experts.up_proj"):
        stored[f"model.layers.0.{m}.weight"] = (f8, (128, 128))
        stored[f"model.layers.0.{m}.weight_scale_inv"] = (f32, (1, 1))
    stored["model.layers.0.self_attn.q_proj.weight"] = (bf16, (128, 128))
    stored["model.layers.0.mlp.experts.2.up_proj.weight"] = (bf16, (128, 128))
    stored["model.layers.0.mlp.gate.weight"] = (bf16, (4, 128))
    stored["lm_head.weight"] = (bf16, (10, 128))
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"}}
    found = [(p.code, p.severity, p.location.tensor) for p in qz.check(config, stored)]
    assert [f for f in found if f[0] == "quant-fused-split"] == [
        ("quant-fused-split", "warning", "model.layers.0.mlp.experts.2.up_proj"),
        ("quant-fused-split", "warning", "model.layers.0.self_attn.q_proj")]


def test_keep_whole_layers_pure() -> None:
    """The closure on names alone: a kept shard keeps its fused layer, a kept expert its
    layer's experts (listed by the layer's name), and a kept name inside a quantized layer's
    name (SGLang's substring rule of early 2026: a router "mlp.gate" in "mlp.gate_up_proj")
    keeps that layer too."""
    from ckpttool.core import quantization as qz

    layer = "model.layers.3"
    quantized = {f"{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    quantized |= {f"{layer}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    quantized |= {f"{layer}.mlp.experts.{e}.{p}" for e in range(3) for p in ("w1", "w2")}
    quantized |= {"model.layers.13.mlp.gate_proj", "model.layers.13.mlp.up_proj"}
    kept = qz.keep_whole_layers(quantized, {f"{layer}.mlp.gate", f"{layer}.self_attn.k_proj",
                                            f"{layer}.mlp.experts.1.w2"})
    assert kept.quantized == {f"{layer}.self_attn.o_proj", f"{layer}.mlp.down_proj",
                              "model.layers.13.mlp.gate_proj", "model.layers.13.mlp.up_proj"}
    assert kept.listed == ("lm_head", f"{layer}.mlp.experts", f"{layer}.mlp.gate",
                           f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj",
                           f"{layer}.self_attn.k_proj", f"{layer}.self_attn.q_proj",
                           f"{layer}.self_attn.v_proj")
    assert set(kept.widened) == {f"{layer}.self_attn.qkv_proj", f"{layer}.mlp.experts",
                                 f"{layer}.mlp.gate_up_proj"}


@pytest.mark.parametrize(("run_name", "expert"), [
    ("qwen3_moe-ep2", "model.layers.0.mlp.experts.1.down_proj"),
    ("mixtral-ep2", "model.layers.1.block_sparse_moe.experts.0.w2")])
def test_megatron_moe_runs_hold(run_name: str, expert: str, tmp_path: Path) -> None:
    """Megatron-LM's own expert-parallel runs (names through its implied map): the config
    holds for every loader, plain and with one expert kept (its layer kept, by name)."""
    src = Path(__file__).parents[1] / "data" / "megatron_lm" / run_name
    merge(src, tmp_path / "plain", quantize="fp8-block")
    hold(tmp_path / "plain")
    report = merge(src, tmp_path / "kept", quantize="fp8-block", quantize_ignore=(expert,))
    assert report.contract is not None and report.contract.ok
    hold(tmp_path / "kept", [x for x in LOADERS if x.moe != "never"])
    layer = expert.rpartition(".experts.")[0] + ".experts"
    qc = json.loads((tmp_path / "kept" / "config.json").read_text())["quantization_config"]
    assert layer in qc["ignored_layers"]
