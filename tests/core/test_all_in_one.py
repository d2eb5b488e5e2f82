"""Checkpoints that hold the model and the rest of the training state in one DCP, written by
the real writers (torchtitan's CheckpointManager, Lightning Fabric's fabric.save, dcp.save
with flatten_state_dict=False; :mod:`tests.all_in_one`): merge writes the model alone, bit
for bit, and says what it left out; ``--part optimizer`` writes the optimizer state; inspect
names the parts; verify reads all of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from safetensors import safe_open
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.core.checkpoint import parts
from ckpttool.core.checkpoint.discover import discover
from ckpttool.errors import InputError
from ckpttool.formats.dcp import reader as dcp
from tests import all_in_one
from tests.helpers import assert_bit_exact, load_out
from tests.reference import reference_state_dict


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return all_in_one.write_torchtitan(tmp_path_factory.mktemp("torchtitan"))


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return all_in_one.write_lightning(tmp_path_factory.mktemp("lightning"))


@pytest.fixture(scope="module")
def unflattened(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return all_in_one.write_unflattened(tmp_path_factory.mktemp("unflattened"))


def load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def reference(root: Path) -> dict[str, torch.Tensor]:
    ref: dict[str, torch.Tensor] = torch.load(root / "reference.pt", weights_only=True)
    return ref


def optimizer_reference(dcp_dir: Path, root: str = "optimizer") -> dict[str, torch.Tensor]:
    """The optimizer tensors as PyTorch's own DCP loader reads them, without their root key."""
    return {k[len(root) + 1:]: v for k, v in reference_state_dict(dcp_dir).items()
            if k.startswith(root + ".") and isinstance(v, torch.Tensor)}


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _pread(path: Path):  # noqa: ANN202 - pread(size, offset) of a file
    data = path.read_bytes()
    return lambda size, offset: data[offset:offset + size]


def codes(report: ckpttool.VerifyReport) -> list[str]:
    return [p.code for p in report.problems if p.severity == "error"]


# --------------------------------------------------------------------------------------------
# Which part each key is: pure


@pytest.mark.parametrize(("paths", "want"), [
    # torchtitan: the model flat at the top, the rest nested (flat optimizer state dict).
    ([("tok_embeddings.weight",), ("optimizer", "state.tok_embeddings.weight.exp_avg"),
      ("optimizer", "param_groups.tok_embeddings.weight.lr"), ("lr_scheduler", "last_epoch"),
      ("dataloader", "dp_rank_0"), ("train_state", "step")],
     ["model", "optimizer", "optimizer", "lr_scheduler", "dataloader", "train_state"]),
    # Lightning / get_optimizer_state_dict: nested state and param groups.
    ([("model", "0.weight"), ("optimizer", "state", "0.weight", "exp_avg"),
      ("optimizer", "param_groups", "0", "lr")], ["model", "optimizer", "optimizer"]),
    # Any name with a param_groups child is optimizer state; the one other state dict is the
    # model.
    ([("net", "w"), ("opt_g", "state", "w", "exp_avg"), ("opt_g", "param_groups", "0")],
     ["model", "optimizer", "optimizer"]),
    # A bare optimizer state dict.
    ([("state", "0", "exp_avg"), ("param_groups", "0", "lr")], ["optimizer", "optimizer"]),
    # A flat buffer named like train state stays in the model; a flat object does not.
    ([("up.weight",), ("steps",), ("step",)], ["model", "model", "train_state"]),
    # Unknown keys beside "model" are other; so are two unknown state dicts.
    ([("model", "w"), ("ema", "w"), ("meta", "run")], ["model", "other", "other"]),
    ([("generator", "w"), ("discriminator", "w")], ["other", "other"]),
])
def test_classify(paths: list[tuple[str, ...]], want: list[str]) -> None:
    # Objects where the last segment says so; the rest tensors.
    objects = {"lr", "last_epoch", "dp_rank_0", "step", "run"}
    labels = parts.classify([(p, p[-1].split(".")[-1] not in objects) for p in paths])
    assert [lab.part for lab in labels] == want


# --------------------------------------------------------------------------------------------
# torchtitan


def test_torchtitan_merge_writes_the_model_only(titan: Path, tmp_path: Path) -> None:
    ckpt = titan / all_in_one.TORCHTITAN_STEP
    report = ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    got = load_out(tmp_path / "out")
    assert_bit_exact(got, reference(titan))
    assert not [k for k in got if "exp_avg" in k or k.startswith("optimizer")]
    assert report.part == "model"
    assert [c.part for c in report.left_out] == ["optimizer", "lr_scheduler", "dataloader",
                                                   "train_state"]
    optimizer = report.left_out[0]
    assert optimizer.keys == ("optimizer",) and optimizer.num_tensors == 51
    doc = report.to_json()
    assert [c["part"] for c in doc["contents"]][0] == "model"
    json.dumps(doc)


def test_torchtitan_merge_part_optimizer(titan: Path, tmp_path: Path) -> None:
    ckpt = titan / all_in_one.TORCHTITAN_STEP
    report = ckpttool.merge(ckpt, tmp_path / "out", part="optimizer", weights_only=True)
    got = load(tmp_path / "out" / "optimizer.safetensors")
    assert_bit_exact(got, optimizer_reference(ckpt))
    assert "state.tok_embeddings.weight.exp_avg" in got  # torchtitan's own names
    assert not (tmp_path / "out" / "model.safetensors").exists()
    groups = json.loads((tmp_path / "out" / "optimizer.json").read_text())
    assert groups["param_groups.tok_embeddings.weight.lr"] == 1e-3
    assert "model" in [c.part for c in report.left_out]


def test_torchtitan_inspect_names_the_parts(titan: Path) -> None:
    doc = ckpttool.inspect(titan / all_in_one.TORCHTITAN_STEP).to_json()
    assert [c["part"] for c in doc["contents"]] == ["model", "optimizer", "lr_scheduler",
                                                    "dataloader", "train_state"]
    rows = {t["name"]: t["part"] for t in doc["tensors"]}
    assert rows["tok_embeddings.weight"] == "model"
    assert rows["optimizer.state.tok_embeddings.weight.exp_avg"] == "optimizer"
    # The dataloader's state is pickled bytes: read as data, never called unsafe.
    loader = [o for o in doc["non_tensor"] if o["part"] == "dataloader"]
    assert loader and all(o["readable"] for o in loader)
    assert doc["summary"]["merged"]["bytes"] == sum(
        t["bytes"] for t in doc["tensors"] if t["part"] == "model")


def test_torchtitan_verify_reads_every_part(titan: Path, tmp_path: Path) -> None:
    ckpt = titan / all_in_one.TORCHTITAN_STEP
    report = ckpttool.verify(ckpt)
    assert report.ok, [p.message for p in report.problems]
    assert report.num_tensors == 72
    merged = ckpttool.merge(ckpt, tmp_path / "m", weights_only=True).out
    optimizer = ckpttool.merge(ckpt, tmp_path / "o", part="optimizer", weights_only=True).out
    # either order: the parts a merge leaves out are neither missing nor extra
    for path, other in ((ckpt, merged), (merged, ckpt), (ckpt, optimizer), (optimizer, ckpt)):
        found = ckpttool.verify(path, against=other)
        assert found.ok, (path, other, [p.message for p in found.problems])
    assert ckpttool.verify(ckpt, against=ckpt).ok  # every part, when both hold them

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    info = dcp.read_info(damaged)
    entry = info.tensor("optimizer.state.layers.1.feed_forward.w2.weight.exp_avg_sq")
    chunk = entry.chunks[0]
    with dcp.open_reader(info) as r:
        flip(damaged / chunk.file, r.payload(entry, chunk).storage_offset + 3)
    found = ckpttool.verify(damaged)
    assert codes(found) == ["crc-mismatch"]
    assert found.problems[0].location.tensor == (
        "optimizer.state.layers.1.feed_forward.w2.weight.exp_avg_sq")

    victim = damaged / "__1_0.distcp"
    shutil.copyfile(ckpt / "__1_0.distcp", victim)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 10)
    assert codes(ckpttool.verify(damaged))[0] == "truncated-file"


# --------------------------------------------------------------------------------------------
# Lightning Fabric


def test_lightning_merge_and_parts(fabric: Path, tmp_path: Path) -> None:
    ckpt = fabric / all_in_one.LIGHTNING_CKPT
    report = ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), reference(fabric))
    left = {(c.part, c.file) for c in report.left_out}
    assert left == {("optimizer", None), ("lr_scheduler", "meta.pt"),
                    ("train_state", "meta.pt"), ("other", "meta.pt")}

    ckpttool.merge(ckpt, tmp_path / "opt", part="optimizer", weights_only=True)
    assert_bit_exact(load(tmp_path / "opt" / "optimizer.safetensors"),
                     optimizer_reference(ckpt))
    groups = json.loads((tmp_path / "opt" / "optimizer.json").read_text())
    assert groups["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]

    doc = ckpttool.inspect(ckpt).to_json()
    assert [(c["part"], c["file"]) for c in doc["contents"]] == [
        ("model", None), ("optimizer", None), ("lr_scheduler", "meta.pt"),
        ("train_state", "meta.pt"), ("other", "meta.pt")]


def test_lightning_verify(fabric: Path, tmp_path: Path) -> None:
    ckpt = fabric / all_in_one.LIGHTNING_CKPT
    assert ckpttool.verify(ckpt).ok
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    meta = damaged / "meta.pt"
    entries = dcp.record_entries(_pread(meta), offset=0,
                                 length=meta.stat().st_size, where=str(meta))
    flip(meta, next(e for e in entries if e.name == "version").data_offset)
    found = ckpttool.verify(damaged)
    assert codes(found) == ["crc-mismatch"]
    assert {p.location.file for p in found.problems if p.severity == "error"} == {"meta.pt"}
    flip(meta, next(e for e in entries if e.name == "data.pkl").data_offset + 1)
    assert not ckpttool.verify(damaged).ok  # a pickle that no longer reads is damage too
    shutil.copyfile(ckpt / "meta.pt", meta)
    victim = damaged / "__0_0.distcp"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 10)
    assert codes(ckpttool.verify(damaged)) == ["truncated-file"]


# --------------------------------------------------------------------------------------------
# DefaultSavePlanner(flatten_state_dict=False)


def test_unflattened_plain_tensors_merge(unflattened: Path, tmp_path: Path) -> None:
    ckpt = unflattened / "plain"
    md = torch_dcp.FileSystemReader(ckpt).read_metadata()
    # How torch stores it: top-level keys only, the nested dict pickled whole in one record.
    assert set(md.state_dict_metadata) == {"model", "step"} and not md.planner_data
    assert type(md.state_dict_metadata["model"]).__name__ == "BytesStorageMetadata"
    ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), reference(unflattened))
    assert ckpttool.verify(ckpt).ok

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    info = dcp.read_info(damaged)
    chunk = info.tensor("model.2.weight").chunks[0]
    flip(damaged / chunk.file, chunk.offset + 1)
    assert codes(ckpttool.verify(damaged)) == ["crc-mismatch"]


def test_unflattened_flat_keys_merge(unflattened: Path, tmp_path: Path) -> None:
    ckpttool.merge(unflattened / "flat", tmp_path / "out", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), reference(unflattened))


def test_unflattened_dtensors_cannot_be_placed(unflattened: Path, tmp_path: Path) -> None:
    ckpt = unflattened / "dtensor"
    with pytest.raises(InputError, match=r"entry '(model|optim)' holds distributed tensors "
                       r"\('torch\.distributed\.tensor\.DTensor'\) pickled whole by one rank"):
        ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert codes(ckpttool.verify(ckpt)).count("tensors-unplaced") == 2
    r = CliRunner().invoke(app, ["merge", "--weights-only", str(ckpt), str(tmp_path / "out2")])
    assert r.exit_code == 3 and "flatten_state_dict=True" in r.stderr


# --------------------------------------------------------------------------------------------
# No model, or not sure which


def test_no_model_tensors_is_an_error_that_says_why(tmp_path: Path) -> None:
    state = {"generator": {"w": torch.ones(2)}, "discriminator": {"w": torch.zeros(2)},
             "step": 3}
    torch_dcp.save(state, checkpoint_id=tmp_path / "gan", no_dist=True)
    with pytest.raises(InputError) as e:
        ckpttool.merge(tmp_path / "gan", tmp_path / "out", weights_only=True)
    assert str(e.value) == (
        f"{tmp_path / 'gan'}: holds no model tensors; it holds train_state (1 non-tensor "
        "entry; keys: step); other (2 tensors; keys: discriminator, generator); the tensors "
        "under discriminator, generator are not recognised as model weights (a model is "
        "stored flat, or under a key such as 'model')")
    assert not (tmp_path / "out").exists()
    assert [c.part for c in discover(tmp_path / "gan").contents()] == ["train_state", "other"]


def test_weights_only_values_are_read(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "empty": b"", "ids": {1, 2}, "frozen": frozenset({3}),
             "buf": bytearray(b"xy"), "z": 1 + 2j, "device": torch.device("cpu", 0),
             "size": torch.Size([2, 3])}
    torch_dcp.save(state, checkpoint_id=tmp_path / "c", no_dist=True)
    values = {o.name: o for o in ckpttool.inspect(tmp_path / "c").non_tensor}
    assert all(o.readable for o in values.values()), values
    assert values["device"].value == "cpu:0" and values["size"].value == [2, 3]
    assert ckpttool.verify(tmp_path / "c").ok


def test_cli_part_option(titan: Path, tmp_path: Path) -> None:
    ckpt = titan / all_in_one.TORCHTITAN_STEP
    runner = CliRunner()
    r = runner.invoke(app, ["merge", "--weights-only", str(ckpt), str(tmp_path / "o"), "--part",
                            "optimizer",
                            "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["part"] == "optimizer" and doc["left_out"][0]["part"] == "model"
    r = runner.invoke(app, ["merge", "--weights-only", str(ckpt), str(tmp_path / "m")])
    assert r.exit_code == 0
    assert ("left out optimizer: 51 tensors, 1.12 MB, 204 non-tensor entries; keys optimizer "
            "(merge it with --part optimizer)") in r.stdout
    r = runner.invoke(app, ["merge", "--weights-only", str(ckpt), str(tmp_path / "x"), "--part",
                            "lr"])
    assert r.exit_code == 2
