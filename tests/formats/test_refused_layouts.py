"""Valid checkpoints of layouts ckpttool does not read yet are refused as what they are
(exit 4, one line naming the layout and what to do), never read as something else."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

from ckpttool.cli import app
from tests import ds_layouts


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def universal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ZeRO-2 save converted by DeepSpeed's own ds_to_universal.py (the client state it
    wants from Megatron-DeepSpeed injected, as its --inject_missing_state does)."""
    out = ds_layouts.write_zero(tmp_path_factory.mktemp("ds-universal"), 2, 2)
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(out / "global_step1"),
                    "--output_folder", str(out / "global_step1_universal"),
                    "--num_extract_workers", "1", "--num_merge_workers", "1",
                    "--inject_missing_state"], check=True, capture_output=True)
    return out


@pytest.mark.parametrize(("where", "what"), [
    ("global_step1_universal", "a DeepSpeed universal checkpoint (ds_to_universal.py: "
                               "zero/<param>/fp32.pt); not supported yet"),
    ("global_step1_universal/zero", "the parameter directory of a DeepSpeed universal "
                                    "checkpoint; not supported yet"),
])
@pytest.mark.parametrize("command", ["inspect", "verify", "merge"])
def test_deepspeed_universal_is_exit_4(universal: Path, tmp_path: Path, where: str, what: str,
                                       command: str) -> None:
    args: list[str | Path] = [command, universal / where]
    args += [tmp_path / "out"] if command == "merge" else []
    r = run(*args)
    assert r.exit_code == 4, r.output
    assert r.stderr == f"ckpttool: error: {universal / where}: {what}" + (
        ". Merge the ZeRO checkpoint it was converted from (the global_step<N> directory "
        "beside it)\n" if where.endswith("universal") else
        ". Merge the ZeRO checkpoint it was converted from\n")
    assert not (tmp_path / "out").exists()


def test_the_zero_checkpoint_beside_it_still_merges(universal: Path, tmp_path: Path) -> None:
    r = run("merge", "--weights-only", universal, tmp_path / "out", "-q")
    assert r.exit_code == 0, r.output


def test_torchtitan_torch_checkpointing_is_exit_4(tmp_path: Path) -> None:
    """The layout by its names (torch_checkpointing is not installed here to write it): each
    rank's local tensors and the specs pickle."""
    step = tmp_path / "step-10"
    step.mkdir()
    for rank in range(2):
        torch.save({"model": {"w": torch.zeros(2, 4)}}, step / f"checkpoint_{rank}.pt")
    (step / "metadata.pkl").write_bytes(pickle.dumps({"w": "Shard(0)"}))
    for command in ("inspect", "merge"):
        r = run(command, step, *([tmp_path / "out"] if command == "merge" else []))
        assert r.exit_code == 4, r.output
        assert r.stderr == (
            f"ckpttool: error: {step}: a torchtitan checkpoint of the torch_checkpointing "
            "backend (2 checkpoint_<rank>.pt files of local tensors placed by metadata.pkl); "
            "not supported yet. Save with torchtitan's default DCP checkpointer (a .metadata "
            "and .distcp files), which ckpttool merges\n")
