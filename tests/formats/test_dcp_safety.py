""".metadata is a pickle: reading it must never run code, and must not need torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpttool.errors import InputError
from ckpttool.formats.dcp import reader as dcp
from tests.helpers import write_malicious


def test_malicious_metadata_is_refused_and_not_run(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    ckpt = write_malicious(tmp_path / "ckpt", sentinel)
    with pytest.raises(InputError) as e:
        dcp.read_info(ckpt)
    assert not sentinel.exists()
    assert "refused to load" in str(e.value)
    assert f"'{os.system.__module__}.system'" in str(e.value)


@pytest.mark.parametrize("global_name", ["builtins eval", "subprocess Popen", "torch load"])
def test_any_foreign_global_is_refused(tmp_path: Path, global_name: str) -> None:
    module, name = global_name.split()
    # protocol 2 GLOBAL opcode naming the callable, then STOP: refused before lookup.
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(InputError, match=f"'{module}.{name}'"):
        dcp.read_info(tmp_path)


def test_truncated_metadata(tmp_path: Path, uneven_ckpt: Path) -> None:
    data = (uneven_ckpt / "pytorch_model_fsdp_0" / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="truncated or corrupt .metadata"):
        dcp.read_info(tmp_path)


def test_storage_path_outside_directory(tmp_path: Path, uneven_ckpt: Path) -> None:
    data = (uneven_ckpt / "pytorch_model_fsdp_0" / ".metadata").read_bytes()
    # Same length keeps pickle framing valid: '__0_0.distcp' -> '../0_0.dist'
    hacked = data.replace(b"__0_0.distcp", b"../0_0.distc", 1)
    assert hacked != data
    (tmp_path / ".metadata").write_bytes(hacked)
    with pytest.raises(InputError, match="points outside the checkpoint directory"):
        dcp.read_info(tmp_path)


def test_reading_metadata_does_not_import_torch(uneven_ckpt: Path) -> None:
    tiny_dcp = uneven_ckpt / "pytorch_model_fsdp_0"
    code = (
        "import sys\nfrom ckpttool.formats.dcp import reader as dcp\n"
        f"info = dcp.read_info({str(tiny_dcp)!r})\n"
        "with dcp.open_reader(info) as r:\n"
        "    for t in info.tensors:\n"
        "        for c in t.chunks: r.read_chunk(t, c)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _flip(data: bytes, name: bytes, bit: int = 0) -> bytes:
    """``data`` with one bit of the first ``name`` in it flipped (a damaged byte)."""
    at = data.index(name)
    return data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1:]


@pytest.mark.parametrize("name", [b"TensorStorageMetadata", b"ChunkStorageMetadata"])
def test_one_flipped_bit_in_a_class_name_is_damage_not_malice(
        tmp_path: Path, uneven_ckpt: Path, name: bytes) -> None:
    """A genuine .metadata with one bit flipped in a class name DCP writes: the file is
    damaged; calling it malicious would scare its owner off a transfer error (exit 3 both)."""
    src = uneven_ckpt / "pytorch_model_fsdp_0"
    data = _flip((src / ".metadata").read_bytes(), name)
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(InputError) as e:
        dcp.read_info(tmp_path)
    text = str(e.value)
    assert "one bit away from" in text and name.decode() in text
    assert "malicious" not in text and "nothing was executed" in text


def test_a_foreign_name_far_from_any_allowed_one_is_still_malicious(tmp_path: Path) -> None:
    # builtins.setattr is two bits from the allowed builtins.getattr: not one flipped bit.
    (tmp_path / ".metadata").write_bytes(b"\x80\x02cbuiltins\nsetattr\n.")
    with pytest.raises(InputError, match="may be malicious"):
        dcp.read_info(tmp_path)
