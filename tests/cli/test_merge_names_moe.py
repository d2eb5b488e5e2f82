"""`ckpttool merge --names` for torchtitan's DeepSeek-V3 and gpt-oss.

Checkpoints are written by torchtitan 0.3 itself (:mod:`tests.titan`: its model classes,
FSDP2 on 2 gloo ranks, its CheckpointManager). A merge gives, bit for bit, what torchtitan's
own ``state_dict_adapter.to_hf`` gives, under the names and shapes transformers' own model of
the family holds (gpt-oss: the grouped experts torchtitan 0.3's to_hf drops are written the
way transformers holds them, transposed).
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
from tests import titan


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def titan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("titan_moe")
    for family in titan.MORE_FAMILIES:
        titan.write(root / family, family, expert_bias=True)
        (root / family / "hf").mkdir()
        (root / family / "hf" / "config.json").write_text(json.dumps(titan.hf_config(family)))
    return root


def _merge(titan_dir: Path, family: str, out: Path, *extra: str) -> Any:
    return run("merge", titan_dir / family / titan.STEP_DIR, out, "--names",
               titan.NAME_MAP[family], "--config", titan_dir / family / "hf", *extra)


def _hf_shapes(family: str) -> dict[str, tuple[int, ...]]:
    """What save_pretrained writes for transformers' own model of the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.for_model(**titan.hf_config(family))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = revert_weight_conversion(model, dict(model.state_dict()))
    return {k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parametrize("family", titan.MORE_FAMILIES)
def test_weights_are_torchtitans_to_hf_under_transformers_names(
        titan_dir: Path, tmp_path: Path, family: str) -> None:
    r = _merge(titan_dir, family, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    reference = dict(torch.load(titan_dir / family / titan.REFERENCE))
    expected = titan.adapter(family).to_hf(reference)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in got.items()} == _hf_shapes(family)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    if family == "deepseek-v3":
        assert sorted(got) == sorted(expected)
        assert json.loads(r.stdout)["name_map"]["dropped"] == []
    else:  # to_hf 0.3 drops the grouped experts (mlp1_weight is no parameter's name)
        assert sorted(set(got) - set(expected)) == [
            f"model.layers.{i}.mlp.experts.{p}" for i in range(titan.LAYERS)
            for p in ("down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias")]
        inner = "moe.routed_experts.inner_experts"
        for i in range(titan.LAYERS):
            hf = f"model.layers.{i}.mlp.experts"
            assert torch.equal(got[f"{hf}.gate_up_proj"],
                               reference[f"layers.{i}.{inner}.mlp1_weight_EGD"].transpose(1, 2))
            assert torch.equal(got[f"{hf}.down_proj"],
                               reference[f"layers.{i}.{inner}.mlp2_weight_EDF"].transpose(1, 2))
            assert torch.equal(got[f"{hf}.gate_up_proj_bias"],
                               reference[f"layers.{i}.{inner}.mlp1_bias_EG"])
        warnings = " ".join(r.stderr.split()) if hasattr(r, "stderr") else r.output
        assert "dropped 'layers.0.moe.expert_bias_E', which is not zero" in warnings


def test_the_deepseek_expert_bias_is_its_score_correction(titan_dir: Path,
                                                          tmp_path: Path) -> None:
    r = _merge(titan_dir, "deepseek-v3", tmp_path / "out")
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "out" / "model.safetensors")
    reference = torch.load(titan_dir / "deepseek-v3" / titan.REFERENCE)
    assert torch.equal(got["model.layers.1.mlp.gate.e_score_correction_bias"],
                       reference["layers.1.moe.expert_bias_E"])
    assert reference["layers.1.moe.expert_bias_E"].abs().max() > 0
