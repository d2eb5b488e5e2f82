"""merge's typed options (core.merge.options): the keywords build them, a merge given them
whole is the same merge, and a sweep's receipt records what it recorded from keywords."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpttool
from ckpttool.core.merge.options import CastOptions, MergeOptions, ReadOptions, WriteOptions
from ckpttool.errors import UsageError


def test_keywords_go_to_their_groups() -> None:
    options = MergeOptions.of(dtype="bf16", overwrite=True, part="model", workers=3)
    assert options.cast == CastOptions(dtype="bf16")
    assert options.write == WriteOptions(overwrite=True)
    assert options.read == ReadOptions(part="model")
    assert options.share.workers == 3 and options.share.shared is None
    assert MergeOptions.of() == MergeOptions()
    with pytest.raises(TypeError, match="unexpected keyword argument 'dtpye'"):
        MergeOptions.of(dtpye="bf16")


def test_recorded_options(tmp_path: Path) -> None:
    # What receipts held when the sweep took a dict of merge()'s keywords: the same JSON.
    assert MergeOptions().recorded() == {
        "dtype": "auto", "max_shard_size": 5_000_000_000, "config": None, "keep_tied": False,
        "lora": None, "adapter": None, "adapter_config": None, "part": None, "names": None,
        "layout": "hub"}
    given = MergeOptions.of(config=tmp_path / "c" / ".." / "config.json", max_shard_size="2GB",
                            quantize="fp8-block", quantize_ignore=("lm_head",),
                            overwrite=True, workers=2)
    doc = given.recorded()
    assert doc["config"] == str((tmp_path / "config.json").resolve())
    assert doc["max_shard_size"] == 2_000_000_000
    assert (doc["quantize"], doc["quantize_ignore"]) == ("fp8-block", ["lm_head"])
    assert "dequantize" not in doc and "overwrite" not in doc and "workers" not in doc


def test_options_whole_make_the_same_merge(llama_ckpt: Path, tmp_path: Path) -> None:
    by_keywords = ckpttool.merge(llama_ckpt, tmp_path / "a", dtype="fp32", keep_tied=True,
                                 dry_run=True)
    whole = ckpttool.merge(llama_ckpt, tmp_path / "a", MergeOptions.of(
        dtype="fp32", keep_tied=True, dry_run=True))
    one, other = by_keywords.to_json(), whole.to_json()
    for doc in (one, other):  # how long it took, whole and of the contract check
        doc.pop("seconds"), doc["contract"].pop("seconds")
    assert one == other and other["dtype"]["target"] == "F32"
    assert not (tmp_path / "a").exists()


def test_options_and_keywords_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not both"):
        ckpttool.merge(tmp_path / "src", tmp_path / "out", MergeOptions(), dtype="bf16")
