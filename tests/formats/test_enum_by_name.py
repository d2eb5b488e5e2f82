"""Checkpoints written under a Python that pickles Enum members by name (3.11.0 to 3.11.x,
Debian 12's system ``python3``): ``builtins.getattr(_MEM_FORMAT_ENCODING,
'TORCH_CONTIGUOUS_FORMAT')`` in every DCP ``.metadata`` and FSDP1 ``SHARDED_STATE_DICT`` rank
file. Read exactly for allow-listed Enum classes and their real member names; a ``getattr`` of
anything else stays refused, in both ``.metadata`` readers alike.

The fixtures were written once by torch 2.13.0 under Python 3.11.2
(``tests/data/py311/generate.py``)."""

from __future__ import annotations

import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.errors import InputError
from ckpttool.formats.codecs import torchsave
from ckpttool.formats.dcp import columns as dcp_metadata
from ckpttool.formats.dcp import metadata
from ckpttool.formats.dcp import reader as dcp
from ckpttool.formats.dcp.metadata import allowed_global
from ckpttool.formats.rank_files import stand_ins
from tests.helpers import assert_bit_exact, columns_agree, load_out

DATA = Path(__file__).resolve().parents[1] / "data" / "py311"
MEMBER = b"TORCH_CONTIGUOUS_FORMAT"


def test_the_fixtures_pickle_members_by_name() -> None:
    """Else the tests below would pass vacuously."""
    for f in (DATA / "dcp" / ".metadata",
              DATA / "fsdp1_sharded" / "model_world_size_2_rank_0.pt"):
        data = f.read_bytes()
        assert b"getattr" in data and MEMBER in data, f


@pytest.mark.parametrize("layout", ["dcp", "fsdp1_sharded"])
def test_merge_is_exact_and_verify_clean(layout: str, tmp_path: Path) -> None:
    ckpttool.merge(DATA / layout, tmp_path / "out", dtype="keep", weights_only=True)
    want = torch.load(DATA / "reference.pt", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), want)
    result = CliRunner().invoke(app, ["verify", str(DATA / layout)])
    assert result.exit_code == 0, result.stderr


def test_both_metadata_readers_agree() -> None:
    # the columns answered, the same as the allow-list
    assert columns_agree(DATA / "dcp" / ".metadata")


def test_members_are_torchs() -> None:
    """The stand-ins list the real classes' members (an upgrade that adds one fails here)."""
    from torch.distributed._shard.sharded_tensor.metadata import MEM_FORMAT_ENCODING
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    for real, ours in ((_MEM_FORMAT_ENCODING, metadata._MEM_FORMAT_ENCODING),
                       (MEM_FORMAT_ENCODING, stand_ins._MEM_FORMAT_ENCODING)):
        assert {m.name: m.value for m in real} == ours.members


# --------------------------------------------------------------------------------------------
# Hostile: getattr of anything else


def _swap(data: bytes, old: bytes, new: bytes) -> bytes:
    """``data`` (a protocol-4 pickle in one frame) with the short string ``old`` pushed as
    ``new`` instead, the frame length fixed: a valid pickle that asks for something else."""
    assert data[2] == 0x95 and data.count(bytes([len(old)]) + old) == 1
    out = data.replace(b"\x8c" + bytes([len(old)]) + old, b"\x8c" + bytes([len(new)]) + new)
    (frame,) = struct.unpack_from("<Q", data, 3)
    return out[:3] + struct.pack("<Q", frame + len(new) - len(old)) + out[11:]


HOSTILE = {  # what the pickle asks for instead: (old string, new string)
    "non-member name": (MEMBER, b"TORCH_NOT_A_FORMAT"),
    "dunder": (MEMBER, b"__class__"),
    "dunder-globals": (MEMBER, b"__globals__"),
    "lower-case member": (MEMBER, MEMBER.lower()),
    "class that is no enum": (b"_MEM_FORMAT_ENCODING", b"TensorProperties"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_getattr_of_anything_else_is_refused(case: str, tmp_path: Path) -> None:
    root = Path(shutil.copytree(DATA / "dcp", tmp_path / "ckpt"))
    md = root / ".metadata"
    old, new = HOSTILE[case]
    md.write_bytes(_swap(md.read_bytes(), old, new))
    assert dcp_metadata.read(md, allowed_global) is None  # left to the allow-list
    with pytest.raises(InputError, match="may be malicious") as err:
        dcp.read_info(root)
    assert "getattr" in str(err.value)
    result = CliRunner().invoke(app, ["verify", str(root)])
    assert result.exit_code == 3
    assert result.stderr.count("\n") == 1 and "may be malicious" in result.stderr


def test_getattr_of_an_unknown_class_is_not_supported(tmp_path: Path) -> None:
    """A class DCP's module does not have is no class that runs code: the pickle policy
    (formats/codecs/policy.py) calls it "not supported yet", exit 4, naming it."""
    root = Path(shutil.copytree(DATA / "dcp", tmp_path / "ckpt"))
    md = root / ".metadata"
    md.write_bytes(_swap(md.read_bytes(), b"_MEM_FORMAT_ENCODING", b"_StorageInfoX"))
    assert dcp_metadata.read(md, allowed_global) is None  # left to the allow-list
    result = CliRunner().invoke(app, ["verify", str(root)])
    assert result.exit_code == 4, result.stderr
    assert result.stderr.count("\n") == 1 and "not supported yet" in result.stderr
    assert "'torch.distributed.checkpoint.metadata._StorageInfoX'" in result.stderr
    assert str(md) in result.stderr


def test_rank_file_getattr_of_a_non_member_is_refused(tmp_path: Path) -> None:
    root = Path(shutil.copytree(DATA / "fsdp1_sharded", tmp_path / "ckpt"))
    f = root / "model_world_size_2_rank_0.pt"
    data = f.read_bytes()
    # Same length, so the zip entry sizes still hold; the CRC is fixed below.
    new = b"TORCH_CONTIGUOUS_FORMAX"
    f.write_bytes(_with_pickle(data, data.replace(MEMBER, new)))
    result = CliRunner().invoke(app, ["verify", str(root)])
    assert result.exit_code == 3, result.stderr
    assert "getattr(MEM_FORMAT_ENCODING, 'TORCH_CONTIGUOUS_FORMAX')" in result.stderr
    assert "may be malicious" in result.stderr


def _with_pickle(old: bytes, new: bytes) -> bytes:
    """``new`` (``old`` with its data.pkl edited in place) with that entry's CRC-32 fixed in
    the zip headers, so that only the pickle differs."""
    import io
    import zipfile
    import zlib

    with zipfile.ZipFile(io.BytesIO(old)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    name_len, extra_len = struct.unpack_from("<HH", new, info.header_offset + 26)
    at = info.header_offset + 30 + name_len + extra_len
    pkl = new[at:at + info.file_size]
    return new.replace(struct.pack("<I", info.CRC), struct.pack("<I", zlib.crc32(pkl)))


@pytest.mark.parametrize(("obj", "name"), [
    (metadata._MEM_FORMAT_ENCODING, "__class__"),
    (metadata._MEM_FORMAT_ENCODING, "members"),
    (metadata._MEM_FORMAT_ENCODING, 0),
    (torchsave.size, "__globals__"),
    (int, "TORCH_CONTIGUOUS_FORMAT"),
    ("TORCH_CONTIGUOUS_FORMAT", "upper"),
])
def test_enum_getattr_refuses(obj: object, name: object) -> None:
    with pytest.raises(torchsave.Refused):
        torchsave.enum_getattr(obj, name)


def test_enum_by_value_checks_membership() -> None:
    assert metadata._MEM_FORMAT_ENCODING(2) == 2
    assert torchsave.enum_getattr(metadata._MEM_FORMAT_ENCODING, "TORCH_CHANNELS_LAST") == 1
    for bad in (3, -1, "0", 0.0, True):
        with pytest.raises(pickle.UnpicklingError):
            metadata._MEM_FORMAT_ENCODING(bad)
