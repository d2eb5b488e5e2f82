"""The output contract on the formats that need several processes to write: per-rank files
(verl's FSDP checkpoint manager), DeepSpeed ZeRO and Megatron-LM's own runs. Each holds a real
transformers model whose config.json is there, so a default merge (no ``--weights-only``)
holds its output against that model class: it must be checked, and taken whole.

Writers are real: FSDP2 on gloo ranks saving ``model.state_dict()`` per rank as verl does,
``DeepSpeedEngine.save_checkpoint`` (:mod:`tests.ds_layouts`), Megatron-LM's committed runs
(:mod:`tests.data.megatron_lm`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from tests import ds_layouts
from tests.fsdp2_ranks import run_on_ranks
from tests.helpers import assert_taken_whole, small_llama, verl_rank_files

pytestmark = pytest.mark.filterwarnings("ignore")
MEGATRON = Path(__file__).parents[1] / "data" / "megatron_lm"


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_rank_files_of_a_real_model_hold_the_contract(tmp_path: Path) -> None:
    actor = tmp_path / "global_step_1" / "actor"
    run_on_ranks(verl_rank_files, 2, str(actor))
    report = ckpttool.merge(actor, tmp_path / "out")
    assert_taken_whole(report, len(small_llama().state_dict()))
    from safetensors.torch import load_file

    got, want = load_file(tmp_path / "out" / "model.safetensors"), small_llama().state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.skipif(not ds_layouts.DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_zero_of_a_real_model_holds_the_contract(tmp_path: Path) -> None:
    """ZeRO-3 on 2 ranks, tied embeddings (DeepSpeed stores the head once): the merge writes
    what LlamaForCausalLM takes, the tie as the config says."""
    ckpt = ds_layouts.write_zero(tmp_path / "ckpt", 3, 2, model="llama")
    r = run("merge", ckpt, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["contract"]
    assert doc["checked"] is True and doc["missing"] == [] and doc["misshapen"] == []
    assert doc["extra"] == [], doc
    assert doc["consumer"].startswith("LlamaForCausalLM (transformers")


@pytest.mark.parametrize("name", ["llama-tp2", "llama-pp2", "qwen2-tp2", "qwen3-dp2-full",
                                  "qwen3_moe-ep2"])
@pytest.mark.parametrize("config", ["derived", "given"])
def test_megatron_lm_runs_hold_the_contract(name: str, config: str, tmp_path: Path) -> None:
    """Megatron-LM's own runs, merged with the config derived from its args or with the
    model's config.json: checked, and taken whole."""
    run_dir = MEGATRON / name
    extra = ["--config", run_dir / "hf_config.json"] if config == "given" else []
    r = run("merge", run_dir, tmp_path / "out", "--json", *extra)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["contract"]
    assert doc["checked"] is True, doc
    assert doc["missing"] == [] and doc["misshapen"] == [] and doc["extra"] == [], doc
