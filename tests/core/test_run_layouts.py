"""Training runs as users lay them out (issue 21, items 5 and 10).

* The HF Trainer writes no config.json into a SHARDED_STATE_DICT checkpoint; its
  ``save_model`` writes one into the run's ``output_dir``. The checkpoint here is accelerate's
  layout written by real FSDP2 ranks (``llama_ckpt``: ``checkpoint-500/pytorch_model_fsdp_0``);
  the Trainer's own FSDP path does not run on CPU (accelerate turns FSDP on only for
  accelerator devices), so the run directory around it is laid out as the Trainer lays it.
* Two copies of the model in one directory: the Trainer's FULL_STATE_DICT ``model.safetensors``
  (``save_pretrained`` of the same model) beside the sharded one, and verl's rank files with
  an ``hf_model/`` export beside them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.core.inspect import inspect
from ckpttool.core.merge.operation import merge
from examples.fsdp2_checkpoint import MODEL_DIR
from tests import layouts

SIDE = ("config.json", "generation_config.json", "special_tokens_map.json",
        "tokenizer_config.json")


def _run_dir(llama_ckpt: Path, tmp_path: Path, *, config_in: str | None) -> Path:
    """``run/checkpoint-500`` without its config; the config (and tokenizer) in ``config_in``
    (relative to run/), or nowhere."""
    run = tmp_path / "run"
    ckpt = run / "checkpoint-500"
    shutil.copytree(llama_ckpt, ckpt, ignore=shutil.ignore_patterns("optimizer_0", *SIDE))
    if config_in is not None:
        (run / config_in).mkdir(parents=True, exist_ok=True)
        for name in SIDE:
            shutil.copy(llama_ckpt / name, run / config_in / name)
    return ckpt


def test_config_from_the_run_directory(llama_ckpt: Path, tmp_path: Path) -> None:
    ckpt = _run_dir(llama_ckpt, tmp_path, config_in=".")
    report = merge(ckpt, tmp_path / "out", weights_only=True)
    assert report.config is not None
    assert report.config.path == str(tmp_path / "run" / "config.json")
    assert report.config.found_in == f"the run directory {tmp_path / 'run'}"
    assert not [w for w in report.warnings if "config.json" in w]
    assert report.dtype.target == "BF16"  # config.json's dtype, not the stored fp32
    assert report.tie is not None and report.tie.action == "deduplicated"
    assert (tmp_path / "out" / "config.json").is_file()
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")


def test_config_from_another_checkpoint_of_the_run(llama_ckpt: Path, tmp_path: Path) -> None:
    ckpt = _run_dir(llama_ckpt, tmp_path, config_in="checkpoint-100")
    report = merge(ckpt, tmp_path / "out", dry_run=True, weights_only=True)
    assert report.config is not None
    assert report.config.found_in == "checkpoint-100, another checkpoint of the same run"


def test_no_config_anywhere_says_the_output_is_weights_only(llama_ckpt: Path,
                                                            tmp_path: Path) -> None:
    ckpt = _run_dir(llama_ckpt, tmp_path, config_in=None)
    result = CliRunner().invoke(app, ["merge", "--weights-only", str(ckpt), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (f"ckpttool: warning: no config.json found beside {ckpt / MODEL_DIR} nor in "
            f"{tmp_path / 'run'}: the output is WEIGHTS ONLY, which from_pretrained cannot "
            "load") in " ".join(result.output.split())
    assert f"ckpttool merge {ckpt} OUT --config path/to/config.json" in result.output


def test_full_weights_beside_the_sharded_ones_are_named(llama_ckpt: Path,
                                                        tmp_path: Path) -> None:
    from examples.fsdp2_checkpoint import _llama_reference_model

    ckpt = tmp_path / "checkpoint-500"
    shutil.copytree(llama_ckpt, ckpt)
    _llama_reference_model().save_pretrained(ckpt)  # what FULL_STATE_DICT saving writes
    report = merge(ckpt, tmp_path / "out", dry_run=True, weights_only=True)
    assert report.copies is not None
    assert report.copies.used.sharded is False
    assert [c.path for c in report.copies.others] == [str(ckpt / MODEL_DIR)]
    warning = next(w for w in report.warnings if "copies of the model" in w)
    assert "the full weights at the top of the directory" in warning
    assert f"ckpttool merge {ckpt / MODEL_DIR} OUT" in warning
    assert any("copies of the model" in n for n in inspect(ckpt).notes)


@pytest.fixture(scope="module")
def verl_with_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = layouts.write_fsdp2(tmp_path_factory.mktemp("verl"), 2)
    actor = out / layouts.CKPT_DIR
    import torch

    full = torch.load(out / "reference.pt", weights_only=True)
    (actor / "hf_model").mkdir()
    save_file({k: v.contiguous() for k, v in full.items()},
              actor / "hf_model" / "model.safetensors")
    return actor


def test_verl_rank_files_beside_an_hf_export_are_named(verl_with_export: Path,
                                                       tmp_path: Path) -> None:
    report = merge(verl_with_export, tmp_path / "out", dry_run=True, weights_only=True)
    assert report.copies is not None
    assert report.copies.used.sharded is True
    assert report.copies.others[0].path == str(verl_with_export / "hf_model")
    assert any("the sharded training state the path names" in w for w in report.warnings)


def test_inspect_of_a_directory_of_checkpoints_names_none_as_chosen(
        llama_ckpt: Path, tmp_path: Path) -> None:
    for name in ("a", "b"):
        shutil.copytree(llama_ckpt / MODEL_DIR, tmp_path / "both" / name)
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "both")])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first == f"{tmp_path / 'both'}: a directory of several checkpoints (see the note)"
    assert "none checkpoint" not in result.output
    assert "holds 2 model checkpoints (a, b)" in result.output
    doc = json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path / "both"),
                                              "--json"]).output)
    assert doc["format"] == "none"
