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
