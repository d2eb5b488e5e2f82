"""inspect on real checkpoints of every format: what each format's own library reads."""

from __future__ import annotations

import json
import math
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ckpttool
from ckpttool.core import inspect as insp
from ckpttool.core.checkpoint.discover import discover
from ckpttool.core.checkpoint.names import canonical_fqn
from ckpttool.errors import InputError
from ckpttool.formats.dcp import reader as dcp
from tests.helpers import as_table, json_table
from tests.reference import reference_state_dict

KINDS = ("llama", "uneven", "wrappers", "mixed", "placements")


def dcp_reference(dcp_dir: Path) -> dict[str, torch.Tensor]:
    info = dcp.read_info(dcp_dir)
    ref = reference_state_dict(dcp_dir)
    return {canonical_fqn(t.path): ref[t.name] for t in info.tensors}


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_json_matches_pytorch_loader(kind: str, make_checkpoint) -> None:
    ckpt = make_checkpoint(kind)
    doc = ckpttool.inspect(ckpt).to_json()
    assert doc["schema"] == 1 and doc["format"] == "dcp" and doc["kind"] == "model"
    assert doc["checkpoint"] == str(ckpt / "pytorch_model_fsdp_0")
    assert json_table(doc) == as_table(dcp_reference(ckpt / "pytorch_model_fsdp_0"))
    s = doc["summary"]
    assert s["num_tensors"] == len(doc["tensors"])
    assert s["bytes"] == sum(s["bytes_per_dtype"].values()) == sum(
        t["bytes"] for t in doc["tensors"])
    # "__<rank>_<n>.distcp"
    assert s["num_ranks"] == len({f.split("_")[2] for t in doc["tensors"] for f in t["files"]})


def test_safetensors_file_and_sharded_dir_match_safe_open(llama_ckpt: Path,
                                                          tmp_path: Path) -> None:
    for name, shard in (("single", "5GB"), ("sharded", "20KB")):
        out = tmp_path / name
        ckpttool.merge(llama_ckpt, out, max_shard_size=shard)
        want: dict[str, torch.Tensor] = {}
        for f in sorted(out.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                want.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
        doc = ckpttool.inspect(out).to_json()
        assert doc["format"] == "safetensors"
        assert json_table(doc) == as_table(want)
        assert doc["summary"]["tie"] is None  # merge wrote lm_head once
    single = tmp_path / "single" / "model.safetensors"
    assert json_table(ckpttool.inspect(single).to_json()) == json_table(
        ckpttool.inspect(tmp_path / "single").to_json())


def test_torch_save_file_matches_torch_load(wrappers_ckpt: Path, tmp_path: Path) -> None:
    state = reference_state_dict(wrappers_ckpt / "pytorch_model_fsdp_0")
    path = tmp_path / "pytorch_model.bin"
    torch.save({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, path)
    want = torch.load(path, weights_only=True)
    doc = ckpttool.inspect(path).to_json()
    assert doc["format"] == "torch-save"
    assert {t["stored_name"]: (t["shape"], t["dtype"], t["bytes"]) for t in doc["tensors"]} \
        == as_table(want)
    # Flat keys keep their names but lose wrapper segments, as merge writes them.
    assert not any("_orig_mod" in t["name"] for t in doc["tensors"])


def test_training_directory_lists_parts_and_never_unpickles(llama_ckpt: Path,
                                                            tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-500"
    shutil.copytree(llama_ckpt, ckpt)
    sentinel = tmp_path / "pwned"

    class RunsCommand:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            import os

            return (os.system, (f"touch {sentinel}",))

    (ckpt / "random_states_1.pkl").write_bytes(pickle.dumps(RunsCommand()))
    doc = ckpttool.inspect(ckpt).to_json()
    parts = {p["path"]: (p["kind"], p["format"]) for p in doc["parts"]}
    assert parts["pytorch_model_fsdp_0"] == ("model", "dcp")
    assert parts["optimizer_0"] == ("optimizer", "dcp")
    assert parts["random_states_0.pkl"] == ("other", "pickle")
    assert parts["random_states_1.pkl"] == ("other", "pickle")
    assert parts["config.json"] == ("other", "json")
    assert not sentinel.exists()
    assert doc["checkpoint"] == str(ckpt / "pytorch_model_fsdp_0")
    s = doc["summary"]
    assert s["tie"] == {"output": "lm_head.weight", "input": "model.embed_tokens.weight",
                        "config_ties": True}
    assert s["wrappers"] == ["model"]
    assert s["merged"]["dtype"] == "BF16" and s["merged"]["deduplicated"] == "lm_head.weight"
    # What merge --dtype auto really writes.
    report = ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    assert s["merged"]["bytes"] == report.total_bytes
    opt = ckpttool.inspect(ckpt / "optimizer_0").to_json()
    assert opt["kind"] == "optimizer" and opt["summary"]["tie"] is None


def test_two_models_are_listed_not_chosen(uneven_ckpt: Path, tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", parent / "a")
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", parent / "b")
    doc = ckpttool.inspect(parent).to_json()
    assert doc["format"] == "none" and doc["tensors"] == []
    assert [p["path"] for p in doc["parts"]] == ["a", "b"]
    assert doc["notes"] == [f"{parent}: holds 2 model checkpoints (a, b); pass one of them, "
                            f"e.g. ckpttool inspect {parent / 'a'}"]
    with pytest.raises(InputError, match="holds 2 model checkpoints"):
        discover(parent)


def test_mixed_lists_non_tensor_entries(mixed_ckpt: Path) -> None:
    doc = ckpttool.inspect(mixed_ckpt).to_json()
    entries = {o["name"]: o for o in doc["non_tensor"]}
    assert entries["step"] == {"name": "step", "readable": True, "value": 500,
                              "part": "train_state"}
    assert entries["meta.lr"]["value"] == 0.001
    assert not entries["opaque"]["readable"] and "OpaqueThing" in entries["opaque"]["note"]


def test_filter_narrows_the_table_not_the_summary(placements_ckpt: Path) -> None:
    doc = ckpttool.inspect(placements_ckpt, filter="*layers.0.*").to_json()
    assert [t["name"] for t in doc["tensors"]] == ["model.layers.0.weight", "model.layers.0.bias"]
    assert doc["summary"]["num_tensors"] == 7
    rows = {t["name"]: t for t in ckpttool.inspect(placements_ckpt).to_json()["tensors"]}
    assert rows["model.layers.0.weight"]["placement"] == "Shard(1) x4"
    assert rows["model.embed_tokens.weight"]["placement"] == "Shard(0) x4"
    assert rows["model.layers.0.bias"]["placement"] == "whole"
    assert rows["model.layers.0.weight"]["files"] == [f"__{r}_1.distcp" for r in range(4)]


def test_stats_match_torch(mixed_ckpt: Path) -> None:
    dcp_dir = mixed_ckpt / "pytorch_model_fsdp_0"
    ref = dcp_reference(dcp_dir)
    doc = ckpttool.inspect(mixed_ckpt, stats=True).to_json()
    for row in doc["tensors"]:
        t = ref[row["name"]]
        s = row["stats"]
        values = t.double() if t.dtype.is_floating_point else t.to(torch.int64)
        is_float = values.is_floating_point()
        finite = values[torch.isfinite(values)] if is_float else values
        assert s["nan"] == (int(torch.isnan(values).sum()) if is_float else 0)
        assert s["inf"] == (int(torch.isinf(values).sum()) if is_float else 0)
        assert s["min"] == finite.min().item() and s["max"] == finite.max().item(), row["name"]
        assert s["abs_max"] == finite.abs().max().item()
        assert math.isclose(s["mean"], finite.double().mean().item(), rel_tol=1e-6,
                            abs_tol=1e-9), row["name"]


def test_reads_no_tensor_data_and_no_torch(uneven_ckpt: Path, tmp_path: Path) -> None:
    """Every .distcp replaced by zeros of the same size: inspect does not notice."""
    damaged = tmp_path / "ckpt"
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", damaged)
    for f in damaged.glob("*.distcp"):
        f.write_bytes(bytes(f.stat().st_size))
    code = ("import sys, json\nfrom ckpttool import inspect\n"
            f"doc = inspect({str(damaged)!r}).to_json()\n"
            "print(json.dumps(doc['tensors']))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    original = ckpttool.inspect(uneven_ckpt).to_json()["tensors"]
    assert json.loads(out) == original


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or directory"):
        ckpttool.inspect(tmp_path / "nope")
    with pytest.raises(InputError, match="no checkpoint here"):
        ckpttool.inspect(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(InputError, match="not a checkpoint file"):
        ckpttool.inspect(tmp_path / "notes.txt")


@pytest.mark.parametrize(("shape", "boxes", "want"), [
    ((4, 3), [((0, 0), (4, 3))], "whole"),
    ((4, 3), [((0, 0), (2, 3)), ((2, 0), (2, 3))], "Shard(0) x2"),
    ((4, 3), [((0, 0), (4, 2)), ((0, 2), (4, 1))], "Shard(1) x2"),
    ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))],
     "Shard(0)+Shard(1) x4"),
    ((4,), [((0,), (4,)), ((0,), (4,))], "Replicate x2"),
    ((4,), [], "none"),
])
def test_placement(shape, boxes, want) -> None:
    assert insp.placement(shape, tuple(boxes)) == want


@pytest.mark.parametrize("name", ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize("case", ["finite", "zeros", "nan", "inf", "negzero"])
def test_verify_value_checks_on_raw_bits_match_torch(name: str, case: str) -> None:
    import torch

    from ckpttool.core.values import Stats
    from ckpttool.formats.codecs.dtypes import BY_NAME

    dtype = getattr(torch, BY_NAME[name].torch_name)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3000, generator=g) * 3).to(dtype)
    if case == "zeros":
        x = torch.zeros(3000, dtype=dtype)
    elif case == "negzero":
        x = torch.full((3000,), -0.0).to(dtype)
    elif case == "nan":
        x[[5, 2500]] = float("nan")
    elif case == "inf" and name != "F8_E4M3":  # e4m3fn has no infinity
        x[[7, 1000, 2999]] = float("-inf")
    stats = Stats(BY_NAME[name], full=False)
    for block in x.view(torch.uint8).split(1024):  # several blocks, like verify's reads
        stats.update(bytearray(block.numpy().tobytes()))
    got = stats.result()
    wide = x.float()
    assert got.nan == int(torch.isnan(wide).sum())
    assert got.inf == int(torch.isinf(wide).sum())
    assert bool(got.all_zero) == bool((wide == 0).all())


@pytest.mark.parametrize("kind", KINDS)
def test_placement_from_columns_is_placement_of_the_boxes(kind: str, request) -> None:
    """tensor_placement reads DCP's chunk columns (no box per chunk): the same words as
    placement() over the boxes, on every tensor of every fixture (Shard(0), Shard(1), both,
    whole, replicated, uneven and empty pieces)."""
    ckpt = discover(request.getfixturevalue(f"{kind}_ckpt"), require=False)
    assert ckpt.tensors
    for t in ckpt.tensors:
        assert insp.tensor_placement(t) == insp.placement(t.shape, t.boxes), t.name


def test_all_items_equal_compares_bytes_and_values_out_of_range() -> None:
    from array import array

    assert insp._all(array("q", [4, 4, 4]), 4)
    assert not insp._all(array("q", [4, 4, 3]), 4)
    assert insp._all(array("q"), 7)  # no chunk: nothing differs
    assert not insp._all(array("q", [1]), 1 << 64)  # no int64 holds it
    assert not insp._all(array("Q", [1]), -1)
