"""The contract's consumers are a small registry (:data:`ckpttool.core.contract.LOADERS`):
a loader (vLLM's or SGLang's weight-name maps, where importable) is one entry, which
``verify --loader NAME`` takes with no other change, and one whose package is missing says
how to install it (exit 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.core import contract

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=96, architectures=["LlamaForCausalLM"])
    path = tmp_path_factory.mktemp("loaders") / "model"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_a_loader_is_one_registry_entry(model_dir: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(contract.LOADERS, "second",
                        contract.Loader("second", contract._transformers_expected))
    r = CliRunner().invoke(app, ["verify", str(model_dir), "--loader", "second"])
    assert r.exit_code == 0, r.output


def test_a_loader_whose_package_is_missing_says_how_to_install_it(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(config: Any) -> contract.Expected:
        raise contract.Unavailable("vllm is not installed here", missing=True)

    monkeypatch.setitem(contract.LOADERS, "vllm",
                        contract.Loader("vllm", absent, install="pip install vllm"))
    r = CliRunner().invoke(app, ["verify", str(model_dir), "--loader", "vllm"])
    assert r.exit_code == 4, r.output
    assert "--loader vllm: vllm is not installed here; install it: pip install vllm" in r.stderr
    checked = contract.check({"lm_head.weight": (96, 32)}, {"model_type": "llama"},
                             loader="vllm")
    assert not checked.checked and checked.hint == "pip install vllm"
