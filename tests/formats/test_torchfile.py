"""torch.save files read weights-only, without torch: what torch.load(weights_only=True) reads."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats import torchfile
from ckpttool.formats.base import VIEW, Reader, Tensor
from tests.helpers import RunsCommand


def _bytes(reader: Reader, t: Tensor) -> bytes:
    return reader.read_chunk(t, t.chunks[0])


def _flat(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def test_state_dict_matches_torch_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2, bias=False))
    path = tmp_path / "pytorch_model.bin"
    torch.save(model.state_dict(), path)
    info = torchfile.read_info(path)
    want = torch.load(path, weights_only=True)
    assert [t.name for t in info.tensors] == list(want)
    with torchfile.open_reader(info) as reader:
        for t in info.tensors:
            ref = want[t.name]
            assert t.dtype.torch_name == str(ref.dtype).removeprefix("torch.")
            assert t.shape == tuple(ref.shape)
            assert _bytes(reader, t) == ref.contiguous().view(torch.uint8).numpy().tobytes()
    assert info.objects == ()


def test_views_parameters_odd_dtypes_nesting_and_shared_storage(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    embed = torch.randn(5, 3)
    state = {
        "param": nn.Parameter(torch.ones(3)),
        "rows": base[1:3],  # a view with a storage offset
        "transposed": base.t(),  # not contiguous
        "f8": torch.arange(6, dtype=torch.float32).to(torch.float8_e4m3fn),
        "u16": torch.arange(4).to(torch.uint16),
        "bf16": torch.randn(2, 2).to(torch.bfloat16),
        "flag": torch.tensor(True),
        "model": {"embed": embed, "head": embed},  # tied: one storage
        "step": 7,
        "groups": [{"lr": 0.1, "params": [0, 1]}],
    }
    path = tmp_path / "misc.pt"
    torch.save(state, path)
    info = torchfile.read_info(path)
    want = {k: v for k, v in _flat(torch.load(path, weights_only=True)).items()
            if isinstance(v, torch.Tensor)}
    got = {t.name: t for t in info.tensors}
    assert set(got) == set(want)
    assert got["model.embed"].path == ("model", "embed")
    assert got["model.embed"].chunks[0].offset == got["model.head"].chunks[0].offset
    assert got["transposed"].chunks[0].encoding == VIEW
    with torchfile.open_reader(info) as reader:
        for name, ref in want.items():
            assert got[name].shape == tuple(ref.shape), name
            assert _bytes(reader, got[name]) == ref.contiguous().view(torch.uint8).numpy().tobytes()
        objects = {o.name: reader.read_object(o) for o in info.objects}
    assert objects == {"step": 7, "groups": [{"lr": 0.1, "params": [0, 1]}]}


def test_a_pickle_that_runs_code_is_refused_and_not_run(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    torch.save({"w": torch.ones(2), "x": RunsCommand(f"touch {sentinel}")}, path)
    with pytest.raises(InputError) as e:
        torchfile.read_info(path)
    assert str(e.value) == (
        f"{path}: refused to load: the pickle asks for '{os.system.__module__}.system', which a "
        "weights-only load never allows; the file may be malicious (nothing was executed). Only "
        "a state dict of tensors and plain values can be read")
    assert not sentinel.exists()


def test_legacy_and_foreign_files(tmp_path: Path) -> None:
    legacy = tmp_path / "old.bin"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedError, match="legacy torch.save format"):
        torchfile.read_info(legacy)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"hello")
    with pytest.raises(InputError, match="not a torch.save file"):
        torchfile.read_info(junk)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(UnsupportedError):
        torchfile.read_info(plain)
    assert not torchfile.is_torch_file(plain)


@pytest.mark.parametrize("protocol", [2, 4])
def test_legacy_file_is_named_by_every_command(tmp_path: Path, protocol: int) -> None:
    """Discovery must hand a legacy torch.save file to its format (exit 4 saying what it is),
    not call it "not a checkpoint file"."""
    legacy = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False,
               pickle_protocol=protocol)
    assert torchfile.is_torch_file(legacy)
    for args in (["inspect", str(legacy)], ["merge", str(legacy), str(tmp_path / "out"),
                                            "--weights-only"]):
        r = subprocess.run([sys.executable, "-m", "ckpttool", *args], capture_output=True,
                           text=True, env={**os.environ, "CKPTTOOL_DEBUG": ""})
        assert r.returncode == 4, r.stderr
        assert "legacy torch.save format" in r.stderr and r.stderr.count("\n") == 1


def test_truncated_file_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    torch.save({"w": torch.randn(64, 64)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="no zip end record"):
        torchfile.read_info(path)


def test_reading_does_not_import_torch(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    torch.save({"w": torch.randn(3, 3)}, path)
    code = ("import sys\nfrom ckpttool.formats import torchfile\n"
            f"info = torchfile.read_info({str(path)!r})\n"
            "assert info.tensors[0].shape == (3, 3)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_a_large_optimizer_state_is_read(tmp_path: Path) -> None:
    """~1.1M values once expanded (9 per parameter): far above a non-tensor entry's limit,
    far below a whole file's."""
    import torch

    from ckpttool.formats import torchfile

    n = 120_000
    one = torch.zeros(1)
    state = {"state": {i: {"step": one, "exp_avg": one, "exp_avg_sq": one} for i in range(n)},
             "param_groups": [{"lr": 1e-3, "params": list(range(n))}]}
    torch.save(state, tmp_path / "optimizer.pt")
    info = torchfile.read_info(tmp_path / "optimizer.pt")
    assert len(info.tensors) == 3 * n


def test_two_entries_of_one_dotted_name_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ambiguous.bin"
    torch.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, path)
    with pytest.raises(InputError, match="two entries are both named 'a.b'"):
        torchfile.read_info(path)
