"""LoRA (PEFT) checkpoints trained under FSDP2 and saved with ``dcp.save``
(:mod:`tests.lora_layouts`): fused and exported adapters against PEFT itself, and the errors.

Tolerance: none. The models are fp32, ckpttool folds ``W + transpose(B @ A) * scale`` in PEFT's
own order in fp32, so fused weights equal ``merge_and_unload()``'s to the bit and the logits
are identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import ckpttool
from ckpttool.errors import InputError, UnsupportedError
from tests.lora_layouts import MODEL_DIR, VARIANTS, batch, build_base, reference

pytestmark = pytest.mark.filterwarnings("ignore")


def logits(model: torch.nn.Module) -> torch.Tensor:
    _, ids = batch()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest, lora_ckpts: Path) -> Path:
    return lora_ckpts / request.param


@pytest.fixture(scope="module")
def peft_merged(variant: Path) -> dict[str, torch.Tensor]:
    """PEFT's own merge_and_unload() of the trained model, state dict."""
    return {k: v.clone() for k, v in reference(variant).merge_and_unload().state_dict().items()}


def test_fuse_equals_merge_and_unload(variant: Path, peft_merged: dict[str, torch.Tensor],
                                      tmp_path: Path) -> None:
    report = ckpttool.merge(variant, tmp_path / "out")
    assert report.lora is not None and report.lora.mode == "fuse"
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(peft_merged)
    for name, want in peft_merged.items():
        assert torch.equal(got[name], want), name
    # The adapter trained: folding it changed the targeted weights.
    base = build_base(variant.name).state_dict()
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])


def test_fused_model_gives_peft_merged_logits(variant: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ckpttool.merge(variant, tmp_path / "out")
    fused = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(logits(fused), logits(reference(variant).merge_and_unload()))


def test_adapter_loads_in_peft_with_trained_logits(variant: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    report = ckpttool.merge(variant / MODEL_DIR, tmp_path / "adapter", lora="adapter")
    assert report.lora is not None and report.lora.mode == "adapter"
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(build_base(variant.name), tmp_path / "adapter").eval()
    assert torch.equal(logits(loaded), logits(reference(variant)))


def test_adapter_file_is_what_save_pretrained_writes(variant: Path, tmp_path: Path) -> None:
    reference(variant).save_pretrained(tmp_path / "peft")
    ckpttool.merge(variant, tmp_path / "ours", lora="adapter")
    want = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    got = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    with safe_open(tmp_path / "ours" / "adapter_model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_adapter_into_full_base_equals_dcp_fuse(variant: Path, tmp_path: Path) -> None:
    """--adapter: PEFT's saved adapter folded into the base model's safetensors gives the same
    fused weights as the fuse of the DCP checkpoint."""
    build_base(variant.name).save_pretrained(tmp_path / "base")
    reference(variant).save_pretrained(tmp_path / "adapter")
    ckpttool.merge(variant, tmp_path / "from-dcp")
    report = ckpttool.merge(tmp_path / "base", tmp_path / "from-base",
                            adapter=tmp_path / "adapter")
    assert report.lora is not None and report.lora.fused > 0
    want = load_file(tmp_path / "from-dcp" / "model.safetensors")
    got = load_file(tmp_path / "from-base" / "model.safetensors")
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_fuse_casts_by_the_dtype_policy(lora_ckpts: Path,
                                        tmp_path: Path) -> None:
    variant = lora_ckpts / "lora"
    ckpttool.merge(variant, tmp_path / "bf16", dtype="bf16")
    got = load_file(tmp_path / "bf16" / "model.safetensors")
    want = reference(variant).merge_and_unload().state_dict()
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name


# --------------------------------------------------------------------------------------------
# Errors


def copy_variant(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("full.pt"))
    return dst


def test_missing_alpha_is_an_error_saying_where_to_put_it(lora_ckpts: Path,
                                                          tmp_path: Path) -> None:
    ckpt = copy_variant(lora_ckpts / "lora", tmp_path / "ckpt")
    (ckpt / "adapter_config.json").unlink()
    with pytest.raises(InputError, match="no adapter_config.json .*was found beside it.*"
                       "--adapter-config PATH"):
        ckpttool.merge(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    config = json.loads((lora_ckpts / "lora" / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="'lora_alpha' is None; it must be a positive number"):
        ckpttool.merge(ckpt, tmp_path / "out", adapter_config=tmp_path / "cfg.json")


def test_wrong_rank_in_config_is_an_error(lora_ckpts: Path, tmp_path: Path) -> None:
    ckpt = copy_variant(lora_ckpts / "lora", tmp_path / "ckpt")
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config["rank_pattern"] = {}
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"o_proj': the adapter has rank 2 but .* says r=4"):
        ckpttool.merge(ckpt, tmp_path / "out")


def test_lora_mode_on_a_plain_checkpoint_is_an_error(uneven_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="holds no LoRA adapter"):
        ckpttool.merge(uneven_ckpt, tmp_path / "out", lora="fuse")


def test_adapter_alone_cannot_be_fused(lora_ckpts: Path, tmp_path: Path) -> None:
    reference(lora_ckpts / "rslora").save_pretrained(tmp_path / "adapter")
    with pytest.raises(InputError, match="holds the LoRA adapter alone.*--lora adapter"):
        ckpttool.merge(tmp_path / "adapter" / "adapter_model.safetensors", tmp_path / "out",
                       lora="fuse")
    # Without --lora, an adapter alone is re-exported as an adapter.
    report = ckpttool.merge(tmp_path / "adapter" / "adapter_model.safetensors",
                            tmp_path / "out")
    assert report.lora is not None and report.lora.mode == "adapter"


def test_adapter_for_another_model_is_a_shape_error(lora_ckpts: Path, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    reference(lora_ckpts / "rslora").save_pretrained(tmp_path / "adapter")
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, attention_bias=True)
                     ).save_pretrained(tmp_path / "other")
    with pytest.raises(InputError, match=r"q_proj': base weight \[16, 16\] does not match "
                       r"lora_B @ lora_A \[32, 32\]"):
        ckpttool.merge(tmp_path / "other", tmp_path / "out", adapter=tmp_path / "adapter")
    assert not (tmp_path / "out").exists()


def _edit_adapter(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    dst.mkdir()
    shutil.copy(src / "adapter_config.json", dst)
    tensors = load_file(src / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    return dst


def test_lora_a_without_b_is_an_error(lora_ckpts: Path, tmp_path: Path) -> None:
    reference(lora_ckpts / "rslora").save_pretrained(tmp_path / "adapter")
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    broken = _edit_adapter(tmp_path / "adapter", tmp_path / "broken",
                           lambda t: t.pop(name))
    build_base("rslora").save_pretrained(tmp_path / "base")
    with pytest.raises(InputError, match="layers.1.self_attn.v_proj': has lora_A but no lora_B"):
        ckpttool.merge(tmp_path / "base", tmp_path / "out", adapter=broken)


def test_dora_is_refused_with_exit_4(lora_ckpts: Path, tmp_path: Path) -> None:
    reference(lora_ckpts / "rslora").save_pretrained(tmp_path / "adapter")
    dora = _edit_adapter(
        tmp_path / "adapter", tmp_path / "dora",
        lambda t: t.__setitem__(
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
            torch.ones(32)))
    build_base("rslora").save_pretrained(tmp_path / "base")
    with pytest.raises(UnsupportedError, match="DoRA"):
        ckpttool.merge(tmp_path / "base", tmp_path / "out", adapter=dora)


# --------------------------------------------------------------------------------------------
# inspect and verify


def test_inspect_shows_the_adapter(lora_ckpts: Path) -> None:
    report = ckpttool.inspect(lora_ckpts / "lora")
    lo = report.summary.lora
    assert lo is not None
    assert lo.rank == [2, 4] and lo.alpha == 8 and lo.variant == "lora"
    assert lo.alpha_pattern == {"v_proj": 24} and lo.modules_to_save == ["lm_head.weight"]
    assert "q_proj" in lo.targets and "embed_tokens" in lo.targets
    # What a default merge writes: the base model's tensors, not the adapter's.
    base = build_base("lora").state_dict()
    assert report.summary.merged.bytes == sum(t.numel() * 4 for t in base.values())
    rs = ckpttool.inspect(lora_ckpts / "rslora").summary.lora
    assert rs is not None and rs.variant == "rslora" and rs.rank == 8


def test_verify_passes_a_trained_adapter(variant: Path) -> None:
    report = ckpttool.verify(variant)
    assert report.ok and "lora" in report.checks, report.problems
    assert not [p for p in report.problems if p.code.startswith("lora")]


def test_verify_warns_of_an_adapter_that_never_trained(lora_ckpts: Path,
                                                       tmp_path: Path) -> None:
    from tests.lora_layouts import build

    build("rslora").save_pretrained(tmp_path / "untrained")
    report = ckpttool.verify(tmp_path / "untrained" / "adapter_model.safetensors")
    assert report.ok
    untrained = [p for p in report.problems if p.code == "lora-untrained"]
    assert len(untrained) == 1 and "never trained" in untrained[0].message
    assert {p.code for p in report.problems} == {"lora-untrained", "all-zero"}


def test_verify_without_alpha_warns(lora_ckpts: Path, tmp_path: Path) -> None:
    """The checkpoint is whole (trainers such as accelerate's save_state record no alpha):
    a warning that folding needs it, not a failed verify."""
    ckpt = copy_variant(lora_ckpts / "rslora", tmp_path / "ckpt")
    (ckpt / "adapter_config.json").unlink()
    report = ckpttool.verify(ckpt)
    assert report.ok
    assert "lora-no-alpha" in [p.code for p in report.problems if p.severity == "warning"]
    ok = ckpttool.verify(ckpt, adapter_config=lora_ckpts / "rslora" / "adapter_config.json")
    assert ok.ok, ok.problems


# --------------------------------------------------------------------------------------------
# CLI


def cli(*args: str | Path):  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from ckpttool.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_fuse_and_adapter_reports(lora_ckpts: Path, tmp_path: Path) -> None:
    r = cli("merge", lora_ckpts / "lora", tmp_path / "fused")
    assert r.exit_code == 0, r.output
    assert "LoRA adapter: rank 2/4, alpha 8, lora, 15 modules" in r.stdout
    assert "folded into 15 tensors" in r.stdout
    assert "(the adapter alone instead: --lora adapter)" in r.stdout
    r = cli("merge", lora_ckpts / "lora", tmp_path / "adapter", "--lora", "adapter", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["lora"]["mode"] == "adapter"
    assert [f["name"] for f in doc["files"]] == ["adapter_model.safetensors"]
    assert "adapter_config.json" in doc["copied"]


def test_cli_errors_exit_codes(lora_ckpts: Path, tmp_path: Path) -> None:
    r = cli("merge", lora_ckpts / "lora", tmp_path / "out", "--lora", "merge")
    assert r.exit_code == 2 and "'merge' is not one of: fuse, adapter" in r.output
    ckpt = copy_variant(lora_ckpts / "rslora", tmp_path / "ckpt")
    (ckpt / "adapter_config.json").unlink()
    r = cli("merge", ckpt, tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr.count("\n") == 1 and "lora_alpha cannot be read" in r.stderr
    assert "Traceback" not in r.output and not (tmp_path / "out").exists()
    reference(lora_ckpts / "rslora").save_pretrained(tmp_path / "adapter")
    build_base("rslora").save_pretrained(tmp_path / "base")
    dora = _edit_adapter(
        tmp_path / "adapter", tmp_path / "dora",
        lambda t: t.__setitem__(
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
            torch.ones(32)))
    r = cli("merge", tmp_path / "base", tmp_path / "out", "--adapter", dora)
    assert r.exit_code == 4 and "DoRA" in r.stderr
    r = cli("verify", ckpt)
    assert r.exit_code == 0 and "warning: lora-no-alpha" in r.output


def test_fan_in_fan_out_adapter_on_gpt2(tmp_path: Path) -> None:
    """GPT-2's Conv1D stores weights [in, out] (fan_in_fan_out): the fold is transposed."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    base = GPT2LMHeadModel(config)
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=6, fan_in_fan_out=True,
                                            target_modules=["c_attn", "c_fc"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    model.save_pretrained(tmp_path / "adapter")
    ckpttool.merge(tmp_path / "base", tmp_path / "out", adapter=tmp_path / "adapter")
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = model.merge_and_unload().state_dict()
    assert set(got) <= set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    before = load_file(tmp_path / "base" / "model.safetensors")
    assert not torch.equal(got["transformer.h.0.attn.c_attn.weight"],
                           before["transformer.h.0.attn.c_attn.weight"])


def test_cli_adapter_errors_exit_3_one_line(lora_ckpts: Path, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    reference(lora_ckpts / "rslora").save_pretrained(tmp_path / "adapter")
    build_base("rslora").save_pretrained(tmp_path / "base")
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    unpaired = _edit_adapter(tmp_path / "adapter", tmp_path / "unpaired", lambda t: t.pop(name))
    r = cli("merge", tmp_path / "base", tmp_path / "out", "--adapter", unpaired)
    assert r.exit_code == 3 and r.stderr.count("\n") == 1
    assert "layers.1.self_attn.v_proj': has lora_A but no lora_B" in r.stderr
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, attention_bias=True)
                     ).save_pretrained(tmp_path / "other")
    r = cli("merge", tmp_path / "other", tmp_path / "out", "--adapter", tmp_path / "adapter")
    assert r.exit_code == 3 and r.stderr.count("\n") == 1
    assert "does not match lora_B @ lora_A [32, 32]" in r.stderr
    assert not (tmp_path / "out").exists()


def test_adapter_saved_as_bin_folds_the_same(lora_ckpts: Path, tmp_path: Path) -> None:
    """save_pretrained(safe_serialization=False) writes adapter_model.bin: --adapter DIR reads
    it (allow-list unpickler) and folds the same bits as the safetensors adapter."""
    build_base("rslora").save_pretrained(tmp_path / "base")
    model = reference(lora_ckpts / "rslora")
    model.save_pretrained(tmp_path / "st")
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").exists()
    ckpttool.merge(tmp_path / "base", tmp_path / "from-st", adapter=tmp_path / "st")
    ckpttool.merge(tmp_path / "base", tmp_path / "from-bin", adapter=tmp_path / "bin")
    want = load_file(tmp_path / "from-st" / "model.safetensors")
    got = load_file(tmp_path / "from-bin" / "model.safetensors")
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
