"""`ckpttool merge --names`: torchtitan checkpoints to Hugging Face models.

Checkpoints are written by torchtitan 0.3 itself (its model classes, FSDP2 on 2 gloo ranks,
its CheckpointManager; :mod:`tests.titan`). A merge must give, bit for bit, the weights that
torchtitan's own ``state_dict_adapter.to_hf`` gives, and a model that transformers loads and
that computes torchtitan's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.cli.merge import NAME_MAPS
from tests import titan


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def titan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory per case, each with checkpoint/step-1, reference.pt and hf/config.json:
    the three families saved by the CheckpointManager, Llama 3 saved from its parameters
    (fused wqkv), and Qwen 3 MoE with a non-zero expert bias."""
    root = tmp_path_factory.mktemp("titan")
    cases = {family: dict(family=family) for family in titan.FAMILIES}
    cases["llama3-fused"] = dict(family="llama3", how="parameters")
    cases["qwen3-moe-biased"] = dict(family="qwen3-moe", expert_bias=True)
    for case, kw in cases.items():
        family = kw.pop("family")
        titan.write(root / case, family, **kw)
        (root / case / "hf").mkdir()
        (root / case / "hf" / "config.json").write_text(json.dumps(titan.hf_config(family)))
    return root


def merge(titan_dir: Path, case: str, out: Path, *extra: str, names: str | None = None,
          config: str | None = None) -> Any:
    family = case.split("-fused")[0].removesuffix("-biased")
    return run("merge", titan_dir / case / titan.STEP_DIR, out,
               "--names", names or titan.NAME_MAP[family],
               "--config", titan_dir / (config or case) / "hf", *extra)


def reference(titan_dir: Path, case: str) -> dict[str, torch.Tensor]:
    return dict(torch.load(titan_dir / case / titan.REFERENCE))


@pytest.mark.parametrize("case", ["llama3", "qwen3", "qwen3-moe", "llama3-fused"])
def test_weights_are_torchtitans_own_to_hf_bit_for_bit(titan_dir: Path, tmp_path: Path,
                                                        case: str) -> None:
    r = merge(titan_dir, case, tmp_path / "out")
    assert r.exit_code == 0, r.output
    family = case.removesuffix("-fused")
    expected = titan.adapter(family).to_hf(reference(titan_dir, case))
    got = load_file(tmp_path / "out" / "model.safetensors")
    # Same names (for tied Qwen 3: lm_head left out by both, torchtitan's adapter because the
    # model ties its weights, ckpttool because config.json does and the two are identical).
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_cast_is_torchtitans_to_hf_cast(titan_dir: Path, tmp_path: Path) -> None:
    r = merge(titan_dir, "llama3-fused", tmp_path / "out", "--dtype", "bf16")
    assert r.exit_code == 0, r.output
    expected = titan.adapter("llama3").to_hf(reference(titan_dir, "llama3-fused"))
    got = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name


def _hf_logits(out: Path, tokens: torch.Tensor) -> tuple[Any, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return model, model(tokens).logits


# fp32 throughout: only summation order differs (1e-6 seen). torchtitan's GroupedExperts
# computes the experts in bf16 (it casts activations and weights to bfloat16 inside its
# forward; transformers stays in fp32): 3e-3 seen, on logits of magnitude 1.6.
TOLERANCE = {"llama3": 1e-5, "qwen3": 1e-5, "qwen3-moe": 2e-2}


@pytest.mark.parametrize("family", titan.FAMILIES)
def test_transformers_computes_torchtitans_logits(titan_dir: Path, tmp_path: Path,
                                                  family: str) -> None:
    r = merge(titan_dir, family, tmp_path / "out")
    assert r.exit_code == 0, r.output
    model = titan.build(family)
    model.load_state_dict(reference(titan_dir, family), strict=True)
    tokens = torch.randint(0, titan.VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = titan.logits(model, tokens)
    hf_model, got = _hf_logits(tmp_path / "out", tokens)
    assert type(hf_model).__name__ == titan.hf_config(family)["architectures"][0]
    assert (got - expected).abs().max().item() <= TOLERANCE[family]
    if family == "qwen3-moe":
        # The tolerance is not loose enough to hide a mapping error: two experts swapped
        # move the logits far more.
        with torch.no_grad():
            experts = hf_model.model.layers[0].mlp.experts.gate_up_proj
            experts[[0, 1]] = experts[[1, 0]]
            swapped = hf_model(tokens).logits
        assert (swapped - expected).abs().max().item() > 10 * TOLERANCE[family]


def test_report_says_what_the_map_did(titan_dir: Path, tmp_path: Path) -> None:
    r = merge(titan_dir, "llama3", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert "  names (torchtitan-llama3): 17 renamed, 4 rope-permuted\n" in r.stdout
    r = merge(titan_dir, "qwen3-moe", tmp_path / "moe", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["name_map"]
    assert doc["map"] == "torchtitan-qwen3"
    assert doc["counts"] == {"renamed": 21, "expert-split": 2 * 3 * titan.EXPERTS}
    assert {"from": "layers.1.moe.routed_experts.inner_experts.w2_EDF[3]",
            "to": "model.layers.1.mlp.experts.3.down_proj.weight",
            "op": "expert-split"} in doc["tensors"]
    assert [d["name"] for d in doc["dropped"]] == ["layers.0.moe.expert_bias_E",
                                                   "layers.1.moe.expert_bias_E"]
    assert r.stderr == ""  # a zero expert bias is dropped without a warning


def test_a_trained_expert_bias_is_dropped_with_a_warning(titan_dir: Path,
                                                         tmp_path: Path) -> None:
    r = merge(titan_dir, "qwen3-moe-biased", tmp_path / "out")
    assert r.exit_code == 0, r.output
    warnings = [line for line in r.stderr.splitlines() if "expert_bias_E" in line]
    assert len(warnings) == 2
    assert warnings[0].startswith(
        "ckpttool: warning: dropped 'layers.0.moe.expert_bias_E', which is not zero (max "
        "|value| ")
    assert warnings[0].endswith(
        "torchtitan's load-balancing expert bias, which Hugging Face's Qwen3-MoE has no place "
        "for (torchtitan's own to_hf drops it too); the merged model can behave differently "
        "from the trained one")


# --------------------------------------------------------------------------------------------
# A wrong map, config or checkpoint: exit 3, one line, nothing written


def _config(titan_dir: Path, name: str, **changes: Any) -> str:
    """A copy of a case's config.json with ``changes``, as a new case directory name."""
    base = "qwen3-moe" if name.startswith("qwen3-moe") else name.split("-")[0]
    config = {**titan.hf_config(base), **changes}
    case = f"{name}-cfg-{len(list(titan_dir.glob('*-cfg-*')))}"
    (titan_dir / case / "hf").mkdir(parents=True)
    (titan_dir / case / "hf" / "config.json").write_text(json.dumps(config))
    return case


def _fails(r: Any, out: Path, message: str) -> None:
    assert r.exit_code == 3, r.output
    assert r.stderr == f"ckpttool: error: {message}\n"
    assert not (out / "model.safetensors").exists()


def test_another_familys_config_is_refused(titan_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = merge(titan_dir, "qwen3", out, names="torchtitan-llama3")
    _fails(r, out, f"{titan_dir}/qwen3/hf/config.json: model_type 'qwen3' is not Llama 3 "
           "(llama), which --names torchtitan-llama3 maps to; pass the config.json of the "
           "model that was trained, or the map of its family")


def test_a_qwen3_checkpoint_has_tensors_the_llama3_map_does_not_know(
        titan_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = merge(titan_dir, "qwen3", out, names="torchtitan-llama3", config="llama3")
    _fails(r, out, "--names torchtitan-llama3: no rule maps 'layers.0.attention.k_norm.weight', "
           "'layers.0.attention.q_norm.weight', 'layers.1.attention.k_norm.weight' and 1 more; "
           "this is not a torchtitan Llama 3 model checkpoint (or it holds more than the "
           "model). Check the map, or merge without --names")


def test_a_llama3_checkpoint_lacks_what_qwen3_has(titan_dir: Path, tmp_path: Path) -> None:
    # Every Llama 3 name is also a Qwen 3 name: what gives it away is what is missing (the
    # RoPE permutation would otherwise be silently skipped).
    out = tmp_path / "out"
    case = _config(titan_dir, "qwen3", head_dim=16, tie_word_embeddings=False)
    r = merge(titan_dir, "llama3", out, names="torchtitan-qwen3", config=case)
    _fails(r, out, "--names torchtitan-qwen3: nothing in the checkpoint becomes "
           "'model.layers.0.self_attn.q_norm.weight' (and 3 more); the checkpoint is not the "
           "model config.json describes: check the map and config")


def test_a_config_of_other_sizes_is_a_shape_error(titan_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    case = _config(titan_dir, "llama3", num_key_value_heads=4)
    r = merge(titan_dir, "llama3", out, config=case)
    _fails(r, out, f"'layers.0.attention.qkv_linear.wk.weight': shape [32, 64], but --names "
           f"torchtitan-llama3 with {titan_dir}/{case}/hf/config.json (head_dim 16, "
           "hidden_size 64, num_attention_heads 4, num_key_value_heads 4) expects [64, 64] "
           "([num_key_value_heads*head_dim, hidden_size]); the checkpoint is not this model: "
           "check the map and config.json")


def test_a_moe_checkpoint_with_a_dense_config_is_refused(titan_dir: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    case = _config(titan_dir, "qwen3", tie_word_embeddings=False)
    r = merge(titan_dir, "qwen3-moe", out, config=case)
    _fails(r, out, f"'layers.0.moe.expert_bias_E': {titan_dir}/{case}/hf/config.json has no "
           "'num_experts', which --names torchtitan-qwen3 needs for this tensor: it describes "
           "another model (model_type qwen3); pass the config.json of the model that was "
           "trained")


def test_fewer_layers_than_the_config_says(titan_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    case = _config(titan_dir, "llama3", num_hidden_layers=3)
    r = merge(titan_dir, "llama3", out, config=case)
    _fails(r, out, f"--names torchtitan-llama3: the checkpoint has layers 0-1, but {titan_dir}/"
           f"{case}/hf/config.json says num_hidden_layers 3; pass the config of the model that "
           "was trained (a pipeline stage alone is not a model)")


def test_a_map_needs_a_config(titan_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run("merge", titan_dir / "llama3" / titan.STEP_DIR, out, "--names", "torchtitan-llama3")
    _fails(r, out, "--names torchtitan-llama3 needs the model's Hugging Face config.json "
           "(heads, sizes); put it beside the checkpoint or pass --config")


def test_an_unknown_map_is_a_usage_error(titan_dir: Path, tmp_path: Path) -> None:
    r = run("merge", titan_dir / "llama3" / titan.STEP_DIR, tmp_path / "out", "--names",
            "torchtitan-gpt2")
    assert r.exit_code == 2
    said = " ".join(r.output.split())
    assert "'torchtitan-gpt2' is not one of " in said
    assert ("torchtitan-llama3, torchtitan-qwen3, torchtitan-deepseek-v3, torchtitan-gpt-oss, "
            "torchtune-llama, torchtune-qwen2, none") in said


def test_the_cli_lists_every_map() -> None:
    from ckpttool.core.transforms.maps import NAMES

    assert NAME_MAPS == NAMES


def test_names_with_a_lora_adapter_is_not_supported_yet(lora_ckpts: Path,
                                                        tmp_path: Path) -> None:
    ckpt = lora_ckpts / "lora"
    out = tmp_path / "out"
    r = run("merge", ckpt, out, "--names", "torchtitan-llama3")
    assert r.exit_code == 4, r.output
    assert r.stderr == (f"ckpttool: error: {ckpt}/pytorch_model_fsdp_0: --names with a LoRA "
                        "adapter is not supported yet; merge without the adapter, or without "
                        "--names\n")
    assert not (out / "model.safetensors").exists()
