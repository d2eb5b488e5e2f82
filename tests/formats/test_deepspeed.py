"""DeepSpeed ZeRO-2 / ZeRO-3 checkpoints written by ``engine.save_checkpoint`` on CPU ranks
(:mod:`tests.ds_layouts`), merged bit for bit against DeepSpeed's own consolidation
(``get_fp32_state_dict_from_zero_checkpoint``). The checkpoint tests skip where DeepSpeed is not
installed; the geometry and hostile-pickle tests run everywhere."""

from __future__ import annotations

import json
import math
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner, Result

import ckpttool
from ckpttool.cli import app
from ckpttool.errors import InputError
from ckpttool.formats import deepspeed, registry
from ckpttool.formats.codecs import torchsave
from tests import ds_layouts
from tests.helpers import assert_bit_exact, load_out

needs_deepspeed = pytest.mark.skipif(
    not ds_layouts.DEEPSPEED,
    reason="deepspeed is not installed (pip install deepspeed; DS_BUILD_OPS=0 is enough)")


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="session")
def zero2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-2, bf16, 2 ranks: ``<tmp>/ckpt`` (latest, global_step1/, config.json) and
    ``<tmp>/reference.pt``."""
    if not ds_layouts.DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    return ds_layouts.write_zero(tmp_path_factory.mktemp("zero2") / "ckpt", 2, 2)


@pytest.fixture(scope="session")
def zero3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-3, bf16, 3 ranks (every parameter padded on the last rank)."""
    if not ds_layouts.DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    return ds_layouts.write_zero(tmp_path_factory.mktemp("zero3") / "ckpt", 3, 3)


def reference(ckpt: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own consolidation, in each tensor's stored dtype: zero_to_fp32 upcasts
    floating buffers to fp32, ckpttool keeps what was stored (this fixture's are fp32 already,
    so nothing changes here; a bf16 buffer would round-trip exactly)."""
    want = torch.load(ckpt.parent / "reference.pt", weights_only=True)
    info = deepspeed.read_info(ckpt)
    return {k: v.to(getattr(torch, info.tensor(k).dtype.torch_name)) for k, v in want.items()}


def without_config(ckpt: Path, tmp: Path) -> Path:
    """A copy without config.json (so that the tied pair is written twice, as stored)."""
    dst = tmp / "copy" / ckpt.name
    shutil.copytree(ckpt, dst, ignore=shutil.ignore_patterns("config.json"))
    return dst


# --------------------------------------------------------------------------------------------
# Real checkpoints


@needs_deepspeed
@pytest.mark.parametrize("fixture", ["zero2", "zero3"])
@pytest.mark.parametrize("where", ["top", "tag"])
def test_merge_is_bit_exact_against_deepspeed(fixture: str, where: str,
                                              request: pytest.FixtureRequest,
                                              tmp_path: Path) -> None:
    ckpt: Path = request.getfixturevalue(fixture)
    src = ckpt if where == "top" else ckpt / (ckpt / "latest").read_text().strip()
    report = ckpttool.merge(src, tmp_path / "out", dtype="keep", keep_tied=True, weights_only=True)
    want = reference(ckpt)
    assert report.format == "deepspeed"
    assert_bit_exact(load_out(tmp_path / "out"), want)
    # what the test is about: pieces that start inside rows, frozen and tied parameters
    assert {"mix", "embed_tokens.weight", "lm_head.weight", "norm.weight", "positions"} <= set(want)
    assert want["norm.weight"].dtype == torch.bfloat16 and want["mix"].dtype == torch.float32


@needs_deepspeed
@pytest.mark.parametrize("fixture", ["zero2", "zero3"])
def test_dtype_auto_and_tie_follow_the_config(fixture: str, request: pytest.FixtureRequest,
                                              tmp_path: Path) -> None:
    """config.json says bf16 and tied: the fp32 masters are cast (as Tensor.to rounds), the
    head stored once, as for every other format."""
    ckpt: Path = request.getfixturevalue(fixture)
    report = ckpttool.merge(ckpt, tmp_path / "out", weights_only=True)
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in reference(ckpt).items() if k != "lm_head.weight"}
    assert_bit_exact(load_out(tmp_path / "out"), want, cast=True)
    assert report.tie is not None and "lm_head.weight" in json.dumps(report.tie.to_json())
    assert (tmp_path / "out" / "config.json").exists()


@needs_deepspeed
def test_zero2_pieces_cross_ranks_and_rows(zero2: Path) -> None:
    """Some parameter is split over both ranks' partitions, inside a row."""
    info = deepspeed.read_info(zero2)
    split = [t for t in info.tensors if len(t.files) == 2]
    assert split, [(t.name, t.files) for t in info.tensors]
    assert any(c.sizes[0] == 1 and c.sizes != t.shape[:1] + c.sizes[1:] for t in split
               for c in t.chunks)


@needs_deepspeed
def test_zero3_every_parameter_on_every_rank(zero3: Path) -> None:
    info = deepspeed.read_info(zero3)
    assert info.num_ranks == 3 and info.values["zero_stage"] == 3
    for name in ("mix", "embed_tokens.weight", "up.bias", "norm.weight"):
        assert len(info.tensor(name).files) == 3, name


@needs_deepspeed
@pytest.mark.parametrize("fixture", ["zero2", "zero3"])
def test_verify_alone_finds_a_flipped_parameter_byte(fixture: str,
                                                     request: pytest.FixtureRequest,
                                                     tmp_path: Path) -> None:
    """A parameter's chunks carry no CRC of their own (a partition holds many parameters);
    the partition's CRC is checked once, so verify without --against still finds the flip."""
    ckpt: Path = request.getfixturevalue(fixture)
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    info = deepspeed.read_info(copy)
    chunk = info.tensor("up.weight").chunks[-1]
    with open(copy / chunk.file, "r+b") as f:
        f.seek(chunk.offset + 1)
        b = f.read(1)
        f.seek(chunk.offset + 1)
        f.write(bytes([b[0] ^ 0x10]))
    report = ckpttool.verify(copy)
    found = [p for p in report.problems if p.code == "crc-mismatch"]
    assert not report.ok and [p.location.file for p in found] == [chunk.file], report.problems
    assert run("verify", copy).exit_code == 1


@needs_deepspeed
def test_inspect_json_names_the_format(zero3: Path) -> None:
    r = run("inspect", zero3, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["format"] == "deepspeed" and doc["kind"] == "model"
    names = {t["name"] for t in doc["tensors"]}
    assert set(reference(zero3)) == names


@needs_deepspeed
def test_latest_naming_nothing_is_an_error(zero2: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(zero2, copy)
    (copy / "latest").write_text("global_step7")
    (copy / "global_step7").mkdir()
    assert registry.detect(copy) is deepspeed  # still claimed: the error says what is wrong
    r = run("merge", "--weights-only", copy, tmp_path / "out", "-q")
    assert r.exit_code == 3, r.output
    assert "latest: names 'global_step7', which is not a DeepSpeed checkpoint" in r.output


@needs_deepspeed
def test_missing_rank_is_an_error(zero3: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(zero3, copy)
    victim = next((copy / "global_step1").glob("*zero_pp_rank_2_*optim_states.pt"))
    victim.unlink()
    r = run("merge", "--weights-only", copy, tmp_path / "out", "-q")
    assert r.exit_code == 3, r.output
    assert "rank 2's optimizer-state file is missing" in r.output


@needs_deepspeed
def test_stale_model_state_file_is_refused(zero2: Path, zero3: Path, tmp_path: Path) -> None:
    """param_shapes of one save over partitions of another: never a wrong model."""
    copy = tmp_path / "ckpt"
    shutil.copytree(zero2, copy)
    tag = copy / "global_step1"
    # ZeRO-3's rank files claim a world of 3 beside ZeRO-2's 2 partitions
    for f in (zero3 / "global_step1").glob("*optim_states.pt"):
        if "rank_2" in f.name:
            shutil.copy(f, tag / f.name)
    with pytest.raises(ckpttool.CkptError):
        ckpttool.merge(copy, tmp_path / "out", dtype="keep", weights_only=True)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# --------------------------------------------------------------------------------------------
# Hostile pickles (hand-made bytes), everywhere


def _archive(path: Path, payload: bytes) -> None:
    """A torch.save-shaped zip whose data.pkl is ``payload``."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        stem = path.stem
        z.writestr(f"{stem}/data.pkl", payload)
        z.writestr(f"{stem}/byteorder", b"little")
        z.writestr(f"{stem}/version", b"3\n")


def _global_pickle(module: str, name: str) -> bytes:
    return (b"\x80\x02}q\x00X\x14\x00\x00\x00optimizer_state_dictq\x01c" + module.encode()
            + b"\n" + name.encode() + b"\nq\x02)Rq\x03s.")


@pytest.mark.parametrize(("module", "name", "error", "code"), [
    ("os", "system", "may be malicious", 3),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "a DeepSpeed class", 4),
])
def test_pickle_naming_other_globals_is_refused(module: str, name: str, error: str, code: int,
                                                tmp_path: Path) -> None:
    tag = tmp_path / "global_step1"
    tag.mkdir()
    _archive(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", _global_pickle(module, name))
    _archive(tag / "mp_rank_00_model_states.pt", pickle.dumps({"module": {}}, protocol=2))
    (tmp_path / "latest").write_text("global_step1")
    assert registry.detect(tmp_path) is deepspeed
    r = run("inspect", tmp_path)
    assert r.exit_code == code, r.output
    assert error in r.output and f"{module}.{name}" in r.output


def test_latest_is_never_followed_out(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("../etc")
    assert not deepspeed.detect(tmp_path)
    with pytest.raises(InputError, match="not a tag directory name"):
        deepspeed.read_info(tmp_path)


def test_zero_stage_stand_in_refuses_nonsense() -> None:
    stage = deepspeed.deepspeed_global("deepspeed.runtime.zero.config", "ZeroStageEnum")
    assert stage(3) == 3
    with pytest.raises(pickle.UnpicklingError):
        stage(9)
    # A class of a module not imported: only an Enum member's shape reads (the pickle
    # policy); built any other way it is refused, naming it.
    # Where deepspeed itself is imported (earlier tests run it), the class is there and the
    # lookup refuses it at once (None).
    engine = deepspeed.deepspeed_global("deepspeed.runtime.engine", "DeepSpeedEngine")
    if engine is not None:
        with pytest.raises(torchsave.Refused, match="deepspeed.runtime.engine.DeepSpeedEngine"):
            engine()
    assert deepspeed.deepspeed_global("builtins", "eval") is None


# --------------------------------------------------------------------------------------------
# Geometry


@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_flat_boxes_tile_the_range_in_order(shape: list[int], data: st.DataObject) -> None:
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = list(deepspeed.flat_boxes(tuple(shape), start, stop))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    elements: list[int] = []
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for offsets, sizes in boxes:
        assert all(o + s <= n for o, s, n in zip(offsets, sizes, shape, strict=True))
        assert all(s > 0 for s in sizes)
        first = sum(o * s for o, s in zip(offsets, strides, strict=True))
        box_numel = math.prod(sizes)
        # one contiguous run: the leading dims before the first partial one are single rows
        k = next((d for d in range(len(shape)) if sizes[d] != 1 or all(
            sizes[e] == shape[e] for e in range(d + 1, len(shape)))), len(shape))
        assert all(sizes[e] == shape[e] for e in range(k + 1, len(shape)))
        elements += range(first, first + box_numel)
    assert elements == list(range(start, stop))


def test_flat_boxes_examples() -> None:
    assert list(deepspeed.flat_boxes((11, 6), 38, 66)) == [
        ((6, 2), (1, 4)), ((7, 0), (4, 6))]
    assert list(deepspeed.flat_boxes((3, 5, 7), 0, 105)) == [((0, 0, 0), (3, 5, 7))]
    assert list(deepspeed.flat_boxes((), 0, 1)) == [((), ())]

