"""The fuzz campaign in CI (short), and the damaged inputs it found, one test each.

``CKPTTOOL_FUZZ_N`` sets the number of mutants (default 60: about a minute with the seeds);
``python -m tests.fuzz --n 4000`` runs the long campaign and prints the table.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.errors import InputError
from tests.fuzz.__main__ import campaign_seeds
from tests.fuzz.harness import ROWS, Campaign
from tests.fuzz.mutate import zip_locals

FUZZ_N = int(os.environ.get("CKPTTOOL_FUZZ_N", "60"))
DEEP = b"[" * 100_000 + b"]" * 100_000


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stderr


def _one_error_line(exit_code: int, stderr: str, want: int = 3) -> str:
    assert exit_code == want, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpttool: error: "), stderr
    return lines[0]


@pytest.mark.slow
def test_fuzz_campaign(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every mutant of every seed, through inspect, verify and merge/reshard: no run breaks
    an invariant of the goal column (see tests/fuzz/harness.py)."""
    seeds = campaign_seeds(tmp_path_factory.mktemp("fuzz-seeds"))
    c = Campaign(seeds, campaign=int(os.environ.get("CKPTTOOL_FUZZ_CAMPAIGN", "0")))
    c.run(FUZZ_N)
    assert len(c.records) >= 3 * FUZZ_N - 2  # a hang ends its mutant's remaining runs
    bad = [f"{','.join(rows)}: {rec['mutant']} | {rec['command']} exit {rec['exit']} | "
           f"{'; '.join(rec['outside'])} | "
           f"{rec['stderr'][-300:]}" for rows, rec in c.failures()]
    assert not bad, c.render() + "\n" + "\n".join(bad[:20])
    assert set(c.table()) == {key for key, _ in ROWS}


# --------------------------------------------------------------------------------------------
# What the campaign found (each failed before its fix)


@pytest.fixture
def st_model(tmp_path: Path) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b": torch.ones(4, dtype=torch.bfloat16)}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("where", ["config", "index", "header"])
def test_json_nested_too_deeply_is_exit_3(st_model: Path, where: str) -> None:
    """A config.json, an index or a safetensors header of arrays nested 100,000 deep: exit 3
    and one line (was: RecursionError, exit 70 and a traceback)."""
    if where == "config":
        (st_model / "config.json").write_bytes(DEEP)
    elif where == "index":
        (st_model / "model.safetensors.index.json").write_bytes(
            b'{"metadata": ' + DEEP + b', "weight_map": {"a": "model.safetensors"}}')
    else:
        data = (st_model / "model.safetensors").read_bytes()
        (n,) = struct.unpack_from("<Q", data)
        (st_model / "model.safetensors").write_bytes(
            struct.pack("<Q", len(DEEP)) + DEEP + data[8 + n:])
    line = _one_error_line(*_run("inspect", str(st_model)))
    assert "nested too deeply" in line
    result = CliRunner().invoke(app, ["verify", str(st_model)])
    assert result.exit_code in (1, 3) and "Traceback" not in result.stderr
    assert "nested too deeply" in result.stdout + result.stderr


def _rewrite_metadata(src: Path, dst: Path, change: object) -> Path:
    shutil.copytree(src, dst)
    md = pickle.loads((dst / ".metadata").read_bytes())  # noqa: S301 - the real writer's
    change(md)  # type: ignore[operator]
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    return dst


def test_metadata_claiming_millions_of_chunks_is_refused_at_once(tiny_dcp: Path,
                                                                 tmp_path: Path) -> None:
    """A 2 MB .metadata whose tensor lists one chunk object a million times (pickle memo
    references): refused before any per-chunk work (was: 10 s and exit 0)."""
    def many(md: object) -> None:
        entry = md.state_dict_metadata["model.b"]  # type: ignore[attr-defined]
        entry.chunks[:] = [entry.chunks[0]] * 1_000_000

    ckpt = _rewrite_metadata(tiny_dcp, tmp_path / "ckpt", many)
    line = _one_error_line(*_run("inspect", str(ckpt)))
    assert "lists 1,000,0" in line and "tensor chunks but" in line and "storage records" in line


def test_pickle_errors_of_any_kind_are_corrupt_input(tiny_dcp: Path, tmp_path: Path) -> None:
    """A damaged pickle makes the C unpickler raise OverflowError (a FRAME length beyond any
    buffer) or AttributeError (APPEND on a bool): exit 3, one line (was: exit 70)."""
    ckpt = tmp_path / "dcp"
    shutil.copytree(tiny_dcp, ckpt)
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[:3] + b"\xff" * 8 + data[11:])
    line = _one_error_line(*_run("inspect", str(ckpt)))
    assert "corrupt .metadata" in line

    model = tmp_path / "bin"
    model.mkdir()
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    zin = zipfile.ZipFile(buf)
    with zipfile.ZipFile(model / "pytorch_model.bin", "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            zout.writestr(name, b"\x80\x02\x88K\x01a." if name.endswith("data.pkl")
                          else zin.read(name))
    line = _one_error_line(*_run("inspect", str(model)))
    assert "AttributeError" in line


def test_record_with_no_entries_is_corrupt(tiny_dcp: Path, tmp_path: Path) -> None:
    """A DCP record whose zip end record counts 0 entries: verify reports it, merge exits 3
    (was: ValueError from zip(strict=True), exit 70)."""
    ckpt = tmp_path / "dcp"
    shutil.copytree(tiny_dcp, ckpt)
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    end = data.find(b"PK\x05\x06")
    struct.pack_into("<HH", data, end + 8, 0, 0)
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    code, stderr = _run("verify", str(ckpt))
    assert code == 1 and "Traceback" not in stderr
    _one_error_line(*_run("merge", str(ckpt), str(tmp_path / "out"), "--weights-only"))


def test_rank_files_verify_checks_every_copy(tmp_path: Path) -> None:
    """A flipped bit in rank 1's copy of a plain tensor (an FSDP buffer every rank saves):
    verify finds it by the entry's CRC-32 (was: verify OK, the copy was never read)."""
    from tests import layouts

    src = layouts.write_fsdp2(tmp_path / "verl", 2) / layouts.CKPT_DIR
    file = src / layouts.rank_file(2, 1)
    data = bytearray(file.read_bytes())
    steps = next(e for e in zip_locals(bytes(data)) if e.name.endswith("/data/0"))
    data[steps.data + 3] ^= 0x10
    file.write_bytes(bytes(data))
    code, _ = _run("verify", str(src), "--json")
    assert code == 1
    result = CliRunner().invoke(app, ["verify", str(src)])
    assert "crc-mismatch" in result.stdout and "entry 'data/0'" in result.stdout


def test_error_messages_are_one_line() -> None:
    """An exception text quoted from a damaged file (CPython's persistent-id message holds a
    line break) never makes an error two lines."""
    assert str(InputError("a pickle error,\nbut no persistent_load")) == (
        "a pickle error, but no persistent_load")


def test_numbers_beyond_int64_in_metadata_are_corrupt_input(tiny_dcp: Path,
                                                            tmp_path: Path) -> None:
    """A storage offset of 2**64 + 7 in a valid .metadata pickle: the columnar reader's int64
    columns cannot hold it, the allow-list path says what is wrong (was: OverflowError, exit
    70)."""
    import dataclasses

    def huge(md: object) -> None:
        storage = md.storage_data  # type: ignore[attr-defined]
        key = next(k for k in storage if k.offset is not None)
        storage[key] = dataclasses.replace(storage[key], offset=2**64 + 7)

    ckpt = _rewrite_metadata(tiny_dcp, tmp_path / "ckpt", huge)
    code, stderr = _run("inspect", str(ckpt))  # inspect reads no data: it may list it
    assert code in (0, 3) and "Traceback" not in stderr, stderr
    line = _one_error_line(*_run("merge", str(ckpt), str(tmp_path / "out"), "--weights-only"))
    assert "18446744073709551623" in line or "past the end" in line or "beyond" in line, line


@pytest.mark.parametrize("stride", [-1, -5])
def test_mesh_layout_with_a_negative_stride_places_no_rank(stride: int) -> None:
    """Fuzz campaign 3002, mutant 1676: a rank file whose pickled mesh layout had a stride
    made negative (one opcode replaced) was exit 70 (IndexError) in inspect, verify and merge;
    such a layout is not one ckpttool places ranks in (exit 4, one line)."""
    from ckpttool.formats.rank_files.pieces import _coordinate

    assert _coordinate([((2, stride),)], 2, 0) is None
    assert _coordinate([((2, stride),)], 2, 1) is None
