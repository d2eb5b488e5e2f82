"""verify on real checkpoints and on damaged copies of them: each damage found and named."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import ckpttool
from ckpttool.core.checkpoint import tensors
from ckpttool.core.checkpoint.discover import discover
from ckpttool.core.verify import operation as ver
from ckpttool.errors import InputError
from ckpttool.formats.dcp import reader as dcp
from tests.helpers import RunsCommand
from tests.reference import reference_state_dict

KINDS = ("llama", "uneven", "wrappers", "mixed", "placements")
MODEL_DIR = "pytorch_model_fsdp_0"


def codes(report: ver.VerifyReport, severity: str = "error") -> list[str]:
    return [p.code for p in report.problems if p.severity == severity]


def copy_dcp(ckpt: Path, tmp_path: Path) -> Path:
    out = tmp_path / "damaged"
    shutil.copytree(ckpt / MODEL_DIR, out)
    return out


def data_offset(dcp_dir: Path, fqn: str, chunk: int = 0) -> tuple[str, int]:
    """(file, absolute byte offset) of a chunk's tensor bytes."""
    info = dcp.read_info(dcp_dir)
    entry = info.tensor(fqn)
    c = [c for c in entry.chunks if c.numel][chunk]
    with dcp.open_reader(info) as r:
        return c.file, r.payload(entry, c).storage_offset


def rewrite_metadata(dcp_dir: Path, change) -> None:
    md = FileSystemReader(dcp_dir).read_metadata()
    change(md)
    with open(dcp_dir / ".metadata", "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize("kind", KINDS)
def test_undamaged_fixtures_pass(kind: str, make_checkpoint) -> None:
    report = ckpttool.verify(make_checkpoint(kind))
    assert report.ok, [p.message for p in report.problems]
    assert report.bytes_read >= sum(t.bytes for t in
                                    ckpttool.inspect(make_checkpoint(kind)).tensors)
    assert report.checks == ["structure", "content", "ties", "dtypes"]


def test_optimizer_checkpoint_passes(llama_ckpt: Path) -> None:
    report = ckpttool.verify(llama_ckpt / "optimizer_0")
    assert report.ok and report.kind == "optimizer"


def test_flipped_byte_is_a_crc_mismatch(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    file, offset = data_offset(damaged, "model.a", chunk=1)
    with open(damaged / file, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    report = ckpttool.verify(damaged)
    assert codes(report) == ["crc-mismatch"]
    (p,) = [p for p in report.problems if p.code == "crc-mismatch"]
    assert p.location == ver.Location(file, "a", offset)
    assert p.message.startswith(f"{damaged / file} at byte {offset} (tensor 'a', chunk at "
                                "offsets [4, 0]): CRC-32 of the stored bytes is ")


def test_flipped_byte_in_a_record_header_is_a_crc_mismatch(uneven_ckpt: Path,
                                                          tmp_path: Path) -> None:
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
    report = ckpttool.verify(damaged)
    assert codes(report) == ["crc-mismatch"]
    assert "record entry 'version'" in report.problems[0].message


def test_truncated_distcp(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    victim = damaged / "__1_0.distcp"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 100)
    report = ckpttool.verify(damaged)
    assert codes(report) == ["truncated-file"]
    assert report.problems[0].location == ver.Location("__1_0.distcp", None, size - 100)


def test_missing_distcp(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    (damaged / "__2_0.distcp").unlink()
    report = ckpttool.verify(damaged)
    assert codes(report) == ["missing-file"]
    assert report.problems[0].message.startswith(
        f"{damaged}/__2_0.distcp: data file is missing; .metadata references it (")


def test_stray_distcp_is_a_warning(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    shutil.copy(damaged / "__0_0.distcp", damaged / "__7_0.distcp")
    report = ckpttool.verify(damaged)
    assert report.ok and codes(report, "warning") == ["stray-file"]


def test_overlapping_chunks(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)

    def overlap(md) -> None:
        entry = md.state_dict_metadata["model.a"]  # rows 0-3, 4-7, 8-9
        moved = ChunkStorageMetadata(offsets=torch.Size([3, 0]), sizes=entry.chunks[1].sizes)
        md.storage_data[MetadataIndex("model.a", [3, 0])] = md.storage_data[
            MetadataIndex("model.a", [4, 0])]
        entry.chunks[1] = moved

    rewrite_metadata(damaged, overlap)
    report = ckpttool.verify(damaged)
    assert codes(report) == ["chunk-overlap"]
    assert report.problems[0].message == (
        f"{damaged}: tensor 'a': chunks at offsets [0, 0] and [3, 0] overlap; the checkpoint is "
        "incomplete or corrupt")


def test_chunk_missing_from_metadata(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    rewrite_metadata(damaged, lambda md: md.state_dict_metadata["model.a"].chunks.pop())
    report = ckpttool.verify(damaged)
    assert codes(report) == ["chunk-gap"]
    assert report.problems[0].message == (
        f"{damaged}: tensor 'a': chunks cover 56 of 70 elements; 14 are missing; the checkpoint "
        "is incomplete or corrupt")


def test_record_that_does_not_match_metadata(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)

    def wrong_dtype(md) -> None:
        md.state_dict_metadata["model.b"].properties.dtype = torch.float16

    rewrite_metadata(damaged, wrong_dtype)
    report = ckpttool.verify(damaged)
    assert set(codes(report)) == {"record-corrupt"}
    assert "record holds F32 [3] but .metadata promises F16 [3]" in report.problems[0].message


@pytest.mark.parametrize("damage", ["truncated", "malicious", "outside"])
def test_unreadable_metadata_raises(damage: str, uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    data = (damaged / ".metadata").read_bytes()
    sentinel = tmp_path / "pwned"
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "malicious":
        data = b"\x80\x02cos\nsystem\n(V" + f"touch {sentinel}".encode() + b"\ntR."
    else:
        data = data.replace(b"__0_0.distcp", b"../0_0.distc", 1)
    (damaged / ".metadata").write_bytes(data)
    with pytest.raises(InputError):
        ckpttool.verify(damaged)
    assert not sentinel.exists()


def test_diverged_tie(llama_ckpt: Path, tmp_path: Path) -> None:
    state = reference_state_dict(llama_ckpt / MODEL_DIR)
    state["model.lm_head.weight"] = state["model.lm_head.weight"] + 1
    broken = tmp_path / "broken"
    model_sd = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    torch_dcp.save({"model": model_sd}, checkpoint_id=broken / MODEL_DIR)
    shutil.copy(llama_ckpt / "config.json", broken / "config.json")
    report = ckpttool.verify(broken)
    assert codes(report) == ["tie-broken"]
    # Untied by config: fine. No config: only a note.
    config = json.loads((broken / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (broken / "config.json").write_text(json.dumps(config))
    assert ckpttool.verify(broken).ok
    (broken / "config.json").unlink()
    report = ckpttool.verify(broken)
    assert report.ok and codes(report, "info") == ["tie-candidate"]
    assert "are different" in report.problems[0].message


def test_untied_config_needs_both_copies(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckpttool.merge(llama_ckpt, out)  # tied and identical: lm_head written once
    assert codes(ckpttool.verify(out), "info") == ["tie-ok"]
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    report = ckpttool.verify(out)
    assert codes(report) == ["tie-missing"]


def test_fp32_upcast_with_expect_dtype(llama_ckpt: Path, uneven_ckpt: Path) -> None:
    report = ckpttool.verify(llama_ckpt, expect_dtype="bf16")
    assert set(codes(report)) == {"dtype-upcast"}
    assert len(codes(report)) == 21
    assert ckpttool.verify(llama_ckpt, expect_dtype="auto").counts["error"] == 21
    assert ckpttool.verify(llama_ckpt, expect_dtype="fp32").ok
    assert set(codes(ckpttool.verify(uneven_ckpt, expect_dtype="bf16"))) == {"dtype-upcast"}


def test_mixed_judges_float8_and_integers_apart(mixed_ckpt: Path) -> None:
    report = ckpttool.verify(mixed_ckpt, expect_dtype="bf16")
    assert sorted(p.location.tensor for p in report.problems if p.severity == "error") == [
        "float16", "float32", "float64", "plain", "scalar"]
    assert {"float8-tensors", "int-tensors", "bool-tensors"} <= set(codes(report, "info"))
    assert codes(report, "warning").count("nan") == 4


# --------------------------------------------------------------------------------------------
# against


@pytest.mark.parametrize("kind", KINDS)
def test_merge_output_equals_its_source(kind: str, make_checkpoint, tmp_path: Path) -> None:
    ckpt = make_checkpoint(kind)
    out = tmp_path / "out"
    ckpttool.merge(ckpt, out, dtype="keep", weights_only=True)
    report = ckpttool.verify(ckpt, against=out)
    assert report.ok, [p.message for p in report.problems]
    assert "against" in report.checks
    dedup = [p for p in report.problems if p.code == "tie-deduplicated"]
    assert len(dedup) == (1 if kind == "llama" else 0)
    # And the other way round.
    assert ckpttool.verify(out, against=ckpt).ok


@pytest.mark.parametrize("kind", ["llama", "mixed"])
def test_merge_with_a_cast_equals_its_source_after_the_cast(kind: str, make_checkpoint,
                                                            tmp_path: Path) -> None:
    ckpt = make_checkpoint(kind)
    out = tmp_path / "out"
    ckpttool.merge(ckpt, out, dtype="bf16", weights_only=True)
    report = ckpttool.verify(ckpt, against=out)
    assert "dtype-differs" in codes(report)
    if kind == "llama":  # the tied copy left out: its partner was not compared, not "differs"
        for found in (report, ckpttool.verify(out, against=ckpt)):
            (tie,) = [p for p in found.problems if p.location.tensor == "lm_head.weight"
                      and p.code in ("missing-tensor", "extra-tensor")]
            assert "its tie partner 'model.embed_tokens.weight' was not compared" in tie.message
    assert ckpttool.verify(ckpt, against=out, allow_cast=True, dtype="bf16").ok
    assert ckpttool.verify(out, against=ckpt, allow_cast=True, dtype="bf16").ok


def test_one_changed_byte_in_the_output_fails(placements_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckpttool.merge(placements_ckpt, out, weights_only=True)
    target = out / "model.safetensors"
    ckpt = discover(out)
    t = ckpt.by_name()["model.layers.0.weight"]  # Shard(1): compared in a second, ordered read
    slot = t.tensor.chunks[0]
    at = slot.offset + 4 * 13 + 1
    data = bytearray(target.read_bytes())
    data[at] ^= 0x01
    target.write_bytes(data)
    report = ckpttool.verify(placements_ckpt, against=out)
    assert codes(report) == ["data-differs"]
    p = report.problems[0]
    assert p.location == ver.Location("model.safetensors", "model.layers.0.weight",
                                      slot.offset + 4 * 13)
    assert p.message == (f"tensor 'model.layers.0.weight' differs between {placements_ckpt}/"
                         f"pytorch_model_fsdp_0 and {out}: first at element 13 (index [1, 3])")


def test_missing_and_extra_tensors(uneven_ckpt: Path, tmp_path: Path) -> None:
    state = {k.removeprefix("model."): v
             for k, v in reference_state_dict(uneven_ckpt / MODEL_DIR).items()}
    state["extra"] = torch.zeros(2)
    del state["a"]
    other = tmp_path / "other.bin"
    torch.save(state, other)
    report = ckpttool.verify(uneven_ckpt, against=other)
    assert sorted(codes(report)) == ["extra-tensor", "missing-tensor"]


def test_manifest_round_trip_across_formats(llama_ckpt: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "m.json"
    report = ckpttool.verify(llama_ckpt, manifest=manifest)
    assert report.manifest is not None
    assert report.manifest.to_json() == {"path": str(manifest), "action": "written", "tensors": 21}
    doc = json.loads(manifest.read_text())
    assert doc["kind"] == "ckpttool-manifest" and len(doc["tensors"]) == 21
    # A copy in another format, same bytes: the manifest holds.
    out = tmp_path / "out"
    ckpttool.merge(llama_ckpt, out, dtype="keep", keep_tied=True)
    report = ckpttool.verify(out, manifest=manifest)
    assert report.ok and report.manifest is not None
    assert report.manifest.action == "checked"
    # A changed byte is caught.
    target = out / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x40
    target.write_bytes(data)
    report = ckpttool.verify(out, manifest=manifest)
    assert codes(report) == ["manifest-mismatch"]


# --------------------------------------------------------------------------------------------
# safetensors and torch.save damage


@pytest.fixture()
def sharded(llama_ckpt: Path, tmp_path: Path) -> Path:
    out = tmp_path / "sharded"
    ckpttool.merge(llama_ckpt, out, max_shard_size="20KB")
    assert ckpttool.verify(out).ok
    return out


def test_sharded_missing_and_truncated_shards(sharded: Path) -> None:
    shards = sorted(sharded.glob("model-*.safetensors"))
    shards[0].unlink()
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[:-10])
    report = ckpttool.verify(sharded)
    assert codes(report) == ["missing-file", "header-corrupt"]
    assert report.problems[0].message == (
        f"{shards[0]}: shard named in model.safetensors.index.json is missing; copy the whole "
        "directory again")
    assert report.problems[1].message.endswith(f"but the file has {len(data) - 10} bytes; "
                                               "truncated")


def test_sharded_index_disagrees(sharded: Path) -> None:
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    moved = "model.norm.weight"
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"][moved] = next(f for f in files if f != index["weight_map"][moved])
    index["weight_map"]["ghost.weight"] = files[0]
    index["metadata"]["total_size"] += 1
    index_path.write_text(json.dumps(index))
    report = ckpttool.verify(sharded)
    assert sorted(codes(report)) == ["index-missing-tensor", "index-missing-tensor"]
    assert {p.location.tensor for p in report.problems if p.severity == "error"} == {
        moved, "ghost.weight"}
    assert codes(report, "warning") == ["index-total-size"]


def test_torch_file_bit_flip_is_a_crc_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.randn(32, 32), "b": torch.randn(32)}, path)
    assert ckpttool.verify(path).ok
    info = discover(path).info
    assert info is not None
    w = info.tensor("w").chunks[0]
    data = bytearray(path.read_bytes())
    data[w.offset + 100] ^= 0x08
    path.write_bytes(data)
    report = ckpttool.verify(path)
    assert codes(report) == ["crc-mismatch"]
    assert report.problems[0].location == ver.Location("pytorch_model.bin", "w", w.offset)


def test_against_a_torch_file_and_manifest_from_it(uneven_ckpt: Path, tmp_path: Path) -> None:
    state = {k.removeprefix("model."): v
             for k, v in reference_state_dict(uneven_ckpt / MODEL_DIR).items()}
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    assert ckpttool.verify(uneven_ckpt, against=path).ok
    manifest = tmp_path / "m.json"
    assert ckpttool.verify(path, manifest=manifest).ok
    assert ckpttool.verify(uneven_ckpt, manifest=manifest).ok


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_unravel_is_c_order(shape: list[int], data: st.DataObject) -> None:
    numel = 1
    for n in shape:
        numel *= n
    element = data.draw(st.integers(0, numel - 1))
    index = tensors.unravel(element, tuple(shape))
    assert torch.arange(numel).reshape(shape)[index].item() == element


@given(st.binary(min_size=1, max_size=300), st.data())
def test_first_difference_finds_the_first_byte(a: bytes, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(a) - 1))
    b = bytearray(a)
    b[i] ^= data.draw(st.integers(1, 255))
    assert tensors.first_difference(a, b) == i


def test_training_directory_verifies_the_optimizer_too(llama_ckpt: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-500"
    shutil.copytree(llama_ckpt, ckpt)
    report = ckpttool.verify(ckpt)
    assert report.ok and [(p.path, p.kind, p.format) for p in report.parts] == [
        ("optimizer_0", "optimizer", "dcp")]
    file, offset = data_offset(ckpt / "optimizer_0",
                               "optimizer.state.model.norm.weight.exp_avg")
    with open(ckpt / "optimizer_0" / file, "r+b") as f:
        f.seek(offset)
        f.write(b"\x00\x01\x02\x03")
    report = ckpttool.verify(ckpt)
    assert codes(report) == ["crc-mismatch"]
    assert report.problems[-1].location.file == f"optimizer_0/{file}"


def test_an_entry_that_would_run_code_is_an_error(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    torch_dcp.save({"w": torch.ones(3), "evil": RunsCommand(f"touch {sentinel}")},
                   checkpoint_id=tmp_path / "ckpt", no_dist=True)
    report = ckpttool.verify(tmp_path / "ckpt")
    assert not report.ok
    (p,) = [p for p in report.problems if p.severity == "error"]
    assert p.code == "code-in-checkpoint"
    assert p.message.startswith(f"entry 'evil' asks for '{os.system.__module__}.system'")
    assert not sentinel.exists()


def test_bytes_and_plain_values_are_read_not_called_unsafe(tmp_path: Path) -> None:
    torch_dcp.save({"w": torch.ones(3), "blob": b"\x00\x01state", "step": 7},
                   checkpoint_id=tmp_path / "ckpt", no_dist=True)
    report = ckpttool.verify(tmp_path / "ckpt")
    assert report.ok and not [p for p in report.problems if p.severity != "info"]
    values = {o.name: o for o in ckpttool.inspect(tmp_path / "ckpt").non_tensor}
    assert values["blob"].readable and values["step"].value == 7


def test_a_decoy_in_front_of_code_does_not_hide_it(tmp_path: Path) -> None:
    from collections import UserList

    torch_dcp.save({"w": torch.ones(3), "evil": [UserList(), RunsCommand("true")]},
                   checkpoint_id=tmp_path / "ckpt", no_dist=True)
    report = ckpttool.verify(tmp_path / "ckpt")
    assert [p.code for p in report.problems if p.severity == "error"] == ["code-in-checkpoint"]


def test_checkpoints_beside_top_level_safetensors_are_verified(llama_ckpt: Path,
                                                               tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    ckpttool.merge(llama_ckpt, ckpt)
    shutil.copytree(llama_ckpt / "optimizer_0", ckpt / "optimizer_0")
    report = ckpttool.verify(ckpt)
    assert report.ok and [p.path for p in report.parts] == ["optimizer_0"]
    file, offset = data_offset(ckpt / "optimizer_0", "optimizer.state.model.norm.weight.exp_avg")
    with open(ckpt / "optimizer_0" / file, "r+b") as f:
        f.seek(offset)
        f.write(b"\x00\x01\x02\x03")
    assert codes(ckpttool.verify(ckpt)) == ["crc-mismatch"]


@pytest.mark.parametrize("value", [float("inf"), 1.5, "12"])
def test_a_byte_range_that_is_not_an_integer_is_corrupt(value: object, uneven_ckpt: Path,
                                                        tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)

    def change(md) -> None:
        index = next(iter(md.storage_data))
        md.storage_data[index].offset = value

    rewrite_metadata(damaged, change)
    with pytest.raises(InputError, match="not two non-negative integers; corrupt .metadata"):
        ckpttool.merge(damaged, tmp_path / "out", weights_only=True)
