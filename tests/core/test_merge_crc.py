"""merge checks each stored record's CRC-32 as it copies it (finding 6 of issue 34): a byte
flipped in a record after it was written is exit 3 naming the tensor, the file and the
byte, nothing is published; ``--no-check-crc`` skips the check."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.errors import InputError
from ckpttool.formats.dcp import reader as dcp

MODEL_DIR = "pytorch_model_fsdp_0"


def copy_dcp(ckpt: Path, tmp_path: Path) -> Path:
    out = tmp_path / "damaged"
    shutil.copytree(ckpt / MODEL_DIR, out)
    return out


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def stored(ckpt: Path, name: str, chunk: int = 0) -> tuple[str, int, int]:
    """(file, offset, size) of a chunk's stored bytes (what its record's CRC-32 covers)."""
    info = dcp.read_info(ckpt)
    entry = info.tensor(name)
    c = entry.chunks[chunk]
    with dcp.open_reader(info) as reader:
        p = reader.payload(entry, c)
    return c.file, p.storage_offset, p.storage_size


@pytest.fixture(scope="module")
def large_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's DCP (torch's own writer) of records of several MB: copied file to file
    in the kernel, and cast in blocks."""
    out = tmp_path_factory.mktemp("large") / "dcp"
    g = torch.Generator().manual_seed(0)
    torch_dcp.save({"big": torch.randn(1024, 1024, generator=g),
                    "other": torch.randn(512, 1024, generator=g),
                    "small": torch.randn(16, generator=g)}, checkpoint_id=str(out))
    return out


def test_intact_checkpoint_merges(large_dcp: Path, tmp_path: Path) -> None:
    ckpttool.merge(large_dcp, tmp_path / "out", weights_only=True)
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("fork", ["0", "1"])
def test_flipped_byte_in_a_small_record(uneven_ckpt: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, fork: str) -> None:
    monkeypatch.setenv("CKPTTOOL_FORK", fork)
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    file, offset, _ = stored(damaged, "model.a", chunk=1)
    flip(damaged / file, offset + 5)
    out = tmp_path / "out"
    with pytest.raises(InputError) as e:
        ckpttool.merge(damaged, out, weights_only=True)
    assert str(e.value).startswith(f"{damaged / file} at byte {offset} (tensor '")
    assert "CRC-32 of the stored bytes is " in str(e.value)
    assert str(e.value).endswith("or pass --no-check-crc to merge it as it is")
    assert not (out / "model.safetensors").exists()
    assert not [p for p in out.iterdir()] if out.exists() else True
    # Skipped: the merge goes through, the damage with it.
    ckpttool.merge(damaged, out, weights_only=True, check_crc=False)
    assert (out / "model.safetensors").is_file()


def test_flipped_byte_in_a_record_header(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    info = dcp.read_info(damaged)
    c = info.tensor("model.b").chunks[0]
    fd = os.open(damaged / c.file, os.O_RDONLY)
    try:
        entries = dcp.record_entries(fd, offset=c.offset, length=c.length, where="t")
    finally:
        os.close(fd)
    version = next(e for e in entries if e.name == "version")
    with open(damaged / c.file, "r+b") as f:
        f.seek(version.data_offset)
        f.write(b"9")
    with pytest.raises(InputError, match="record entry 'version'"):
        ckpttool.merge(damaged, tmp_path / "out", weights_only=True)


@pytest.mark.parametrize("dtype", ["keep", "bf16"])
@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
def test_flipped_byte_in_a_large_record(large_dcp: Path, tmp_path: Path, dtype: str,
                                        where: float) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(large_dcp, damaged)
    file, offset, size = stored(damaged, "big")
    assert size == 4 << 20
    flip(damaged / file, offset + int(size * where))
    out = tmp_path / "out"
    with pytest.raises(InputError) as e:
        ckpttool.merge(damaged, out, weights_only=True, dtype=dtype)
    assert str(e.value).startswith(f"{damaged / file} at byte {offset} (tensor 'big', its "
                                   "stored bytes): CRC-32 of the stored bytes is ")
    assert not (out / "model.safetensors").exists()
    ckpttool.merge(damaged, out, weights_only=True, dtype=dtype, check_crc=False)
    assert (out / "model.safetensors").is_file()


def test_flipped_byte_in_a_strided_chunk(placements_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(placements_ckpt, tmp_path)
    info = dcp.read_info(damaged)
    name = next(t.name for t in info.tensors if len(t.chunks) > 1 and len(t.shape) == 2
                and t.chunks[1].offsets[1] != 0)
    file, offset, _ = stored(damaged, name, chunk=1)
    flip(damaged / file, offset + 3)
    with pytest.raises(InputError, match="CRC-32 of the stored bytes is "):
        ckpttool.merge(damaged, tmp_path / "out", weights_only=True)


def test_cli_exit_3_one_line(large_dcp: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(large_dcp, damaged)
    file, offset, size = stored(damaged, "other")
    flip(damaged / file, offset + size // 3)
    runner = CliRunner()
    r = runner.invoke(app, ["merge", "--weights-only", str(damaged), str(tmp_path / "out")])
    assert r.exit_code == 3
    assert r.stderr.startswith(f"ckpttool: error: {damaged / file} at byte {offset} (tensor "
                               "'other', its stored bytes): CRC-32 of the stored bytes is ")
    assert r.stderr.count("\n") == 1
    assert not (tmp_path / "out" / "model.safetensors").exists()
    r = runner.invoke(app, ["merge", "--weights-only", str(damaged), str(tmp_path / "out"),
                            "--no-check-crc"])
    assert r.exit_code == 0, r.stderr
