"""LoRA from trainers that write no ``adapter_config.json``: verl's FSDP checkpoint manager
(``lora_train_meta.json`` beside its rank files), accelerate's ``save_state`` (nothing; a
config may lie in the project directory above ``checkpoints/checkpoint_N``). The fold is
checked against PEFT's own ``merge_and_unload`` of the trained model, bit for bit; the adapter
against PEFT loading it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.errors import InputError
from tests import lora_layouts
from tests.lora_layouts import TRAINER, batch, build_base, trained

pytestmark = pytest.mark.filterwarnings("ignore")
ACTOR = Path("global_step_1") / "actor"
STEP = Path("checkpoints") / "checkpoint_0"


@pytest.fixture(scope="module")
def verl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lora_layouts.write_verl_lora(tmp_path_factory.mktemp("verl-lora"))


@pytest.fixture(scope="module")
def acc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lora_layouts.write_accelerate_lora(tmp_path_factory.mktemp("accelerate-lora"))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    _, ids = batch()
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids).logits
    return out


def _assert_fold_exact(out: Path, full: Path) -> None:
    want = trained(full).merge_and_unload().state_dict()
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def _assert_adapter_loads(out: Path, full: Path) -> None:
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(build_base(TRAINER), out).eval()
    assert torch.equal(_logits(loaded), _logits(trained(full)))


def test_verl_meta_gives_alpha(verl: Path, tmp_path: Path) -> None:
    report = ckpttool.verify(verl / ACTOR)
    assert report.ok and not [p for p in report.problems if p.code.startswith("lora")]
    merged = ckpttool.merge(verl / ACTOR, tmp_path / "fused")
    assert merged.lora is not None and merged.lora.summary.alpha == 16
    _assert_fold_exact(tmp_path / "fused", verl / "full.pt")
    adapter = ckpttool.merge(verl / ACTOR, tmp_path / "adapter", lora="adapter")
    assert adapter.lora is not None
    assert adapter.lora.config_from == str(verl / ACTOR / "lora_train_meta.json")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["task_type"]) == (4, 16, "CAUSAL_LM")
    assert sorted(written["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert any("assumed: use_rslora false" in w for w in adapter.warnings)
    _assert_adapter_loads(tmp_path / "adapter", verl / "full.pt")


def test_verl_meta_with_another_rank_is_an_error(verl: Path, tmp_path: Path) -> None:
    actor = Path(shutil.copytree(verl / ACTOR, tmp_path / "actor"))
    (actor / "lora_train_meta.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    with pytest.raises(InputError, match="the adapter has rank 4 but .*lora_train_meta.json "
                       "says r=8"):
        ckpttool.merge(actor, tmp_path / "out")


def test_accelerate_without_any_record(acc: Path, tmp_path: Path) -> None:
    """Nothing records alpha: verify warns (the checkpoint is whole); a fold and the adapter
    alone are both refused (exit 3: alpha is never guessed; PEFT's default 8 against the run's
    16 would halve every update) until --lora-alpha says what training used."""
    r = CliRunner().invoke(app, ["verify", str(acc / STEP)])
    assert r.exit_code == 0 and "warning: lora-no-alpha" in r.output
    r = CliRunner().invoke(app, ["merge", str(acc / STEP), str(tmp_path / "fused")])
    assert r.exit_code == 3 and "lora_alpha cannot be read from the weights" in r.stderr
    r = CliRunner().invoke(app, ["merge", str(acc / STEP), str(tmp_path / "adapter"),
                                 "--lora", "adapter"])
    assert r.exit_code == 3, r.output
    assert ("holds a LoRA adapter whose lora_alpha is recorded nowhere" in r.stderr
            and "Pass the value training used: --lora-alpha N" in r.stderr)
    assert not (tmp_path / "adapter").exists()
    r = CliRunner().invoke(app, ["merge", str(acc / STEP), str(tmp_path / "adapter"),
                                 "--lora", "adapter", "--lora-alpha", "16"])
    assert r.exit_code == 0, r.output
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"]) == (4, 16)
    # the fold with the alpha given is the trained model, exactly
    r = CliRunner().invoke(app, ["merge", str(acc / STEP), str(tmp_path / "fused"),
                                 "--lora-alpha", "16", "--weights-only"])  # no config.json
    assert r.exit_code == 0, r.output
    _assert_fold_exact(tmp_path / "fused", acc / "full.pt")
    # The adapter's own weights are the trained ones, whatever alpha the user then sets.
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(build_base(TRAINER), tmp_path / "adapter")
    want = {k: v for k, v in trained(acc / "full.pt").state_dict().items() if "lora_" in k}
    got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_accelerate_config_in_the_project_dir(acc: Path, tmp_path: Path) -> None:
    """PEFT's adapter_config.json saved in the project directory (above
    checkpoints/checkpoint_N) is found: the fold is exact."""
    run = Path(shutil.copytree(acc, tmp_path / "run"))
    trained(acc / "full.pt").peft_config["default"].save_pretrained(str(run))
    report = ckpttool.merge(run / STEP, tmp_path / "fused", weights_only=True)  # no config
    assert report.lora is not None
    assert report.lora.summary.config == str(run / "adapter_config.json")
    _assert_fold_exact(tmp_path / "fused", acc / "full.pt")


# --------------------------------------------------------------------------------------------
# verify MERGED --against BASE: a "merged" model still identical to its base (verl#7285)


def test_merged_identical_to_base_warns(lora_ckpts: Path, tmp_path: Path) -> None:
    """verl's merger layout (the adapter under lora_adapter/ inside the merged model) whose
    weights are the base's, byte for byte: a warning naming the targets' config."""
    variant = lora_ckpts / "lora"
    build_base("lora").save_pretrained(tmp_path / "base")
    out = Path(shutil.copytree(tmp_path / "base", tmp_path / "out"))
    (out / "lora_adapter").mkdir()
    shutil.copy(variant / "adapter_config.json", out / "lora_adapter")
    r = CliRunner().invoke(app, ["verify", str(out), "--against", str(tmp_path / "base")])
    assert r.exit_code == 0, r.output
    assert (f"warning: unchanged-from-base: {out}: all 15 LoRA target weights (target_modules "
            f"in {out / 'lora_adapter' / 'adapter_config.json'}) are bit-identical to "
            f"{tmp_path / 'base'}") in r.output


def test_a_real_fold_does_not_warn(lora_ckpts: Path, tmp_path: Path) -> None:
    variant = lora_ckpts / "lora"
    build_base("lora").save_pretrained(tmp_path / "base")
    ckpttool.merge(variant, tmp_path / "fused")
    report = ckpttool.verify(tmp_path / "fused", against=tmp_path / "base",
                             adapter_config=variant / "adapter_config.json")
    codes = {p.code for p in report.problems}
    assert "unchanged-from-base" not in codes and "data-differs" in codes
    # Without an adapter config nothing says it was a LoRA merge: identical is success.
    plain = ckpttool.verify(tmp_path / "base", against=tmp_path / "base")
    assert plain.ok and not plain.problems
