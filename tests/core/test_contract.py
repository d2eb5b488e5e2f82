"""The output contract (:mod:`ckpttool.core.contract`): a merge ends by holding its planned
output against the model class config.json names (transformers, on the meta device), and
refuses, before writing anything, an output that model would not take whole.

Inputs are real: tiny transformers models, their state dicts written by torch's own DCP
writer (one process) or by ``save_pretrained``; hand-made changes only to break them (a
tensor left out, one saved transposed)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.core import contract
from ckpttool.core.runtime import forked

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def _llama(tie: bool) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                      tie_word_embeddings=tie, architectures=["LlamaForCausalLM"])
    return LlamaForCausalLM(cfg)


def _save(state: dict[str, torch.Tensor], config: Any, path: Path) -> Path:
    """``state`` written by torch's DCP writer into ``path``, config.json beside it."""
    torch_dcp.save({k: v.contiguous() for k, v in state.items()}, checkpoint_id=path)
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model = _llama(tie=False)
    return model, tmp_path_factory.mktemp("contract-llama")


def _variant(llama: tuple[Any, Path], name: str, change: Any = None) -> Path:
    model, root = llama
    state = dict(model.state_dict())
    if change is not None:
        change(state)
    path = root / name
    if not path.exists():
        _save(state, model.config, path)
    return path


def test_a_whole_model_is_checked_and_published(llama: tuple[Any, Path], tmp_path: Path
                                                 ) -> None:
    src = _variant(llama, "good")
    r = run("merge", src, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["contract"]
    assert doc["checked"] is True and doc["loader"] == "transformers"
    assert doc["consumer"].startswith("LlamaForCausalLM (transformers ")
    assert doc["missing"] == [] and doc["misshapen"] == [] and doc["extra"] == []
    assert doc["expected"] == len(llama[0].state_dict())
    human = run("merge", src, tmp_path / "out2")
    assert "contract: LlamaForCausalLM (transformers" in human.stdout
    assert "takes it whole (21 tensors)" in human.stdout


def test_a_missing_tensor_is_exit_3_and_nothing_is_written(llama: tuple[Any, Path],
                                                            tmp_path: Path) -> None:
    src = _variant(llama, "missing", lambda s: s.pop("model.norm.weight"))
    out = tmp_path / "out"
    r = run("merge", src, out)
    assert r.exit_code == 3, r.output
    assert (f"{out}: 'model.norm.weight' is missing, which LlamaForCausalLM (transformers "
            in r.stderr)
    assert "nothing was written" in r.stderr and "Traceback" not in r.output
    assert not out.exists()
    with pytest.raises(ckpttool.InputError, match="'model.norm.weight' is missing"):
        ckpttool.merge(src, out, dry_run=True)


def test_a_misshapen_tensor_is_exit_3(llama: tuple[Any, Path], tmp_path: Path) -> None:
    def transpose(s: dict[str, torch.Tensor]) -> None:
        key = "model.layers.0.self_attn.k_proj.weight"
        s[key] = s[key].t().contiguous()

    src = _variant(llama, "shape", transpose)
    r = run("merge", src, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert ("'model.layers.0.self_attn.k_proj.weight' has shape [32, 16], where "
            "LlamaForCausalLM (transformers" in r.stderr)
    assert "expects [16, 32]" in r.stderr
    assert not (tmp_path / "out").exists()


def test_an_extra_tensor_is_a_warning(llama: tuple[Any, Path], tmp_path: Path) -> None:
    src = _variant(llama, "extra", lambda s: s.update({"model.extra.weight": torch.ones(3)}))
    r = run("merge", src, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["contract"]["extra"] == ["model.extra.weight"]
    assert any("does not take, e.g. 'model.extra.weight'" in w for w in doc["warnings"])


def test_an_untied_model_needs_its_head(llama: tuple[Any, Path], tmp_path: Path) -> None:
    """tie_word_embeddings false and no lm_head: the head would be random."""
    src = _variant(llama, "headless", lambda s: s.pop("lm_head.weight"))
    r = run("merge", src, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert "'lm_head.weight' is missing" in r.stderr


def test_a_tied_model_may_leave_its_head_out(tmp_path: Path) -> None:
    model = _llama(tie=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    src = _save(state, model.config, tmp_path / "tied")
    report = ckpttool.merge(src, tmp_path / "out")
    assert report.contract is not None and report.contract.checked and report.contract.ok


def test_no_config_is_exit_3_naming_both_ways(llama: tuple[Any, Path], tmp_path: Path
                                              ) -> None:
    model, _ = llama
    src = tmp_path / "ckpt"
    torch_dcp.save(dict(model.state_dict()), checkpoint_id=src)
    out = tmp_path / "out"
    r = run("merge", src, out)
    assert r.exit_code == 3, r.output
    assert (f"Pass the model's config.json: ckpttool merge {src} {out} --config "
            "path/to/config.json, or ask for weights only: ckpttool merge "
            f"{src} {out} --weights-only") in r.stderr
    assert not out.exists()
    r = run("merge", src, out, "--weights-only", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["contract"]
    assert doc == {**doc, "checked": False, "reason": "--weights-only"}
    assert (out / "model.safetensors").exists()


def test_weights_only_writes_a_broken_model_without_the_promise(
        llama: tuple[Any, Path], tmp_path: Path) -> None:
    src = _variant(llama, "missing", lambda s: s.pop("model.norm.weight"))
    report = ckpttool.merge(src, tmp_path / "out", weights_only=True)
    assert report.contract is not None and not report.contract.checked


def test_without_transformers_the_report_says_not_checked(
        llama: tuple[Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _variant(llama, "good")
    contract._expected_cached.cache_clear()
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    r = run("merge", src, tmp_path / "out", "--json")
    contract._expected_cached.cache_clear()
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["contract"]["checked"] is False
    assert doc["contract"]["hint"] == "pip install transformers"
    assert "transformers (with torch) is not installed here" in doc["contract"]["reason"]
    assert any("not checked against its consumer" in w and "pip install transformers" in w
               for w in doc["warnings"])


# --- the consumer kept on disk: a later merge with the same config imports nothing


_MERGE_AND_IMPORTS = (
    "import sys, json, ckpttool\n"
    "r = ckpttool.merge(sys.argv[1], sys.argv[2])\n"
    "print(json.dumps({'ok': r.contract.ok, 'checked': r.contract.checked,\n"
    "                  'consumer': r.contract.consumer,\n"
    "                  'imported': sorted(m for m in ('torch', 'transformers')\n"
    "                                     if m in sys.modules)}))\n")


def _process(cache: Path, *args: str | Path) -> Any:
    """``python *args`` in a process whose cache directory is ``cache``, running this
    checkout's ckpttool."""
    import os
    import subprocess

    root = str(Path(__file__).parents[2])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache),
           "PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root}
    return subprocess.run([sys.executable, "-W", "ignore", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)


def _merge_in_a_process(src: Path, out: Path, cache: Path) -> dict[str, Any]:
    done = _process(cache, "-c", _MERGE_AND_IMPORTS, src, out)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_a_second_merge_with_the_same_config_imports_neither_torch_nor_transformers(
        llama: tuple[Any, Path], tmp_path: Path) -> None:
    src = _variant(llama, "good")
    first = _merge_in_a_process(src, tmp_path / "a", tmp_path / "cache")
    assert first["ok"] and first["checked"] and "transformers" in first["imported"]
    (entry,) = (tmp_path / "cache" / "ckpttool" / "contract").glob("*.json")
    second = _merge_in_a_process(src, tmp_path / "b", tmp_path / "cache")
    assert second == {**first, "imported": []}
    # a broken model is still refused from the kept entry
    broken = _variant(llama, "missing", lambda s: s.pop("model.norm.weight"))
    r = _process(tmp_path / "cache", "-m", "ckpttool", "merge", broken, tmp_path / "c")
    assert r.returncode == 3 and "'model.norm.weight' is missing" in r.stderr
    # an entry that does not read as one is built again and rewritten
    entry.write_text('{"schema": 1, "consumer": 3}')
    again = _merge_in_a_process(src, tmp_path / "d", tmp_path / "cache")
    assert again == first
    assert json.loads(entry.read_text())["consumer"] == first["consumer"]


def test_the_kept_consumer_is_keyed_by_versions_and_never_used_without_the_package(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpttool.core import contract_cache

    config = json.dumps({"model_type": "llama"})
    here = contract_cache.key("transformers", config, ("transformers", "torch"))
    assert here is not None
    monkeypatch.setattr(contract_cache, "versions",
                        lambda packages: {p: "0.0.1" for p in packages})
    assert contract_cache.key("transformers", config, ("transformers", "torch")) != here
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "transformers", None)  # blocked: as not installed
    assert contract_cache.key("transformers", config, ("transformers", "torch")) is None


# --- mixture of experts and vision-language models: as transformers converts them on load


def _mixtral() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                        num_local_experts=4, num_experts_per_tok=2,
                        architectures=["MixtralForCausalLM"])
    return MixtralForCausalLM(cfg)


def test_moe_runtime_layout_is_checked_in_the_hub_layout(tmp_path: Path) -> None:
    model = _mixtral()
    src = _save(dict(model.state_dict()), model.config, tmp_path / "moe")
    report = ckpttool.merge(src, tmp_path / "out")
    assert report.layout is not None  # written per expert, as save_pretrained does
    assert report.contract is not None and report.contract.checked and report.contract.ok


def test_moe_expert_missing_is_exit_3(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = _mixtral()
    model.save_pretrained(tmp_path / "hub")
    state = load_file(tmp_path / "hub" / "model.safetensors")
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    assert gone in state
    del state[gone]
    save_file(state, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    r = run("merge", tmp_path / "hub", tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert f"'{gone}' is missing, which MixtralForCausalLM" in r.stderr


def _llava() -> Any:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(0)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, image_size=16, patch_size=8,
                              projection_dim=16)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=95,
                      architectures=["LlavaForConditionalGeneration"])
    return LlavaForConditionalGeneration(cfg)


def test_vlm_prefixes_are_checked_as_transformers_loads_them(tmp_path: Path) -> None:
    model = _llava()
    state = dict(model.state_dict())
    src = _save(state, model.config, tmp_path / "vlm")
    report = ckpttool.merge(src, tmp_path / "out")
    assert report.contract is not None and report.contract.ok, report.contract
    written = {n for f in report.files for n in [f.name]}
    assert "model.safetensors" in written
    # one tower tensor left out: named under the prefix the merge writes
    tower = next(k for k in state if k.startswith("model.vision_tower."))
    broken = {k: v for k, v in state.items() if k != tower}
    src = _save(broken, model.config, tmp_path / "vlm-broken")
    with pytest.raises(ckpttool.InputError, match="is missing, which "
                       "LlavaForConditionalGeneration"):
        ckpttool.merge(src, tmp_path / "out2")


# --- the check itself


def test_the_check_reads_names_and_shapes_only() -> None:
    """Pure: planned names and shapes against the model; a 70B-parameter config costs no
    memory (meta device)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                      architectures=["LlamaForCausalLM"]).to_dict()
    exp = contract.expected(cfg)
    assert sum(torch.Size(s).numel() for s in exp.tensors.values()) > 68e9
    result = contract.check(dict(exp.tensors), cfg)
    assert result.ok and result.expected == len(exp.tensors)


def test_transformers_private_attributes_are_where_the_check_reads_them() -> None:
    """The one place upstream internals are read (ckpttool.core.contract): an upgrade that
    moves them fails here, loudly."""
    model = _llama(tie=True)
    assert model.all_tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    assert hasattr(model, "_keys_to_ignore_on_load_missing")
    assert hasattr(model, "_keys_to_ignore_on_load_unexpected")


def test_an_unknown_loader_is_named() -> None:
    with pytest.raises(ckpttool.InputError, match="unknown loader 'vllm'; choose one of "
                       "transformers"):
        contract.expected({"model_type": "llama"}, loader="vllm")


def test_an_unknown_model_type_is_not_checked_and_says_why() -> None:
    result = contract.check({"a": (1,)}, {"model_type": "no-such-model"})
    assert not result.checked and result.reason is not None
    assert "does not know model_type 'no-such-model'" in result.reason


# --- reshard: a DCP to resume from, as accelerate's load_fsdp_model reads it


def _accelerate_load(model: Any, path: Path) -> dict[str, torch.Tensor]:
    """accelerate's load_fsdp_model (SHARDED_STATE_DICT, use_dcp): dcp.load of
    ``{"model": get_model_state_dict(model)}`` with the default planner."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {"model": get_model_state_dict(model)}
    torch_dcp.load(state_dict=state, storage_reader=torch_dcp.FileSystemReader(path),
                   planner=DefaultLoadPlanner())
    return state["model"]


@pytest.mark.parametrize("tie", [True, False])
def test_the_resume_recipe_loads_with_accelerates_call(tie: bool, tmp_path: Path) -> None:
    model = _llama(tie=tie)
    model.save_pretrained(tmp_path / "merged")  # a tied head is not saved
    out = tmp_path / "resume" / "pytorch_model_fsdp_0"
    r = run("reshard", tmp_path / "merged", out, "--to", "dcp", "--prefix", "model")
    assert r.exit_code == 0, r.output
    assert "contract: dcp.load of LlamaForCausalLM" in r.stdout
    if tie:
        assert "tied copies written again (the model's state dict holds them): lm_head.weight" \
            in r.stdout
    fresh = _llama(tie=tie)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    loaded = _accelerate_load(fresh, out)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded[name], value), name


def test_reshard_refuses_a_dcp_its_model_cannot_resume_from(llama: tuple[Any, Path],
                                                            tmp_path: Path) -> None:
    model, _ = llama
    model.save_pretrained(tmp_path / "merged")
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "merged" / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, tmp_path / "merged" / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "resume" / "pytorch_model_fsdp_0"
    r = run("reshard", tmp_path / "merged", out, "--to", "dcp", "--prefix", "model")
    assert r.exit_code == 3, r.output
    assert f"{out}: 'model.model.norm.weight' is missing, which dcp.load of " in r.stderr
    assert not out.exists()


# --- verify PATH --loader transformers


def test_verify_loader_takes_a_whole_model_directory(llama: tuple[Any, Path],
                                                     tmp_path: Path) -> None:
    llama[0].save_pretrained(tmp_path / "hf")
    r = run("verify", tmp_path / "hf", "--loader", "transformers", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert "contract" in doc["checks"]
    assert not [p for p in doc["problems"] if p["code"].startswith("contract-")]


def test_verify_loader_codes_each_problem(llama: tuple[Any, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    llama[0].save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    state = load_file(weights)
    del state["model.norm.weight"]
    key = "model.layers.1.self_attn.k_proj.weight"
    state[key] = state[key].t().contiguous()
    state["model.stray.weight"] = torch.zeros(2)
    save_file(state, weights, metadata={"format": "pt"})
    r = run("verify", tmp_path / "hf", "--loader", "transformers", "--json")
    assert r.exit_code == 1, r.output
    found = {(p["code"], p["severity"], p["location"].get("tensor"))
             for p in json.loads(r.stdout)["problems"] if p["code"].startswith("contract-")}
    assert found == {("contract-missing", "error", "model.norm.weight"),
                     ("contract-shape", "error", key),
                     ("contract-extra", "warning", "model.stray.weight")}
    # without --loader, the bytes are intact: nothing of the sort
    assert run("verify", tmp_path / "hf").exit_code == 0


def test_verify_loader_needs_a_config_and_a_known_loader(llama: tuple[Any, Path],
                                                         tmp_path: Path) -> None:
    llama[0].save_pretrained(tmp_path / "hf")
    r = run("verify", tmp_path / "hf", "--loader", "vllm")
    assert r.exit_code == 2, r.output
    assert "unknown loader 'vllm'; choose one of transformers" in r.stderr
    (tmp_path / "hf" / "config.json").unlink()
    r = run("verify", tmp_path / "hf", "--loader", "transformers")
    assert r.exit_code == 3, r.output
    assert "no config.json beside it names the model --loader transformers would build; " \
        "pass it with --config" in r.stderr


def test_verify_loader_without_transformers_is_exit_4(
        llama: tuple[Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llama[0].save_pretrained(tmp_path / "hf")
    contract._expected_cached.cache_clear()
    monkeypatch.setitem(sys.modules, "transformers", None)
    r = run("verify", tmp_path / "hf", "--loader", "transformers")
    contract._expected_cached.cache_clear()
    assert r.exit_code == 4, r.output
    assert "install it: pip install transformers" in r.stderr


# --- a model in each format its own writer can write in one process: the merge takes it whole


def _write_dcp(model: Any, out: Path) -> Path:
    torch_dcp.save(dict(model.state_dict()), checkpoint_id=out)
    return out


def _write_hf_storage(model: Any, out: Path) -> Path:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    torch_dcp.save(dict(model.state_dict()), storage_writer=HuggingFaceStorageWriter(str(out)))
    return out


def _write_safetensors(model: Any, out: Path) -> Path:
    model.save_pretrained(out)
    (out / "config.json").unlink()  # put back by the test: the same for every format
    return out


def _write_safetensors_sharded(model: Any, out: Path) -> Path:
    model.save_pretrained(out, max_shard_size="20KB")
    (out / "config.json").unlink()
    return out


def _write_bin_sharded(model: Any, out: Path) -> Path:
    model.save_pretrained(out, max_shard_size="20KB", safe_serialization=False)
    (out / "config.json").unlink()
    return out


def _write_torch_save(model: Any, out: Path) -> Path:
    out.mkdir(parents=True)
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


@pytest.mark.parametrize("write", [_write_dcp, _write_hf_storage, _write_safetensors,
                                   _write_safetensors_sharded, _write_bin_sharded,
                                   _write_torch_save], ids=lambda f: f.__name__[7:])
def test_a_model_in_every_format_holds_its_contract(write: Any, tmp_path: Path) -> None:
    model = _llama(tie=False)  # HuggingFaceStorageWriter refuses tensors that share memory
    src = write(model, tmp_path / "src")
    model.config.save_pretrained(src)
    report = ckpttool.merge(src, tmp_path / "out")
    assert report.contract is not None and report.contract.checked, report.contract
    assert report.contract.ok and not report.contract.extra, report.contract
    missing = tmp_path / "broken"
    write(_without(model, "model.layers.1.mlp.down_proj.weight"), missing)
    model.config.save_pretrained(missing)
    with pytest.raises(ckpttool.InputError, match="'model.layers.1.mlp.down_proj.weight' is "
                       "missing"):
        ckpttool.merge(missing, tmp_path / "out2")


def _without(model: Any, name: str) -> Any:
    """``model`` with one parameter gone from its state dict (its module's weight set to
    None), as a writer would save a model that lost it."""
    module_name, _, attr = name.rpartition(".")
    clone = _llama(tie=False)
    clone.load_state_dict(model.state_dict())
    setattr(clone.get_submodule(module_name), attr, None)
    return clone


# --- verify SRC --against OUT through the layout merge wrote (hub: experts split, prefixes)


@pytest.mark.parametrize("family", ["mixtral", "llava"])
def test_verify_against_holds_a_merge_to_its_source_through_the_hub_layout(
        family: str, tmp_path: Path) -> None:
    model = _mixtral() if family == "mixtral" else _llava()
    src = _save(dict(model.state_dict()), model.config, tmp_path / "src")
    out = tmp_path / "out"
    report = ckpttool.merge(src, out)
    assert report.layout is not None  # names (and fused experts) changed on the way
    r = run("verify", src, "--against", out, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert not [p for p in doc["problems"] if p["severity"] == "error"], doc["problems"]
    if family != "mixtral":
        return
    # one expert's bytes changed in the output: named, in the output's own tensor
    from safetensors.torch import load_file, save_file

    state = load_file(out / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    state[name] = state[name].clone()
    state[name][0, 1] += 1
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    r = run("verify", src, "--against", out, "--json")
    assert r.exit_code == 1, r.output
    (bad,) = [p for p in json.loads(r.stdout)["problems"] if p["severity"] == "error"]
    assert bad["code"] == "data-differs"
    assert bad["location"]["tensor"] == "model.layers.1.mlp.experts.down_proj"
    assert "first at element" in bad["message"]


# --- DoRA: the adapter written as PEFT writes it; the fold refused (exit 4); verify a note


def test_dora_adapter_is_written_as_peft_writes_it(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    peft = get_peft_model(_llama(tie=False), LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_dora=True))
    with torch.no_grad():  # as if trained: B and the magnitudes away from their init
        for name, p in peft.named_parameters():
            if "lora_B" in name or "magnitude" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    src = tmp_path / "ckpt"
    torch_dcp.save(dict(peft.state_dict()), checkpoint_id=src)
    peft.peft_config["default"].save_pretrained(str(src))
    peft.save_pretrained(tmp_path / "peft")  # the reference: PEFT's own adapter
    r = run("merge", src, tmp_path / "out", "--lora", "adapter")
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "out" / "adapter_model.safetensors")
    want = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert got.keys() == want.keys()
    assert any(k.endswith("lora_magnitude_vector") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)
    r = run("merge", src, tmp_path / "fused", "--lora", "fuse")
    assert r.exit_code == 4 and "does not fold DoRA adapters yet" in r.stderr
    r = run("verify", src, "--json")
    assert r.exit_code == 0, r.output
    notes = [p for p in json.loads(r.stdout)["problems"] if p["code"] == "lora-dora"]
    assert notes and {p["severity"] for p in notes} == {"info"}


def test_reshard_to_safetensors_holds_the_contract_too(llama: tuple[Any, Path],
                                                       tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    llama[0].save_pretrained(tmp_path / "hf")
    report = ckpttool.reshard(tmp_path / "hf", tmp_path / "resplit", to="safetensors",
                              max_shard_size="20KB")
    assert report.contract is not None and report.contract.checked and report.contract.ok
    weights = tmp_path / "hf" / "model.safetensors"
    state = load_file(weights)
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ckpttool.InputError, match="'model.layers.0.mlp.up_proj.weight' is "
                       "missing, which LlamaForCausalLM"):
        ckpttool.reshard(tmp_path / "hf", tmp_path / "again", to="safetensors")
    assert not (tmp_path / "again").exists()


def test_tensors_transformers_ignores_on_load_are_no_warning(llama: tuple[Any, Path]) -> None:
    """Old checkpoints' per-layer rotary buffers: transformers drops them on load without a
    word, so the check lists them as ignored, not extra."""
    config = llama[0].config.to_dict()
    planned = {n: tuple(t.shape) for n, t in llama[0].state_dict().items()}
    planned["model.layers.0.self_attn.rotary_emb.inv_freq"] = (4,)
    result = contract.check(planned, config)
    assert result.ok and result.extra == []
    assert result.ignored == ["model.layers.0.self_attn.rotary_emb.inv_freq"]


def test_a_quantized_model_is_held_to_its_quantized_layout() -> None:
    """config.json's quantization_config: the scales are the quantized module's own (not
    extra), MXFP4's blocks and scales stand for the weight they make (not missing)."""
    config = _llama(tie=False).config.to_dict()
    model = contract.expected(config)
    planned = dict(model.tensors)
    fp8 = {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                             "weight_block_size": [128, 128]}}
    with_scales = {**planned, **{n + "_scale_inv": (1, 1) for n in planned
                                 if n.endswith("proj.weight")}}
    got = contract.check(with_scales, fp8)
    assert got.checked and not got.missing and not got.misshapen and not got.extra
    plain = contract.check(with_scales, config)
    assert plain.extra  # unquantized config: transformers would drop the scales
    mx = {**config, "quantization_config": {"quant_method": "mxfp4"}}
    name = next(n for n in planned if n.endswith("down_proj.weight"))
    blocked = {n: s for n, s in planned.items() if n != name}
    blocked |= {name + "_blocks": (4, 2, 16), name + "_scales": (4, 2)}
    got = contract.check(blocked, mx)
    assert not got.missing and not got.misshapen and not got.extra


def test_a_first_run_checks_beside_the_streaming_and_publishes_nothing_when_broken(
        llama: tuple[Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the check builds the class (no entry kept for the config), it runs in a thread
    beside the streaming and is joined before publishing: the same result, the same exit 3
    with nothing left behind, and no build where the entry is kept."""
    src = _variant(llama, "good")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    contract._expected_cached.cache_clear()
    started: list[object] = []
    real = contract.Beside

    def beside(fn: Any) -> Any:
        started.append(fn)
        return real(fn)

    monkeypatch.setattr(contract, "Beside", beside)
    config = json.loads((src / "config.json").read_text())
    assert contract.built_here(config) and not contract.built_here(None)
    report = ckpttool.merge(src, tmp_path / "a")
    assert len(started) == 1 and report.contract.checked and not report.contract.missing
    assert not contract.built_here(config)
    ckpttool.merge(src, tmp_path / "b")  # kept: checked first, no thread
    assert len(started) == 1
    broken = _variant(llama, "missing", lambda s: s.pop("model.norm.weight"))
    r = _process(tmp_path / "cache-2", "-m", "ckpttool", "merge", broken, tmp_path / "c")
    assert r.returncode == 3 and "'model.norm.weight' is missing" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "c").exists()


def test_beside_returns_or_raises_in_the_joining_thread() -> None:
    assert contract.Beside(lambda: 3).join() == 3
    # While it imports, the merge forks no share (a child forked while the thread holds an
    # import lock would wait for ever); after, forking is as the settings say.
    allowed = forked.available()
    go = threading.Event()
    importing = contract.Beside(lambda: go.wait(10))
    assert not forked.available()
    go.set()
    assert importing.join()
    assert forked.available() == allowed

    def broken() -> int:
        raise ckpttool.InputError("no")

    pending = contract.Beside(broken)
    for _ in range(2):
        with pytest.raises(ckpttool.InputError, match="no"):
            pending.join()
