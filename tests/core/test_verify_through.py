"""``verify SRC --against OUT`` holds ckpttool's own default merges to their sources through
the maps the merge used: save_pretrained's hub layout (Mixtral, Qwen3-MoE: fused experts
written per expert), the LoRA fold of PEFT's ``.default`` names (verl), a name map (Megatron's
implied one, torchtitan's with ``--names``). The documented CI recipe
(``verify SRC --against OUT --allow-cast``) must exit 0 on each, and a changed byte of the
output must be found and named.

Inputs are the real writers' (FSDP2 on gloo ranks, verl's FSDP checkpoint manager with a PEFT
model, Megatron-LM's committed runs, torchtitan's CheckpointManager); the only hand-made
change is the flipped byte.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from tests import hub_layouts, lora_layouts, titan

pytestmark = pytest.mark.filterwarnings("ignore")
MEGATRON = Path(__file__).parents[1] / "data" / "megatron_lm"
ACTOR = Path("global_step_1") / "actor"
STEP = Path("checkpoints") / "checkpoint_0"


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def recipe(src: Path, out: Path, *extra: str | Path) -> dict[str, Any]:
    """The CI recipe of docs/verify.md, as JSON: its exit code beside the document."""
    r = run("verify", src, "--against", out, "--allow-cast", "--json", *extra)
    doc = json.loads(r.stdout)
    doc["exit"] = r.exit_code
    return doc


def errors(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in doc["problems"] if p["severity"] == "error"]


def flip(out: Path, name: str) -> None:
    """One element of ``name`` in OUT's single shard changed (the hostile input)."""
    path = out / "model.safetensors"
    state = load_file(path)
    state[name] = state[name].clone()
    state[name].view(-1)[1] += 1
    save_file(state, path, metadata={"format": "pt"})


# --- hub layout: MoE experts as save_pretrained writes them


@pytest.mark.parametrize(("family", "expert"), [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w2.weight"),
    ("qwen3_moe", "model.layers.1.mlp.experts.3.down_proj.weight")])
def test_recipe_on_default_moe_merges(family: str, expert: str, tmp_path: Path) -> None:
    src = hub_layouts.write(tmp_path / family, family)
    out = tmp_path / "out"
    report = ckpttool.merge(src, out)
    assert report.layout is not None and report.contract is not None and report.contract.ok
    doc = recipe(src, out)
    assert doc["exit"] == 0 and not errors(doc), errors(doc)
    flip(out, expert)
    doc = recipe(src, out)
    assert doc["exit"] == 1
    (bad,) = errors(doc)
    assert bad["code"] == "data-differs", bad
    assert bad["location"]["tensor"] == "model.layers.1.mlp.experts.down_proj"


# --- LoRA: verl's PEFT names (.default), folded or written as an adapter


@pytest.fixture(scope="module")
def verl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lora_layouts.write_verl_lora(tmp_path_factory.mktemp("verl-through"))


def test_recipe_on_default_verl_lora_merge(verl: Path, tmp_path: Path) -> None:
    src, out = verl / ACTOR, tmp_path / "fused"
    assert ckpttool.merge(src, out).lora is not None
    doc = recipe(src, out)
    assert doc["exit"] == 0 and not errors(doc), errors(doc)
    (mapped,) = [p for p in doc["problems"] if p["code"] == "against-mapped"]
    assert "the LoRA fold (alpha 16, rank 4)" in mapped["message"]
    # the other way round: the output held to the source, the same fold
    doc = recipe(out, src)
    assert doc["exit"] == 0 and not errors(doc), errors(doc)
    assert [p for p in doc["problems"] if p["code"] == "against-mapped"]
    # a folded weight changed: named, with the output's own tensor and file
    flip(out, "model.layers.0.self_attn.q_proj.weight")
    doc = recipe(src, out)
    (bad,) = errors(doc)
    assert (bad["code"], bad["location"]["tensor"]) == (
        "data-differs", "model.layers.0.self_attn.q_proj.weight")
    assert bad["location"]["file"] == "model.safetensors"
    assert "lora" in bad["message"] and "first at element 1" in bad["message"]
    # a weight the fold leaves as stored, changed: found in the streaming pass
    shutil.rmtree(out)
    ckpttool.merge(src, out)
    flip(out, "model.layers.0.mlp.up_proj.weight")
    (bad,) = errors(recipe(src, out))
    assert (bad["code"], bad["location"]["tensor"]) == (
        "data-differs", "base_model.model.model.layers.0.mlp.up_proj.weight")


def test_recipe_on_verl_lora_written_as_an_adapter(verl: Path, tmp_path: Path) -> None:
    src, out = verl / ACTOR, tmp_path / "adapter"
    ckpttool.merge(src, out, lora="adapter")
    doc = run("verify", src, "--against", out, "--json")
    assert doc.exit_code == 0, doc.output
    codes = [p["code"] for p in json.loads(doc.stdout)["problems"]]
    assert "against-mapped" in codes


def test_a_fold_whose_alpha_nothing_records_needs_it_again(tmp_path: Path) -> None:
    """accelerate's save_state records no alpha: the merge was given --lora-alpha, and so
    must verify be, to make the same fold (never guessed); without it, one coded error."""
    acc = lora_layouts.write_accelerate_lora(tmp_path / "acc")
    out = tmp_path / "fused"
    ckpttool.merge(acc / STEP, out, lora_alpha=16, weights_only=True)
    doc = recipe(acc / STEP, out)
    assert doc["exit"] == 1
    (bad,) = errors(doc)
    assert bad["code"] == "against-unmapped" and "--lora-alpha" in bad["message"]
    doc = recipe(acc / STEP, out, "--lora-alpha", "16")
    assert doc["exit"] == 0 and not errors(doc), errors(doc)
    # the wrong alpha: every target weight differs
    doc = recipe(acc / STEP, out, "--lora-alpha", "8")
    assert doc["exit"] == 1
    assert {p["code"] for p in errors(doc)} == {"data-differs"}


# --- name maps: Megatron's, implied; torchtitan's, with --names


@pytest.mark.parametrize("name", ["llama-tp2", "qwen3_moe-ep2"])
def test_recipe_on_default_megatron_merges(name: str, tmp_path: Path) -> None:
    src, out = MEGATRON / name, tmp_path / "out"
    r = run("merge", src, out)  # the config derived from Megatron-LM's args
    assert r.exit_code == 0, r.output
    doc = recipe(src, out)
    assert doc["exit"] == 0 and not errors(doc), errors(doc)
    assert any("megatron-" in p["message"] for p in doc["problems"]
               if p["code"] == "against-mapped")
    doc = recipe(out, src)  # the other way round
    assert doc["exit"] == 0 and not errors(doc), errors(doc)
    flip(out, "model.layers.1.self_attn.k_proj.weight")  # a part of a fused linear_qkv
    for doc in (recipe(src, out), recipe(out, src)):
        (bad,) = errors(doc)
        assert (bad["code"], bad["location"]["tensor"]) == (
            "data-differs", "model.layers.1.self_attn.k_proj.weight")
        assert bad["location"]["file"] == "model.safetensors"


def test_recipe_with_the_names_map_merge_was_given(tmp_path: Path) -> None:
    step = titan.write(tmp_path / "titan", "llama3")
    config = tmp_path / "hf"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(titan.hf_config("llama3")))
    out = tmp_path / "out"
    r = run("merge", step, out, "--names", "torchtitan-llama3", "--config", config)
    assert r.exit_code == 0, r.output
    doc = recipe(step, out, "--names", "torchtitan-llama3", "--config", config)
    assert doc["exit"] == 0 and not errors(doc), errors(doc)
    # without the map: the stored names, each one missing (what the names-not-hf warning
    # points at)
    doc = recipe(step, out, "--config", config)
    assert doc["exit"] == 1 and {p["code"] for p in errors(doc)} <= {
        "missing-tensor", "extra-tensor"}
    r = run("verify", step, "--names", "torchtitan-llama3")
    assert r.exit_code == 2 and "needs --against OTHER" in r.output

