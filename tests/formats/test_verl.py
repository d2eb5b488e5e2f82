"""verl's FSDP2 checkpoint (``FSDPCheckpointManager.save_checkpoint``'s files: model, optimizer
and extra-state rank files, ``fsdp_config.json``, ``huggingface/``): verify passes an intact
one and finds damage in any of its files; the optimizer's rank files are checked as one set,
and the extra state's numpy RNG state is read as inert values, never called malicious."""

from __future__ import annotations

import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

import ckpttool
from ckpttool.cli import app
from ckpttool.formats.codecs import torchsave
from tests import layouts
from tests.helpers import assert_bit_exact, load_out

ACTOR = Path("global_step_1") / layouts.CKPT_DIR


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def verl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return layouts.write_verl(tmp_path_factory.mktemp("verl"), 2)


def test_verify_intact_is_clean(verl: Path) -> None:
    r = run("verify", verl / ACTOR, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["problems"] == []
    # The optimizer's and the extra state's files were read too, not only the model's.
    assert report["bytes_read"] > sum(
        (verl / ACTOR / layouts.rank_file(2, r)).stat().st_size for r in range(2))


def test_merge_is_exact(verl: Path, tmp_path: Path) -> None:
    ckpttool.merge(verl / ACTOR, tmp_path / "out", dtype="keep", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"),
                     torch.load(verl / "reference.pt", weights_only=True))


def _flip_last_storage(file: Path) -> None:
    with zipfile.ZipFile(file) as z:
        info = [i for i in z.infolist() if "/data/" in i.filename][-1]
    data = bytearray(file.read_bytes())
    name_len, extra_len = int.from_bytes(data[info.header_offset + 26:][:2], "little"), \
        int.from_bytes(data[info.header_offset + 28:][:2], "little")
    data[info.header_offset + 30 + name_len + extra_len] ^= 1
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("file", ["optim_world_size_2_rank_1.pt",
                                  "extra_state_world_size_2_rank_0.pt"])
def test_damage_in_the_training_state_is_found(verl: Path, tmp_path: Path, file: str) -> None:
    root = Path(shutil.copytree(verl / ACTOR, tmp_path / "actor"))
    _flip_last_storage(root / file)
    r = run("verify", root)
    assert r.exit_code == 1, r.output
    assert f"error: crc-mismatch: {root / file} at byte" in r.output


def test_a_missing_optimizer_rank_is_an_error(verl: Path, tmp_path: Path) -> None:
    root = Path(shutil.copytree(verl / ACTOR, tmp_path / "actor"))
    (root / "optim_world_size_2_rank_0.pt").unlink()
    (root / "optim_world_size_2_rank_2.pt").write_bytes(
        (root / "optim_world_size_2_rank_1.pt").read_bytes())
    r = run("verify", root)
    assert r.exit_code == 1, r.output
    assert ("error: side-file-unreadable: optim_world_size_2_rank_<R>.pt: not read "
            f"({root / 'optim_world_size_2_rank_0.pt'}: missing;") in r.output


def test_extra_state_numpy_rng_is_read(verl: Path) -> None:
    r = run("inspect", verl / ACTOR / "extra_state_world_size_2_rank_0.pt")
    assert r.exit_code == 0, r.output
    assert "rng.numpy = ['MT19937', \"numpy.ndarray(numpy.dtype('u4')" in r.stdout
    assert "malicious" not in r.output


@pytest.mark.parametrize(("func", "args"), [
    ("numpy._core.multiarray._reconstruct", ("os", (0,), b"b")),
    ("numpy._core.multiarray._reconstruct", (None, (10**12,), b"b")),
    ("numpy.dtype", ("u4" * 20,)),
    ("numpy.dtype", (1,)),
    ("numpy.core.multiarray.scalar", ("u4", b"\0" * 4)),
])
def test_numpy_stand_ins_check_their_arguments(func: str, args: tuple[object, ...]) -> None:
    module, name = func.rsplit(".", 1)
    stand_in = torchsave.record_global(module, name)
    assert stand_in is not None
    with pytest.raises(pickle.UnpicklingError):
        stand_in(*args)
