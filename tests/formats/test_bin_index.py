"""Sharded torch.save checkpoints (``pytorch_model.bin.index.json``), written by huggingface_hub's
own ``save_torch_state_dict(safe_serialization=False)``, the writer transformers used for them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict

import ckpttool
from ckpttool.formats import bin_index, registry
from tests.helpers import load_out


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    embed = torch.randn(16, 8, generator=g)
    return {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,  # tied: one storage in the .bin
        "model.layers.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.layers.1.w": torch.randn(8, 8, generator=g),
        "model.norm.weight": torch.ones(8),
        "steps": torch.arange(5, dtype=torch.int64),
    }


@pytest.fixture(scope="module")
def sharded_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bin_index") / "model"
    out.mkdir()
    save_torch_state_dict(_state(), out, safe_serialization=False, max_shard_size=300)
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "copy"))


def test_written_in_several_shards_and_claimed(sharded_bin: Path) -> None:
    index = json.loads((sharded_bin / bin_index.INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert registry.detect(sharded_bin) is bin_index


def test_merge_is_bit_exact(sharded_bin: Path, tmp_path: Path) -> None:
    report = ckpttool.merge(sharded_bin, tmp_path / "out", dtype="keep", weights_only=True)
    assert report.format == "torch-save-sharded"
    got = load_out(tmp_path / "out")
    want = _state()
    assert set(got) == set(want)
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype
        assert torch.equal(got[name].view(torch.uint8), ref.view(torch.uint8)), name


def test_inspect_and_verify(sharded_bin: Path, tmp_path: Path) -> None:
    doc = ckpttool.inspect(sharded_bin).to_json()
    assert doc["format"] == "torch-save-sharded"
    assert {t["name"]: t["shape"] for t in doc["tensors"]} == {
        k: list(v.shape) for k, v in _state().items()}
    report = ckpttool.verify(sharded_bin)
    assert report.ok and not [p for p in report.problems if p.severity == "warning"]


def test_flipped_byte_is_a_crc_mismatch(sharded_bin: Path, tmp_path: Path) -> None:
    damaged = _copy(sharded_bin, tmp_path)
    info = bin_index.read_info(damaged)
    chunk = info.tensor("model.layers.1.w").chunks[0]
    data = bytearray((damaged / chunk.file).read_bytes())
    data[chunk.offset + 7] ^= 0x20
    (damaged / chunk.file).write_bytes(data)
    report = ckpttool.verify(damaged)
    assert [p.code for p in report.problems if p.severity == "error"] == ["crc-mismatch"]
    assert report.problems[0].location.file == chunk.file


def test_missing_shard(sharded_bin: Path, tmp_path: Path) -> None:
    damaged = _copy(sharded_bin, tmp_path)
    victim = sorted(damaged.glob("pytorch_model-*.bin"))[-1]
    victim.unlink()
    report = ckpttool.verify(damaged)
    assert [p.code for p in report.problems if p.severity == "error"] == ["missing-file"]
    with pytest.raises(ckpttool.InputError, match=f"{victim}: shard named in "
                       "pytorch_model.bin.index.json is missing; copy the whole directory"):
        ckpttool.merge(damaged, tmp_path / "out", weights_only=True)
    assert not (tmp_path / "out").exists()


def test_index_that_disagrees_with_the_shards(sharded_bin: Path, tmp_path: Path) -> None:
    damaged = _copy(sharded_bin, tmp_path)
    index_path = damaged / bin_index.INDEX_NAME
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    report = ckpttool.verify(damaged)
    assert [p.code for p in report.problems if p.severity == "error"] == ["index-missing-tensor"]
    with pytest.raises(ckpttool.InputError, match="places 'ghost.weight' in"):
        ckpttool.merge(damaged, tmp_path / "out", weights_only=True)


def test_reshard_to_safetensors_and_to_dcp(sharded_bin: Path, tmp_path: Path) -> None:
    report = ckpttool.reshard(sharded_bin, tmp_path / "st", to="safetensors",
                              max_shard_size="1KB")
    assert report.format_in == "torch-save-sharded" and len(report.files) > 2
    want = _state()
    got = load_out(tmp_path / "st")
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())
    ckpttool.reshard(sharded_bin, tmp_path / "dcp", ranks=2)
    ckpttool.merge(tmp_path / "dcp", tmp_path / "merged", dtype="keep", weights_only=True)
    got = load_out(tmp_path / "merged")
    assert set(got) == set(want)
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())
