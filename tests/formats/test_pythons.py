"""Checkpoints written under every Python the package declares (3.10, 3.12 and 3.13 here;
3.11.2 in ``tests/data/py311``), read under the Python running the tests: merged bit for
bit, verified clean, inspected. 3.13 pickles every path as ``pathlib._local.PosixPath``
(DCP's ``StorageMeta.checkpoint_id``), which older ckpttool refused as "may be malicious".

Written once by ``tests/data/pythons/generate.py`` (torch 2.13.0, 2 gloo ranks)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.formats import torchfile
from ckpttool.formats.dcp.metadata import read_metadata_object
from tests.formats.test_dcp_metadata import _same
from tests.helpers import assert_bit_exact, load_out

DATA = Path(__file__).resolve().parents[1] / "data" / "pythons"
PYTHONS = ["py310", "py312", "py313"]


def test_every_declared_python_has_its_fixture() -> None:
    for name in PYTHONS:
        versions = json.loads((DATA / name / "versions.json").read_text())
        assert versions["python"].startswith(f"3.{name[3:]}."), versions
        assert versions["torch"].startswith("2.13.0"), versions


def test_python_313_pickles_paths_as_pathlib_local() -> None:
    """Else the tests below would pass vacuously for the finding they are for."""
    assert b"pathlib._local" in (DATA / "py313" / "dcp" / ".metadata").read_bytes()
    assert b"pathlib._local" in (DATA / "py313" / "plain.pt").read_bytes()


@pytest.mark.parametrize("python", PYTHONS)
def test_dcp_merge_is_exact_and_verify_clean(python: str, tmp_path: Path) -> None:
    src = DATA / python / "dcp"
    ckpttool.merge(src, tmp_path / "out", dtype="keep", weights_only=True)
    want = torch.load(DATA / python / "reference.pt", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), want)
    for command in ("verify", "inspect"):
        result = CliRunner().invoke(app, [command, str(src)])
        assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("python", PYTHONS)
def test_both_metadata_readers_agree(python: str) -> None:
    md = DATA / python / "dcp" / ".metadata"
    assert _same(md)  # the columns answered, the same as the allow-list
    storage_meta = read_metadata_object(md).storage_meta
    assert storage_meta.field("checkpoint_id").endswith(f"/{python}/dcp")


@pytest.mark.parametrize("python", PYTHONS)
def test_plain_torch_save_with_inert_values(python: str, tmp_path: Path) -> None:
    path = DATA / python / "plain.pt"
    info = torchfile.read_info(path)
    assert info.values["run_dir"] == "runs/small"
    assert info.values["exit_signal"] == int(signal.SIGTERM)
    assert info.values["args"] == {"lr": 0.5, "exit_signal": int(signal.SIGTERM)}
    ckpttool.merge(path, tmp_path / "out", dtype="keep", weights_only=True)
    want = torch.load(DATA / python / "reference.pt", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), want)
    result = CliRunner().invoke(app, ["verify", str(path)])
    assert result.exit_code == 0, result.stderr
