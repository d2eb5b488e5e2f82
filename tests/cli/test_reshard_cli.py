"""`ckpttool reshard` through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ckpttool.cli import app


def run(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_reshard_to_ranks_json(uneven_ckpt: Path, tmp_path: Path) -> None:
    r = run("reshard", uneven_ckpt, tmp_path / "out", "--ranks", "2", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema"] == 1 and doc["command"] == "reshard" and doc["ranks"] == 2
    assert [f["name"] for f in doc["files"]] == ["__0_0.distcp", "__1_0.distcp", ".metadata"]


def test_reshard_dcp_needs_ranks(uneven_ckpt: Path, tmp_path: Path) -> None:
    r = run("reshard", uneven_ckpt / "pytorch_model_fsdp_0", tmp_path / "out")
    assert r.exit_code == 2  # a usage error (issue 24)
    assert r.stderr == ("ckpttool: error: DCP to DCP needs --ranks M (the number of ranks to "
                        "lay the checkpoint out for)\n")


def test_reshard_existing_output(uneven_ckpt: Path, tmp_path: Path) -> None:
    assert run("reshard", uneven_ckpt, tmp_path / "out", "--ranks", "2", "-q").exit_code == 0
    r = run("reshard", uneven_ckpt, tmp_path / "out", "--ranks", "2")
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {tmp_path / 'out'}: already holds a DCP checkpoint "
                        "(.metadata...); pass --overwrite to replace it or choose an empty "
                        "directory\n")


def test_reshard_dcp_to_safetensors_points_to_merge(uneven_ckpt: Path, tmp_path: Path) -> None:
    src = uneven_ckpt / "pytorch_model_fsdp_0"
    r = run("reshard", src, tmp_path / "out", "--to", "safetensors")
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {src}: --to safetensors re-splits full weights; to "
                        f"turn a sharded checkpoint into safetensors run: ckpttool merge {src} "
                        f"{tmp_path / 'out'}\n")
