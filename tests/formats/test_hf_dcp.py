"""DCP checkpoints written by PyTorch's HuggingFaceStorageWriter (per-rank safetensors shards),
including integer and bool tensors, written by the real writer on 2 gloo ranks (the session
fixture ``hf_ckpt`` of tests/conftest.py, written by :func:`tests.layouts.write_hf_storage`)."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.core.reshard import reshard
from ckpttool.formats import hf_dcp
from ckpttool.formats.base import RAW
from tests.helpers import assert_bit_exact, load_out
from tests.layouts import hf_full_state as full_state


def test_recognised_by_content(hf_ckpt: Path) -> None:
    assert hf_dcp.is_hf_dcp_dir(hf_ckpt)
    info = hf_dcp.read_info(hf_ckpt)
    shapes = {t.name: t.shape for t in info.tensors}
    assert shapes == {k: tuple(v.shape) for k, v in full_state().items()}
    assert all(c.encoding == RAW for t in info.tensors for c in t.chunks)


def test_merge_is_bit_exact_with_int_and_bool(hf_ckpt: Path, tmp_path: Path) -> None:
    report = ckpttool.merge(hf_ckpt, tmp_path / "out", dtype="keep", weights_only=True)
    assert report.num_tensors == len(full_state())
    assert_bit_exact(load_out(tmp_path / "out"), full_state())


def test_merge_cast_spares_integers(hf_ckpt: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["merge", "--weights-only", str(hf_ckpt), str(tmp_path / "out"),
                                 "--dtype",
                                 "bf16", "-q"])
    assert r.exit_code == 0, r.output
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in full_state().items()}
    assert_bit_exact(load_out(tmp_path / "out"), want, cast=True)


def test_reshard_to_dcp_then_merge_round_trips(hf_ckpt: Path, tmp_path: Path) -> None:
    reshard(hf_ckpt, tmp_path / "dcp", ranks=3)
    ckpttool.merge(tmp_path / "dcp", tmp_path / "out", dtype="keep", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), full_state())
