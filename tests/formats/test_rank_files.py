"""Per-rank torch.save files (verl's model_world_size_<W>_rank_<R>.pt; accelerate's
pytorch_model_fsdp_0_rank<R>.bin of FSDP2 DTensors and FSDP1 ShardedTensors), merged bit for
bit against the full state dict the ranks gathered themselves (``DTensor.full_tensor()``,
FSDP1's FULL_STATE_DICT)."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner, Result

import ckpttool
from ckpttool.cli import app
from ckpttool.errors import InputError
from ckpttool.formats import rank_files, registry
from ckpttool.formats.base import RAW
from ckpttool.formats.rank_files import pieces
from ckpttool.formats.rank_files import stand_ins as allowed
from tests import layouts
from tests.helpers import assert_bit_exact, load_out
from tests.layouts import CKPT_DIR, rank_file


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="session")
def w1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return layouts.write_single(tmp_path_factory.mktemp("rank-files-w1"))


@pytest.fixture(scope="session")
def fsdp2_w1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return layouts.write_fsdp2(tmp_path_factory.mktemp("rank-files-fsdp2-w1"), 1)


@pytest.fixture(scope="session")
def w2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return layouts.write_fsdp2(tmp_path_factory.mktemp("rank-files-w2"), 2, extras=True)


@pytest.fixture(scope="session")
def w11(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return layouts.write_fsdp2(tmp_path_factory.mktemp("rank-files-w11"), 11)


@pytest.fixture(scope="session")
def mesh_2d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return layouts.write_mesh_2d(tmp_path_factory.mktemp("rank-files-2d"))


CASES = {  # fixture, checkpoint directory, reference
    "world-of-one": ("w1", CKPT_DIR, "reference.pt"),
    "fsdp2-1-rank": ("fsdp2_w1", CKPT_DIR, "reference.pt"),
    "fsdp2-2-ranks": ("w2", CKPT_DIR, "reference.pt"),
    "fsdp2-11-ranks": ("w11", CKPT_DIR, "reference.pt"),
    "replicate-shard1-bf16-plain": ("w2", "placements", "placements_reference.pt"),
    "hsdp-2x2-and-sub-meshes": ("mesh_2d", CKPT_DIR, "reference.pt"),
}


@pytest.mark.parametrize("case", CASES)
def test_merge_is_bit_exact(case: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    fixture, ckpt, reference = CASES[case]
    base: Path = request.getfixturevalue(fixture)
    report = ckpttool.merge(base / ckpt, tmp_path / "out", dtype="keep", weights_only=True)
    want = torch.load(base / reference, weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), want)
    assert report.num_tensors == len(want)


def test_cast_through_the_cli(w11: Path, tmp_path: Path) -> None:
    r = run("merge", "--weights-only", w11 / CKPT_DIR, tmp_path / "out", "--dtype", "bf16", "-q")
    assert r.exit_code == 0, r.output
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in torch.load(w11 / "reference.pt", weights_only=True).items()}
    assert_bit_exact(load_out(tmp_path / "out"), want, cast=True)


def test_ranks_are_ordered_by_number_and_empty_pieces_left_out(w11: Path) -> None:
    info = rank_files.read_info(w11 / CKPT_DIR)
    assert tuple(f.name for f in info.files) == tuple(rank_file(11, r) for r in range(11))
    weight = info.tensor("up.weight")  # 5 rows on 11 ranks: one row on ranks 0-4, none after
    assert [(c.file, c.offsets, c.sizes) for c in weight.chunks] == [
        (rank_file(11, r), (r, 0), (1, 4)) for r in range(5)]
    assert all(c.encoding == RAW for t in info.tensors for c in t.chunks)
    steps = info.tensor("steps")  # a plain buffer: every rank has it, rank 0's copy is used
    assert [c.file for c in steps.chunks] == [rank_file(11, 0)]


def test_rank_files_sort_by_number_not_by_name(tmp_path: Path) -> None:
    for r in (10, 2, 1, 0, 9, 3, 4, 5, 6, 7, 8, 11):
        (tmp_path / rank_file(12, r)).touch()
    (tmp_path / "optim_world_size_12_rank_0.pt").touch()  # verl's optimizer files: not model
    assert [f.rank for f in rank_files.rank_files(tmp_path)] == list(range(12))


def test_found_inside_the_training_directory(w11: Path, tmp_path: Path) -> None:
    report = ckpttool.merge(w11, tmp_path / "out", dtype="keep", weights_only=True)
    assert report.checkpoint == str(w11 / CKPT_DIR)
    assert report.src == str(w11)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_rank_file_is_named(w11: Path, tmp_path: Path) -> None:
    ckpt = _copy(w11 / CKPT_DIR, tmp_path / "ckpt")
    (ckpt / rank_file(11, 10)).unlink()
    (ckpt / rank_file(11, 3)).unlink()
    with pytest.raises(InputError) as e:
        ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    assert str(e.value) == (f"{ckpt / rank_file(11, 3)}: missing (and 1 more); a world of 11 "
                            "needs one file per rank. Copy every rank's file")
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3 and rank_file(11, 3) in r.stderr
    assert not (tmp_path / "out").exists()


def test_world_sizes_must_agree(w2: Path, tmp_path: Path) -> None:
    ckpt = _copy(w2 / CKPT_DIR, tmp_path / "ckpt")
    shutil.copy(ckpt / rank_file(2, 1), ckpt / rank_file(3, 2))
    with pytest.raises(InputError, match=r"rank files of different world sizes \[2, 3\]"):
        rank_files.read_info(ckpt)


def test_renamed_rank_files_are_caught(w2: Path, tmp_path: Path) -> None:
    ckpt = _copy(w2 / CKPT_DIR, tmp_path / "ckpt")
    (ckpt / rank_file(2, 0)).rename(ckpt / "tmp")
    (ckpt / rank_file(2, 1)).rename(ckpt / rank_file(2, 0))
    (ckpt / "tmp").rename(ckpt / rank_file(2, 1))
    with pytest.raises(InputError) as e:
        rank_files.read_info(ckpt)
    assert str(e.value) == (f"{ckpt / rank_file(2, 0)}: written by rank 1 but named for rank 0; "
                            "the rank files were renamed. Restore the original names")


def test_ranks_must_hold_the_same_keys(w2: Path, tmp_path: Path) -> None:
    ckpt = _copy(w2 / CKPT_DIR, tmp_path / "ckpt")
    shutil.copy(w2 / "placements" / rank_file(2, 1), ckpt / rank_file(2, 1))
    with pytest.raises(InputError) as e:
        rank_files.read_info(ckpt)
    assert str(e.value).startswith(f"{ckpt / rank_file(2, 1)}: lacks 'steps' that rank 0 has")


def test_unlisted_global_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = layouts.write_unlisted_global(tmp_path / "ckpt", marker)
    with pytest.raises(InputError) as e:
        ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    assert str(e.value) == (
        f"{ckpt / rank_file(1, 0)}: refused to load: the pickle asks for 'tests.layouts.touch', "
        "which a state dict of tensors and DTensors never contains; the file may be malicious "
        "(nothing was executed)"
    )
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_partial_placement_is_unsupported(w2: Path, tmp_path: Path) -> None:
    r = run("merge", "--weights-only", w2 / "partial", tmp_path / "out")
    assert r.exit_code == 4, r.output
    assert r.stderr == (
        f"ckpttool: error: {w2 / 'partial' / rank_file(2, 0)}: DTensor 'summed' is placed as "
        "Partial on mesh dimension 0; ckpttool merges Shard and Replicate placements only "
        "(redistribute to Shard/Replicate, or save with torch.distributed.checkpoint)\n"
    )


@pytest.mark.parametrize(("folder", "first"), [
    ("fsdp1_local", rank_file(2, 0)),  # verl's names
    ("fsdp1_accelerate", "pytorch_model_fsdp_rank0.bin"),  # accelerate's names
])
def test_fsdp1_local_state_dict_exit_4(folder: str, first: str, w2: Path, tmp_path: Path) -> None:
    r = run("merge", "--weights-only", w2 / folder, tmp_path / "out")
    assert r.exit_code == 4, r.output
    assert r.stderr == (
        f"ckpttool: error: {w2 / folder / first}: FSDP1 LOCAL_STATE_DICT files (flattened "
        "parameters) cannot be merged without the model: load them into the FSDP1-wrapped "
        "model and save again with StateDictType.SHARDED_STATE_DICT (a DCP checkpoint ckpttool "
        "merges) or FULL_STATE_DICT\n"
    )
    assert not (tmp_path / "out").exists()


def test_recognised_by_content_not_by_name(tmp_path: Path) -> None:
    (tmp_path / rank_file(1, 0)).write_text("not a torch.save file")
    assert registry.detect(tmp_path) is None


def test_dtensor_allow_list_still_names_live_torch_classes() -> None:
    """If a torch upgrade moves these, its DTensor files would be refused: fail here first."""
    for module, name in allowed.DTENSOR_GLOBALS:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


@given(
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    mesh=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
)
def test_piece_placement_matches_dtensor(shape: list[int], mesh: list[int],
                                         data: st.DataObject) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    coordinate = [data.draw(st.integers(0, m - 1)) for m in mesh]
    dims = [data.draw(st.one_of(st.none(), st.integers(0, len(shape) - 1))) for _ in mesh]
    stand_ins = []
    for d in dims:
        p = allowed.Replicate() if d is None else allowed.Shard()
        p.__setstate__({} if d is None else {"dim": d})
        stand_ins.append(p)
    got_offsets, got_sizes = pieces._local_box(
        Path("x"), "t", tuple(shape), pieces._Mesh(tuple(mesh), tuple(coordinate)),
        tuple(stand_ins))
    want_sizes, want_offsets = _compute_local_shape_and_global_offset(
        shape, mesh, coordinate, [Replicate() if d is None else Shard(d) for d in dims])
    assert got_sizes == tuple(want_sizes)
    if all(got_sizes):  # DTensor's offset of an empty piece is the end of the dim; unused
        assert got_offsets == tuple(want_offsets)


def test_a_piece_that_is_part_of_its_storage_is_still_crc_checked(w2: Path,
                                                                   tmp_path: Path) -> None:
    ckpt = _copy(w2 / CKPT_DIR, tmp_path / "ckpt")
    info = rank_files.read_info(ckpt)
    # An uneven split: rank 1's piece is a view into a larger local storage.
    chunk = next(c for t in info.tensors for c in t.chunks
                 if c.crc_span is not None and c.crc_span != (c.offset, c.length))
    data = bytearray((ckpt / chunk.file).read_bytes())
    data[chunk.offset] ^= 0x40
    (ckpt / chunk.file).write_bytes(data)
    report = ckpttool.verify(ckpt)
    assert [p.code for p in report.problems if p.severity == "error"] == ["crc-mismatch"]


# --------------------------------------------------------------------------------------------
# Any names: accelerate's save_fsdp_model(..., use_dcp=False), FSDP2 DTensors and FSDP1
# SHARDED_STATE_DICT ShardedTensors, recognised by what the pickles hold


@pytest.fixture(scope="session")
def acc_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return layouts.write_accelerate(tmp_path_factory.mktemp("rank-files-acc-fsdp2"), 3,
                                    fsdp_version=2)


@pytest.fixture(scope="session")
def acc_fsdp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 ranks: rows of 5 and 3 split 2-2-1-0 and 1-1-1-0, so rank 3 holds no shard of them
    return layouts.write_accelerate(tmp_path_factory.mktemp("rank-files-acc-fsdp1"), 4,
                                    fsdp_version=1)


ACC = layouts.ACCELERATE_DIR
acc_file = layouts.accelerate_file


@pytest.mark.parametrize("fixture", ["acc_fsdp2", "acc_fsdp1"])
def test_accelerate_rank_files_merge_bit_exact(fixture: str, request: pytest.FixtureRequest,
                                               tmp_path: Path) -> None:
    base: Path = request.getfixturevalue(fixture)
    r = run("merge", "--weights-only", base / ACC, tmp_path / "out", "--dtype", "keep", "--json")
    assert r.exit_code == 0, r.output
    want = torch.load(base / "reference.pt", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), want)
    info = rank_files.read_info(base / ACC)
    world = 3 if fixture == "acc_fsdp2" else 4
    # The model's files only, by rank: the optimizer's rank files (distributed tensors too),
    # scheduler.bin and random_states_0.pkl beside them are not part of it.
    assert [f.name for f in info.files] == [acc_file(r) for r in range(world)]
    assert info.num_ranks == world and info.format == "rank-files"


def test_fsdp1_shards_sit_where_their_metadata_says(acc_fsdp1: Path) -> None:
    info = rank_files.read_info(acc_fsdp1 / ACC)
    weight = info.tensor("up.weight")  # 5 rows on 4 ranks: 2, 2, 1, none
    assert [(c.file, c.offsets, c.sizes) for c in weight.chunks] == [
        (acc_file(0), (0, 0), (2, 4)), (acc_file(1), (2, 0), (2, 4)),
        (acc_file(2), (4, 0), (1, 4))]
    assert [c.file for c in info.tensor("steps").chunks] == [acc_file(0)]  # a plain buffer


def test_inspect_json_of_fsdp1_sharded(acc_fsdp1: Path) -> None:
    r = run("inspect", acc_fsdp1 / ACC, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["format"] == "rank-files" and doc["summary"]["num_ranks"] == 4
    placements = {t["name"]: t["placement"] for t in doc["tensors"]}
    assert placements["up.weight"] == "Shard(0) x3" and placements["steps"] == "whole"


def test_accelerate_training_directory_found_from_its_parent(acc_fsdp2: Path,
                                                             tmp_path: Path) -> None:
    report = ckpttool.merge(acc_fsdp2, tmp_path / "out", dtype="keep", weights_only=True)
    assert report.checkpoint == str(acc_fsdp2 / ACC)


def test_accelerate_renamed_rank_files_are_caught(acc_fsdp1: Path, acc_fsdp2: Path,
                                                  tmp_path: Path) -> None:
    for base in (acc_fsdp1, acc_fsdp2):
        ckpt = _copy(base / ACC, tmp_path / base.name)
        (ckpt / acc_file(0)).rename(ckpt / "tmp")
        (ckpt / acc_file(1)).rename(ckpt / acc_file(0))
        (ckpt / "tmp").rename(ckpt / acc_file(1))
        with pytest.raises(InputError) as e:
            rank_files.read_info(ckpt)
        assert str(e.value) == (f"{ckpt / acc_file(0)}: written by rank 1 but named for rank "
                                "0; the rank files were renamed. Restore the original names")


def test_accelerate_missing_rank_file_is_named(acc_fsdp1: Path, tmp_path: Path) -> None:
    ckpt = _copy(acc_fsdp1 / ACC, tmp_path / "ckpt")
    (ckpt / acc_file(1)).unlink()
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert r.stderr == (f"ckpttool: error: {ckpt / acc_file(1)}: missing; a world of at least 4 "
                        "needs one file per rank. Copy every rank's file\n")
    assert not (tmp_path / "out").exists()


def test_missing_last_rank_file_is_caught_by_content(acc_fsdp1: Path, acc_fsdp2: Path,
                                                     tmp_path: Path) -> None:
    """The names cannot tell that the last rank is missing; what the writer pickled can."""
    ckpt = _copy(acc_fsdp1 / ACC, tmp_path / "fsdp1")
    (ckpt / acc_file(3)).unlink()
    with pytest.raises(InputError) as e:
        rank_files.read_info(ckpt)
    assert str(e.value) == (f"{ckpt / acc_file(0)}: written by one of 4 ranks, but the files "
                            "here make a world of 3; a rank file is missing or from another "
                            "save. Copy every rank's file")
    ckpt = _copy(acc_fsdp2 / ACC, tmp_path / "fsdp2")
    (ckpt / acc_file(2)).unlink()
    with pytest.raises(InputError, match=r"names rank 2, outside the world of 2 whose rank "
                                         r"files are here; a rank file is missing"):
        rank_files.read_info(ckpt)


def test_two_sets_of_model_rank_files_are_not_guessed(acc_fsdp2: Path, tmp_path: Path) -> None:
    ckpt = _copy(acc_fsdp2 / ACC, tmp_path / "ckpt")
    for r in range(3):  # a second model, as save_fsdp_model(..., model_index=1) names it
        shutil.copy(ckpt / acc_file(r), ckpt / f"pytorch_model_fsdp_1_rank{r}.bin")
    with pytest.raises(InputError) as e:
        ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    assert str(e.value) == (
        f"{ckpt}: holds 2 sets of per-rank model files (pytorch_model_fsdp_0_rank<R>.bin, "
        "pytorch_model_fsdp_1_rank<R>.bin); ckpttool reads one set per directory: move the "
        "files of the one to read into a directory of their own")


def test_other_torch_save_files_are_not_rank_files(acc_fsdp2: Path, tmp_path: Path) -> None:
    """scheduler.bin and a full state dict are torch.save files without distributed tensors:
    the directory is not claimed (the full state dict is then read as torch-save)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(acc_fsdp2 / ACC / "scheduler.bin", ckpt)
    assert not rank_files.detect(ckpt)
    shutil.copy(acc_fsdp2 / "reference.pt", ckpt / "pytorch_model.bin")
    assert registry.detect(ckpt) is None
    assert ckpttool.inspect(ckpt).format == "torch-save"


@pytest.mark.parametrize(("name", "pattern", "rank"), [
    ("pytorch_model_fsdp_0_rank12.bin", "pytorch_model_fsdp_0_rank<R>.bin", 12),
    ("model_world_size_4_rank_3.pt", "model_world_size_4_rank_<R>.pt", 3),
    ("optimizer_0_Rank-2.bin", "optimizer_0_Rank-<R>.bin", 2),
    ("shard_07.pt", "shard_<R>.pt", 7),
    ("model.pt", "model.pt", None),
])
def test_rank_number_in_a_name(name: str, pattern: str, rank: int | None) -> None:
    assert rank_files.name_rank(name) == (pattern, rank)


class _GetAttr:
    """Pickles as getattr(ShardedTensor, "__init__"): a call the allow-list refuses."""

    def __reduce__(self) -> tuple[Any, ...]:
        from torch.distributed._shard.sharded_tensor.api import ShardedTensor

        return (getattr, (ShardedTensor, "__init__"))


def test_getattr_other_than_process_group_state_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2), "x": _GetAttr()}, tmp_path / "model_rank0.bin")
    r = run("inspect", tmp_path)
    assert r.exit_code == 3, r.output
    assert r.stderr == (
        f"ckpttool: error: {tmp_path / 'model_rank0.bin'}: refused to load: the pickle asks "
        "for 'builtins.getattr(ShardedTensor, '__init__')', which a state dict of tensors and "
        "DTensors never contains; the file may be malicious (nothing was executed)\n")


def test_sharded_tensor_allow_list_still_names_live_torch_classes() -> None:
    """If a torch upgrade moves these, FSDP1 sharded files would be refused: fail here first."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    for module, name in allowed._SHARDED_TENSOR_GLOBALS:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    assert hasattr(ShardedTensor, "ProcessGroupState")


def test_one_rank_file_alone_points_at_its_directory(acc_fsdp1: Path) -> None:
    file = acc_fsdp1 / ACC / acc_file(0)
    r = run("merge", "--weights-only", file, acc_fsdp1 / "never")
    assert r.exit_code == 3, r.output
    assert r.stderr == (f"ckpttool: error: {file}: one rank's file of a sharded checkpoint "
                        "(DTensor or ShardedTensor values); pass the directory that holds "
                        f"every rank's file ({acc_fsdp1 / ACC})\n")
    assert not (acc_fsdp1 / "never").exists()


def test_per_rank_optimizer_files_alone_are_unsupported(acc_fsdp2: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for r in range(3):
        shutil.copy(acc_fsdp2 / ACC / acc_file(r, "optimizer"), ckpt)
    r = run("inspect", ckpt)
    assert r.exit_code == 4, r.output
    assert r.stderr == (
        f"ckpttool: error: {ckpt / acc_file(0, 'optimizer')}: per-rank optimizer state (its "
        "keys are ['param_groups', 'state']); ckpttool merges per-rank model files only. Save "
        "the optimizer with torch.distributed.checkpoint (accelerate: use_dcp=True) to merge "
        "it\n")
