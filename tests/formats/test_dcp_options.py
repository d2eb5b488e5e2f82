"""DCP written with FileSystemWriter's options (torch 2.13), on 2 real gloo ranks
(:func:`tests.layouts.write_dcp_options`): what each layout is, and its damage. The contract
suite (``TestDcpSafetensorsSerialization``, ``TestDcpRankLocal``, ``TestDcpZstd`` in
test_contract.py) runs every command on each; this file covers what is particular to them."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

import ckpttool
from ckpttool.formats.dcp import reader as dcp
from tests.formats.contract import cli, copy_checkpoint, flip, payload_sites
from tests.helpers import assert_bit_exact, load_out
from tests.reference import reference_state_dict


def reference(dcp_options: Path) -> dict[str, torch.Tensor]:
    return torch.load(dcp_options / "reference.pt",
                      weights_only=True)  # type: ignore[no-any-return]


def storage(path: Path) -> dict[str, object]:
    r = cli("inspect", path, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["format"] == "dcp"
    return doc["summary"]["storage"]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# What torch writes (the layouts these readers rely on)


def test_each_option_writes_what_the_reader_expects(dcp_options: Path) -> None:
    names = {k: sorted(p.name for p in (dcp_options / k).iterdir())
             for k in ("safetensors", "rank_local", "zstd")}
    assert names["rank_local"] == ["__0.metadata", "__0_0.distcp", "__1.metadata",
                                   "__1_0.distcp"]
    assert names["safetensors"] == names["zstd"] == [".metadata", "__0_0.distcp",
                                                    "__1_0.distcp"]
    info = dcp.read_info(dcp_options / "safetensors")
    assert {c.encoding for t in info.tensors for c in t.chunks} == {"raw"}
    info = dcp.read_info(dcp_options / "zstd")
    assert {c.encoding for t in info.tensors for c in t.chunks} == {dcp.ZSTD_RECORD}


def test_plain_dcp_storage(tiny_dcp: Path) -> None:
    assert storage(tiny_dcp) == {"serialization": "torch_save", "compression": None,
                                 "metadata": "global"}


# --------------------------------------------------------------------------------------------
# SerializationFormat.SAFETENSORS


def test_safetensors_storage_is_reported(dcp_options: Path) -> None:
    path = dcp_options / "safetensors"
    assert storage(path) == {"serialization": "safetensors", "compression": None,
                             "metadata": "global"}
    r = cli("inspect", path)
    assert "  storage: safetensors records" in r.stdout.splitlines()
    assert ckpttool.verify(path).storage["serialization"] == "safetensors"


def test_torch_cannot_load_safetensors_serialization(dcp_options: Path) -> None:
    """Why the reference is the writer's own full state dict: torch's FileSystemReader hands
    the blob to torch.load. If this starts passing, compare with torch's loader instead."""
    from torch.distributed.checkpoint import CheckpointException

    with pytest.raises(CheckpointException, match="Weights only load failed"):
        reference_state_dict(dcp_options / "safetensors")


def test_safetensors_blob_header_damaged(dcp_options: Path, tmp_path: Path) -> None:
    damaged = copy_checkpoint(dcp_options / "safetensors", tmp_path)
    site = payload_sites(damaged)[0]
    info = dcp.read_info(damaged)
    blob = min(c.offset for t in info.tensors for c in t.chunks if c.file == site.file)
    with open(damaged / site.file, "r+b") as f:  # the blob's header: its JSON text
        f.seek(blob - 40)
        f.write(b"\xff" * 8)
    r = cli("merge", "--weights-only", damaged, tmp_path / "out", "--dtype", "keep")
    assert r.exit_code == 3, r.output
    assert site.file in r.output and "safetensors" in r.output
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# use_collectives=False


def test_rank_local_storage_is_the_union(dcp_options: Path) -> None:
    path = dcp_options / "rank_local"
    assert storage(path) == {"serialization": "torch_save", "compression": None,
                             "metadata": "rank-local"}
    info = dcp.read_info(path)
    assert info.num_ranks == 2 and info.metadata_name == dcp.RANK_METADATA
    # every rank wrote the replicated tensors, the buffer and the step: kept once each
    copies = {c.name for c in info.detail.copies}
    assert copies == {"replicated", "steps", "step"}
    assert len(info.tensor("replicated").chunks) == 1
    assert [len(info.tensor(n).chunks) for n in ("up.weight", "columns")] == [2, 2]


def test_rank_local_differing_copies(dcp_options: Path, tmp_path: Path) -> None:
    path = dcp_options / "rank_local_differs"
    report = ckpttool.verify(path)
    found = [p for p in report.problems if p.code == "copy-differs"]
    assert not report.ok
    assert [(p.severity, p.location.tensor, p.location.file) for p in found] == [
        ("error", "counter", "__1_0.distcp")]
    assert "__0_0.distcp" in found[0].message and "__1.metadata" in found[0].message
    r = cli("merge", "--weights-only", path, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert "'counter'" in r.output and "__0_0.distcp" in r.output and "__1_0.distcp" in r.output
    assert "use_collectives=False" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    r = cli("reshard", path, tmp_path / "resharded", "--ranks", "1")
    assert r.exit_code == 3, r.output


def test_rank_local_damaged_copy_is_found(dcp_options: Path, tmp_path: Path) -> None:
    """A flipped byte in the copy that is not used: found by comparison and by its CRC."""
    damaged = copy_checkpoint(dcp_options / "rank_local", tmp_path)
    info = dcp.read_info(damaged)
    copy = next(c for c in info.detail.copies if c.name == "replicated")
    with dcp.open_reader(info) as reader:
        p = reader.payload(info.tensor("replicated"), copy.other)
    assert p.start is not None
    flip(damaged, type(payload_sites(damaged)[0])(copy.other.file, p.start, "replicated",
                                                   True))
    report = ckpttool.verify(damaged)
    codes = {(p.code, p.location.file) for p in report.problems if p.severity == "error"}
    assert codes == {("copy-differs", copy.other.file), ("crc-mismatch", copy.other.file)}
    with pytest.raises(ckpttool.InputError, match="'replicated'"):
        ckpttool.merge(damaged, tmp_path / "out", dtype="keep", weights_only=True)


def test_rank_local_missing_rank_metadata(dcp_options: Path, tmp_path: Path) -> None:
    damaged = copy_checkpoint(dcp_options / "rank_local", tmp_path)
    (damaged / "__1.metadata").unlink()
    report = ckpttool.verify(damaged)
    assert not report.ok
    assert any(p.code == "missing-file" and p.location.file == "__1.metadata"
               for p in report.problems)
    r = cli("merge", "--weights-only", damaged, tmp_path / "out")
    assert r.exit_code == 3 and "__1.metadata: missing" in r.output, r.output


def test_rank_local_metadata_is_read_by_the_allow_list(tmp_path: Path) -> None:
    """A __<rank>.metadata naming anything but DCP's classes is refused; nothing runs."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    marker = tmp_path / "ran"

    class Trap:
        def __reduce__(self) -> tuple[object, ...]:
            return (Path.touch, (marker,))

    (ckpt / "__0.metadata").write_bytes(pickle.dumps(Trap()))
    r = cli("inspect", ckpt)
    assert r.exit_code == 3 and "refused to load" in r.output, r.output
    assert not marker.exists()


# --------------------------------------------------------------------------------------------
# ZStandard


def test_zstd_merge_matches_torch_loader(dcp_options: Path, tmp_path: Path) -> None:
    path = dcp_options / "zstd"
    ours = ckpttool.merge(path, tmp_path / "out", dtype="keep", weights_only=True)
    assert ours.storage["compression"] == "zstd"
    theirs = reference_state_dict(path)
    assert theirs["step"] == 500
    assert_bit_exact(load_out(tmp_path / "out"),
                     {k: v for k, v in theirs.items() if isinstance(v, torch.Tensor)})
    assert_bit_exact(load_out(tmp_path / "out"), reference(dcp_options))


def test_zstd_applied_twice_is_read_as_torch_reads_it(dcp_options: Path, tmp_path: Path
                                                      ) -> None:
    """``_extensions=[ZStandard(), ZStandard()]``: every record compressed twice, which
    torch's loader reads (issue 34: it was exit 4)."""
    path = dcp_options / "zstd_twice"
    assert dcp.read_info(path).detail.zstd_layers == 2
    ckpttool.merge(path, tmp_path / "out", dtype="keep", weights_only=True)
    theirs = reference_state_dict(path)
    assert_bit_exact(load_out(tmp_path / "out"),
                     {k: v for k, v in theirs.items() if isinstance(v, torch.Tensor)})
    assert_bit_exact(load_out(tmp_path / "out"), reference(dcp_options))
    assert cli("verify", path).exit_code == 0
    r = cli("inspect", path)
    assert "  non-tensor step = 500" in r.stdout, r.output


def test_zstd_storage_is_reported(dcp_options: Path, tmp_path: Path) -> None:
    path = dcp_options / "zstd"
    assert storage(path)["compression"] == "zstd"
    r = cli("merge", "--weights-only", path, tmp_path / "out", "--dtype", "keep")
    assert r.exit_code == 0 and "  source: dcp, zstd-compressed" in r.stdout, r.output
    r = cli("verify", path)
    assert r.exit_code == 0 and r.stdout.rstrip().endswith("; zstd-compressed"), r.output
    r = cli("inspect", path)
    assert "  non-tensor step = 500" in r.stdout, r.output


def test_zstd_damaged_record_is_named(dcp_options: Path, tmp_path: Path) -> None:
    damaged = copy_checkpoint(dcp_options / "zstd", tmp_path)
    site = next(s for s in payload_sites(damaged) if s.compressed)
    chunk = next(c for t in dcp.read_info(damaged).tensors for c in t.chunks
                 if c.file == site.file and c.offset <= site.offset < c.end)
    with open(damaged / site.file, "r+b") as f:  # the zstd frame's magic number
        f.seek(chunk.offset)
        f.write(b"\0")
    r = cli("merge", "--weights-only", damaged, tmp_path / "out", "--dtype", "keep")
    assert r.exit_code == 3, r.output
    assert f"{site.file} at byte {chunk.offset} (tensor '{site.tensor}'" in r.output
    assert "does not decompress" in r.output
    report = ckpttool.verify(damaged)
    assert [(p.code, p.location.file, p.location.offset) for p in report.problems
            if p.severity == "error"] == [("record-corrupt", site.file, chunk.offset)]


def test_zstd_truncated_record(dcp_options: Path, tmp_path: Path) -> None:
    """A compressed record cut short (the metadata made to agree): an incomplete frame."""
    damaged = copy_checkpoint(dcp_options / "zstd", tmp_path)
    md = pickle.loads((damaged / ".metadata").read_bytes())  # our own file: trusted
    key, item = next((k, v) for k, v in md.storage_data.items() if k.fqn == "columns")
    item.length -= 5
    (damaged / ".metadata").write_bytes(pickle.dumps(md))
    report = ckpttool.verify(damaged)
    found = [p for p in report.problems if p.severity == "error"]
    assert [(p.code, p.location.tensor) for p in found] == [("record-corrupt", "columns")]
    assert "incomplete" in found[0].message or "decompress" in found[0].message


def test_zstd_without_the_library(dcp_options: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    r = cli("merge", "--weights-only", dcp_options / "zstd", tmp_path / "out", "--dtype", "keep")
    assert r.exit_code == 4, r.output
    assert "pip install 'ckpttool[zstd]'" in r.output
    assert not (tmp_path / "out").exists()


def test_zstd_reshard_writes_plain_records(dcp_options: Path, tmp_path: Path) -> None:
    """reshard decompresses records, the non-tensor ones included: torch reads the result."""
    ckpttool.reshard(dcp_options / "zstd", tmp_path / "out", ranks=3)
    theirs = reference_state_dict(tmp_path / "out")
    assert theirs["step"] == 500
    ref = reference(dcp_options)
    assert_bit_exact({k: v for k, v in theirs.items() if k in ref}, ref)


def test_unknown_transform_is_unsupported(dcp_options: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "ckpt"
    shutil.copytree(dcp_options / "zstd", damaged)
    md = pickle.loads((damaged / ".metadata").read_bytes())
    for item in md.storage_data.values():
        item.transform_descriptors = ["stream.aes@example/1"]
    (damaged / ".metadata").write_bytes(pickle.dumps(md))
    r = cli("inspect", damaged)
    assert r.exit_code == 4 and "stream.aes@example/1" in r.output, r.output


def test_safetensors_with_zstd_is_unsupported(dcp_options: Path) -> None:
    r = cli("verify", dcp_options / "safetensors_zstd")
    assert r.exit_code == 4, r.output
    assert "SAFETENSORS" in r.output and "ZStandard" in r.output


def test_zstd_record_whose_contents_changed(dcp_options: Path, tmp_path: Path) -> None:
    """A record that decompresses, but to a storage its archive's CRC-32 disagrees with (as
    if changed before compression): verify reports the CRC, merge refuses it."""
    import zstandard

    damaged = copy_checkpoint(dcp_options / "zstd", tmp_path)
    md = pickle.loads((damaged / ".metadata").read_bytes())  # our own file: trusted
    key, item = next((k, v) for k, v in md.storage_data.items() if k.fqn == "columns")
    data = damaged / item.relative_path
    blob = data.read_bytes()
    record = bytearray(zstandard.ZstdDecompressor().decompressobj().decompress(
        blob[item.offset : item.offset + item.length]))
    raw = bytes(record)
    at = dcp.read_record(lambda size, offset: raw[offset : offset + size], offset=0,
                         length=len(raw), where="test").data_offset  # the storage's first byte
    record[at] ^= 1
    again = zstandard.ZstdCompressor().compress(bytes(record))
    item.offset, item.length = len(blob), len(again)
    data.write_bytes(blob + again)
    (damaged / ".metadata").write_bytes(pickle.dumps(md))
    report = ckpttool.verify(damaged)
    found = [(p.code, p.location.tensor) for p in report.problems if p.severity == "error"]
    assert found == [("crc-mismatch", "columns")], report.problems
    r = cli("merge", "--weights-only", damaged, tmp_path / "out", "--dtype", "keep")
    # merge checks the stored CRC-32 as it copies (--no-check-crc skips it), before decoding
    assert r.exit_code == 3 and "CRC-32" in r.output and "columns" in r.output, r.output
