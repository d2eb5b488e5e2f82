"""``merge --quantize fp8-block`` from the formats that need several processes to write
(issue 39, item 4): DeepSpeed ZeRO-2 and ZeRO-3 checkpoints (``DeepSpeedEngine.save_checkpoint``
on 2 gloo ranks, :mod:`tests.ds_layouts`) and verl's per-rank files (FSDP2 ranks saving
``model.state_dict()``, as :mod:`tests.core.test_contract_formats` writes them). Each holds a
real transformers Llama with its config.json, so the output is held against the model
class (the contract) and taken whole; every quantized weight and scale is bit for bit the
formula of issue 39 applied to the writer's own full state dict (DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``; the model's own ``state_dict()`` for verl).

Neither writer stores quantized weights (ZeRO partitions the training parameters, verl
saves the training model's state dict): ``--dequantize`` of them is the documented exit 3,
nothing quantized, and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpttool
from tests import ds_layouts
from tests.fsdp2_ranks import run_on_ranks
from tests.helpers import assert_taken_whole, check_quantized, invoke, small_llama, verl_rank_files

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def zero_llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Path:
    """ZeRO-2 (flat partitions cut inside rows) and ZeRO-3 (each parameter split) of a tiny
    tied Llama on 2 ranks; DeepSpeed's consolidation beside each."""
    if not ds_layouts.DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    stage = int(request.param)
    return ds_layouts.write_zero(tmp_path_factory.mktemp(f"q-zero{stage}") / "ckpt", stage, 2,
                                 model="llama")


@pytest.fixture(scope="module")
def verl_actor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    actor = tmp_path_factory.mktemp("q-verl") / "global_step_1" / "actor"
    run_on_ranks(verl_rank_files, 2, str(actor))
    return actor


@pytest.mark.skipif(not ds_layouts.DEEPSPEED, reason="deepspeed is not installed")
def test_quantize_deepspeed_zero(zero_llama: Path, tmp_path: Path) -> None:
    want = torch.load(zero_llama.parent / "reference.pt", weights_only=True)
    out = tmp_path / "out"
    report = ckpttool.merge(zero_llama, out, quantize="fp8-block")
    assert report.format == "deepspeed"
    assert_taken_whole(report, len(_tied_llama_keys()))
    # 2 layers x 7 projections, from the fp32 masters DeepSpeed consolidates
    assert check_quantized(out, want, deduplicated=frozenset({"lm_head.weight"})) == 14
    assert "lm_head.weight" not in load_file(out / "model.safetensors")  # tied: stored once


def _tied_llama_keys() -> list[str]:
    from transformers import LlamaForCausalLM

    return list(LlamaForCausalLM(ds_layouts.llama_config()).state_dict())


@pytest.mark.skipif(not ds_layouts.DEEPSPEED, reason="deepspeed is not installed")
def test_dequantize_deepspeed_has_nothing_to_decode(zero_llama: Path, tmp_path: Path) -> None:
    r = invoke("merge", zero_llama, tmp_path / "out", "--dequantize")
    assert r.exit_code == 3, r.output
    assert "nothing" in r.output.lower() or "no " in r.output.lower(), r.output
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_quantize_verl_rank_files(verl_actor: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = invoke("merge", verl_actor, out, "--quantize", "fp8-block", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["contract"]["checked"] is True and doc["contract"]["extra"] == [], doc["contract"]
    assert doc["contract"]["missing"] == [] and doc["contract"]["misshapen"] == []
    assert check_quantized(out, small_llama().state_dict()) == 14


def test_dequantize_verl_has_nothing_to_decode(verl_actor: Path, tmp_path: Path) -> None:
    r = invoke("merge", verl_actor, tmp_path / "out", "--dequantize")
    assert r.exit_code == 3, r.output
    assert not (tmp_path / "out" / "model.safetensors").exists()
