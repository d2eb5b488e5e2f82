"""`ckpttool merge --names torchtune-llama / torchtune-qwen2`.

The checkpoints are written by torchtune 0.6.1's own ``FullModelTorchTuneCheckpointer`` and
the references by its own converters (``tune_to_hf``, ``qwen2_tune_to_hf``), once, by
``tests/data/torchtune/generate.py`` (torchtune needs a torchao this environment lacks). A
merge must equal the converter's output bit for bit, and load in transformers with no
missing or unexpected key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckpttool.cli import app

DATA = Path(__file__).parent.parent / "data" / "torchtune"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_torchtune_names_become_its_own_converters(family: str, tmp_path: Path) -> None:
    src = DATA / family / "epoch_0" / "model-00001-of-00001.bin"
    r = CliRunner().invoke(app, ["merge", str(src), str(tmp_path / "out"), "--names",
                                 f"torchtune-{family}", "--config", str(DATA / family / "hf")])
    assert r.exit_code == 0, r.output
    expected = load_file(DATA / family / "reference.safetensors")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name

    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_native_names_without_a_map_are_called_so(tmp_path: Path) -> None:
    import json

    src = DATA / "llama" / "epoch_0" / "model-00001-of-00001.bin"
    # With its config, the output is held to LlamaForCausalLM: none of its names would load,
    # so nothing is written and the line names the map.
    r = CliRunner().invoke(app, ["merge", str(src), str(tmp_path / "refused"), "--config",
                                 str(DATA / "llama" / "hf")])
    assert r.exit_code == 3, r.output
    assert "19 of 21 names are torchtune's own: merge with --names torchtune-llama or " \
        "torchtune-qwen2" in " ".join(r.stderr.split())
    assert not (tmp_path / "refused").exists()
    r = CliRunner().invoke(app, ["merge", str(src), str(tmp_path / "out"), "--config",
                                 str(DATA / "llama" / "hf"), "--json", "--weights-only"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["foreign_names"] == {
        "framework": "torchtune", "maps": ["torchtune-llama", "torchtune-qwen2"],
        "example": "layers.0.attn.k_proj.weight", "count": 19, "total": 21,
        "model_type": "llama"}
    message = ("19 of 21 tensor names (e.g. 'layers.0.attn.k_proj.weight') are torchtune's "
               "own names, not transformers' model_type 'llama': from_pretrained would load "
               "none of them and leave those weights randomly initialised; merge with --names "
               "torchtune-llama or torchtune-qwen2 (and --config)")
    assert message in doc["warnings"]
    assert message in " ".join(r.stderr.split())
    # verify says the same of the merged output (it also finds no lm_head.weight where
    # config.json unties it: torchtune's output.weight kept its own name, exit 1)
    r = CliRunner().invoke(app, ["verify", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 1, r.output
    found = [p for p in json.loads(r.stdout)["problems"] if p["code"] == "names-not-hf"]
    assert [p["severity"] for p in found] == ["warning"]
    assert "torchtune's own names" in found[0]["message"]
