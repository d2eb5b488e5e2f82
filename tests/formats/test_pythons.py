"""Checkpoints written under every Python the package declares (3.10 to 3.13) and by torch
releases from 2.4 through the floor ``pyproject.toml`` declares (2.6) to the newest (2.15),
read under the Python and torch running the tests: merged bit for bit, verified clean,
inspected, never called "may be malicious". 3.13 pickles every path as
``pathlib._local.PosixPath`` (DCP's ``StorageMeta.checkpoint_id``), which older ckpttool
refused as "may be malicious".

Every directory of ``tests/data/pythons/`` holding a ``versions.json`` is found and replayed
(and ``tests/data/py311``'s DCP, written by Debian 12's Python 3.11.2). All were written once
by ``tests/data/pythons/generate.py`` (2 gloo ranks) into ``pyXY-torchA.B/``; those of torch
2.13.0 (``py310``, ``py312``, ``py313``) predate the torch in the name.

The same file replays them under another torch (the venvs of the generator's docstring, with
ckpttool's own dependencies added), e.g. under the floor, torch 2.6.0 and Python 3.10::

    /work/venvs/torches-26/bin/pip install safetensors typer rich pytest zstandard
    PYTHONPATH=. /work/venvs/torches-26/bin/python -m pytest -q -p no:cacheprovider \
        --noconftest tests/formats/test_pythons.py
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.formats import torchfile
from ckpttool.formats.dcp.metadata import read_metadata_object
from tests.helpers import assert_bit_exact, columns_agree, load_out

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "pythons"
# Every fixture directory, found: pyXY (torch 2.13.0) or pyXY-torchA.B.
FIXTURES = sorted(p.name for p in DATA.iterdir() if (p / "versions.json").is_file())
# ... and Debian 12's Python 3.11.2 (tests/data/py311: a DCP, no plain.pt).
DCPS = {name: DATA / name for name in FIXTURES} | {"py311": DATA.parent / "py311"}
NAME = re.compile(r"py3(\d+)(?:-torch(\d+\.\d+))?")


def _versions(path: Path) -> dict[str, str]:
    versions: dict[str, str] = json.loads((path / "versions.json").read_text())
    return versions


def _release(version: str) -> tuple[int, ...]:
    """(2, 14) of "2.14.1+cu130"."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


def _clean(*args: str) -> None:
    """The CLI exits 0, without a word of malice (a genuine checkpoint is never called
    malicious)."""
    result = CliRunner().invoke(app, list(args))
    said = result.stdout + result.stderr
    assert result.exit_code == 0, (args, said)
    assert "malicious" not in said, (args, said)


def test_fixtures_are_found() -> None:
    """Discovery found them all (else the tests below would pass on fewer)."""
    assert {"py310", "py312", "py313", "py312-torch2.4", "py310-torch2.6", "py311-torch2.9",
            "py311-torch2.14", "py313-torch2.15"} <= set(FIXTURES), FIXTURES


def test_fixtures_stay_small() -> None:
    """A few KB each: a fixture is committed for each Python and torch."""
    for name, path in DCPS.items():
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        assert size < 64 * 1024, (name, size)


@pytest.mark.parametrize("name", FIXTURES)
def test_name_says_the_python_and_torch_that_wrote_it(name: str) -> None:
    versions = _versions(DATA / name)
    match = NAME.fullmatch(name)
    assert match is not None, name
    assert versions["python"].startswith(f"3.{match[1]}."), versions
    torch_release = match[2] or "2.13"  # the first ones predate the torch in the name
    assert _release(versions["torch"]) == _release(torch_release), versions


def test_every_declared_python_and_the_torch_range_have_fixtures() -> None:
    """Each Python from ``requires-python``'s floor to 3.13, and the torch floor
    ``pyproject.toml`` declares, wrote one; so did a torch newer than the pinned one."""
    project = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+: read the two lines
    floor = re.search(r'^requires-python = ">=3\.(\d+)"$', project, re.M)
    torch_floor = re.search(r'^    "torch>=([\d.]+)",$', project, re.M)
    assert floor is not None and torch_floor is not None
    written = [_versions(path) for path in DCPS.values()]
    pythons = {int(v["python"].split(".")[1]) for v in written}
    assert set(range(int(floor[1]), 14)) <= pythons, pythons
    torches = {_release(v["torch"]) for v in written}
    assert _release(torch_floor[1]) in torches, torches
    pinned = next(line.split("==")[1] for line in (ROOT / "constraints.txt").read_text()
                  .splitlines() if line.startswith("torch=="))
    assert max(torches) > _release(pinned), torches


def test_python_313_pickles_paths_as_pathlib_local() -> None:
    """Else the tests below would pass vacuously for the finding they are for."""
    for name in FIXTURES:
        if not name.startswith("py313"):
            continue
        assert b"pathlib._local" in (DATA / name / "dcp" / ".metadata").read_bytes(), name
        assert b"pathlib._local" in (DATA / name / "plain.pt").read_bytes(), name


@pytest.mark.parametrize("name", sorted(DCPS))
def test_dcp_merge_is_exact_verify_and_inspect_clean(name: str, tmp_path: Path) -> None:
    src = DCPS[name] / "dcp"
    ckpttool.merge(src, tmp_path / "out", dtype="keep", weights_only=True)
    want = torch.load(DCPS[name] / "reference.pt", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), want)
    _clean("verify", str(src))
    _clean("inspect", str(src))
    _clean("merge", "--weights-only", "--dtype", "keep", str(src), str(tmp_path / "cli"))
    assert_bit_exact(load_out(tmp_path / "cli"), want)


@pytest.mark.parametrize("name", sorted(DCPS))
def test_both_metadata_readers_agree(name: str) -> None:
    md = DCPS[name] / "dcp" / ".metadata"
    assert columns_agree(md)  # the columns answered, the same as the allow-list
    storage_meta = read_metadata_object(md).storage_meta
    assert storage_meta.field("checkpoint_id").endswith(f"/{DCPS[name].name}/dcp")


@pytest.mark.parametrize("name", FIXTURES)
def test_plain_torch_save_with_inert_values(name: str, tmp_path: Path) -> None:
    path = DATA / name / "plain.pt"
    info = torchfile.read_info(path)
    assert info.values["run_dir"] == "runs/small"
    assert info.values["exit_signal"] == int(signal.SIGTERM)
    assert info.values["args"] == {"lr": 0.5, "exit_signal": int(signal.SIGTERM)}
    ckpttool.merge(path, tmp_path / "out", dtype="keep", weights_only=True)
    want = torch.load(DATA / name / "reference.pt", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), want)
    _clean("verify", str(path))
    _clean("inspect", str(path))
