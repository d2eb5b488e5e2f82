"""Damaged and hostile records inside real checkpoints: a clean error, never wrong bytes."""

from __future__ import annotations

import pickle
import shutil
import struct
from pathlib import Path

import pytest

import ckpttool
from ckpttool.errors import InputError
from ckpttool.formats.dcp import reader as dcp


def _copy(uneven_ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", dst)
    return dst


def _record(ckpt: Path, fqn: str) -> tuple[Path, int, int]:
    info = dcp.read_info(ckpt)
    chunk = next(c for c in info.tensor(fqn).chunks if c.numel)
    return ckpt / chunk.file, chunk.offset, chunk.length


@pytest.mark.parametrize("delta", [8, 60000])
def test_shifted_zip_entry_is_an_input_error(uneven_ckpt: Path, tmp_path: Path,
                                             delta: int) -> None:
    ckpt = _copy(uneven_ckpt, tmp_path)
    path, offset, length = _record(ckpt, "model.a")
    data = bytearray(path.read_bytes())
    rec = data[offset : offset + length]
    i = 0
    while True:  # the local header of the data/<key> entry
        i = rec.find(b"PK\x03\x04", i)
        nlen, elen = struct.unpack_from("<HH", rec, i + 26)
        if b"/data/" in bytes(rec[i + 30 : i + 30 + nlen]):
            break
        i += 4
    struct.pack_into("<H", data, offset + i + 28, (elen + delta) & 0xFFFF)
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="torch.save record(; corrupt| begins; corrupt)"):
        ckpttool.merge(ckpt, tmp_path / "out", dtype="keep", weights_only=True)


def test_negative_storage_offset_is_an_input_error(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as torch_dcp

    ckpt = tmp_path / "ckpt"
    torch_dcp.save({"w": torch.arange(8.0).view(2, 4)}, checkpoint_id=ckpt)
    path = ckpt / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    # data.pkl: ... BINPERSID, BININT1 0 (storage_offset) -> BININT -16
    i = data.find(b"Q" + b"K\x00")
    assert i > 0
    data[i + 1 : i + 3] = b"J" + struct.pack("<i", -16)[:1]
    data[i + 3 : i + 3] = struct.pack("<i", -16)[1:]
    path.write_bytes(bytes(data))
    md = pickle.loads((ckpt / ".metadata").read_bytes())  # the record grew by 3 bytes
    with pytest.raises(InputError):
        ckpttool.merge(ckpt, tmp_path / "out", dtype="keep", weights_only=True)
    assert md is not None


def _bombs() -> dict[str, object]:
    shared: list[object] = []
    for _ in range(60):  # 2**60 values once shared references are expanded
        shared = [shared, shared]
    deep: list[object] = []
    for _ in range(150):  # past MAX_DEPTH (100), within what torch.save can pickle
        deep = [deep]
    cycle: list[object] = []
    cycle.append(cycle)
    return {"shared": shared, "deep": deep, "cycle": cycle}


def test_huge_deep_or_cyclic_entries_are_reported_not_walked(tmp_path: Path) -> None:
    import io

    import torch

    from ckpttool.formats.codecs.dtypes import BY_NAME
    from ckpttool.formats.dcp.writer import DcpWriter
    from ckpttool.storage.outputs import AtomicOutputs, pwrite_all

    # dcp.save itself expands shared lists (exponential), so the records are written directly:
    # real torch.save records under torch's own metadata classes.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with AtomicOutputs(ckpt) as outputs:
        writer = DcpWriter(outputs.create, pwrite_all, str(ckpt))
        writer.declare_tensor("model.w", ("model", "w"), BY_NAME["F32"], (2,))
        writer.add_chunk("model.w", (0,), (2,), torch.ones(2).numpy().tobytes(), 0)
        for key, value in _bombs().items():
            buf = io.BytesIO()
            torch.save(value, buf)
            writer.add_object(key, (key,), buf.getvalue())
        outputs.write_bytes(".metadata", writer.metadata())
        outputs.commit()
    report = ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    notes = {o.name: o.note for o in report.non_tensor}
    assert "expands to more than" in notes["shared"]
    assert "nests deeper than" in notes["deep"]
    assert "cycle" in notes["cycle"]
    assert all(not o.readable for o in report.non_tensor)
    inspected = ckpttool.inspect(ckpt)
    assert {o.name for o in inspected.non_tensor if not o.readable} == set(notes)
