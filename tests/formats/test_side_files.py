"""Issue 34 finding 11 (and finding 2): every format's side files are looked at (kind, size)
before they are opened, in the storage layer (``ckpttool.storage.sidefiles``).

A FIFO, a link to ``/dev/zero``, an 8 GB sparse file, 200k-deep JSON or pickle and a tracker
of non-ASCII digits, planted as a side file of checkpoints written by the real writers
(megatron-core, DeepSpeed, torch DCP, transformers' config), make ``inspect``, ``verify`` and
``merge`` exit 3 with one line: never block, never a traceback. Each command runs in a child
process with a deadline, so a regression that blocks fails here instead of hanging.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from ckpttool.errors import InputError
from ckpttool.storage import sidefiles
from tests import ds_layouts
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("inspect", "verify", "merge")
DEADLINE = 120  # s: far above any of these commands on the fixtures; a block is a failure


def cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m ckpttool *args``, forked from a process with torch imported (seconds of
    imports less per run than a fresh interpreter)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPTTOOL_DEBUG": "0"}
    return run_cli([str(a) for a in args], env, timeout=DEADLINE, cwd=cwd)


def _args(command: str, src: Path, tmp: Path) -> list[object]:
    return [command, src, tmp / "out"] if command == "merge" else [command, src]


def _assert_one_line_exit_3(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ckpttool: error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


# --------------------------------------------------------------------------------------------
# What is planted


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def _sparse(path: Path) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(8 << 30)


def _deep_json(path: Path) -> None:
    path.write_text("[" * 200_000 + "]" * 200_000)


HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (_fifo, "is a FIFO, not a regular file"),
    "dev-zero": (_dev_zero, "is a character device, not a regular file"),
    "sparse-8GB": (_sparse, "8,589,934,592 bytes, more than the"),
}


# --------------------------------------------------------------------------------------------
# Megatron-Core: metadata.json, common.pt, the tracker


@pytest.fixture(scope="module")
def megatron_run(megatron_runs: Path) -> Path:
    return megatron_runs / "llama"


def _megatron_copy(megatron_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(megatron_run, run, symlinks=True)
    iters = sorted(run.glob("iter_*"))
    return run, iters[-1]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.parametrize("name", ["metadata.json", "common.pt"])
def test_megatron_side_file_planted(name: str, hostile: str, command: str, megatron_run: Path,
                                    tmp_path: Path) -> None:
    run, it = _megatron_copy(megatron_run, tmp_path)
    if not (it / name).exists():
        pytest.skip(f"this megatron-core writes no {name}")
    plant, says = HOSTILE[hostile]
    plant(it / name)
    r = cli(*_args(command, run, tmp_path), cwd=tmp_path)
    _assert_one_line_exit_3(r, str(it / name), says)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_megatron_deep_metadata_json_is_one_line(command: str, megatron_run: Path,
                                                 tmp_path: Path) -> None:
    run, it = _megatron_copy(megatron_run, tmp_path)
    _deep_json(it / "metadata.json")
    r = cli(*_args(command, run, tmp_path), cwd=tmp_path)
    _assert_one_line_exit_3(r, "nested too deeply")


def _deep_pickle_archive() -> bytes:
    """A torch.save-shaped zip whose data.pkl is ``{"args": [[[...]]]}``, 200k lists deep."""
    n = 200_000
    body = (b"\x80\x02}q\x00X\x04\x00\x00\x00argsq\x01" + b"]" * n + b"a" * (n - 1)
            + b"s.")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", body)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


@pytest.mark.parametrize("command", COMMANDS)
def test_megatron_deep_common_pt_is_one_line(command: str, megatron_run: Path,
                                             tmp_path: Path) -> None:
    run, it = _megatron_copy(megatron_run, tmp_path)
    if not (it / "common.pt").exists():
        pytest.skip("this megatron-core writes no common.pt")
    (it / "common.pt").write_bytes(_deep_pickle_archive())
    r = cli(*_args(command, run, tmp_path), cwd=tmp_path)
    # Read as far as it is safe (or refused): never exit 70, a traceback or a hang.
    assert r.returncode in (0, 1, 3, 4), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_megatron_tracker_planted(hostile: str, command: str, megatron_run: Path,
                                  tmp_path: Path) -> None:
    run, _ = _megatron_copy(megatron_run, tmp_path)
    tracker = run / "latest_checkpointed_iteration.txt"
    HOSTILE[hostile][0](tracker)
    r = cli(*_args(command, run, tmp_path), cwd=tmp_path)
    # Never read: the run's one iteration directory is found as a part of it (exit 0), or
    # the run is refused in one line; never a block, never a traceback.
    assert r.returncode in (0, 3), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 0 or r.stderr.count("ckpttool: error:") == 1, r.stderr


@pytest.mark.parametrize("digits", ["\u0663", "\u00b2", "\uff12", "2\u0663"])
def test_megatron_tracker_of_non_ascii_digits(digits: str, megatron_run: Path,
                                              tmp_path: Path) -> None:
    """'٣'.isdigit() and int('٣') == 3; '²'.isdigit() but int('²') fails: neither is an
    iteration number Megatron writes."""
    run, _ = _megatron_copy(megatron_run, tmp_path)
    (run / "latest_checkpointed_iteration.txt").write_text(digits, encoding="utf-8")
    for command in COMMANDS:
        r = cli(*_args(command, run, tmp_path), cwd=tmp_path)
        _assert_one_line_exit_3(r, "not an iteration number")


# --------------------------------------------------------------------------------------------
# DCP's .metadata, config.json beside it; a DCP data file passed as SRC


def _dcp_copy(llama_ckpt: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(llama_ckpt, ckpt, symlinks=True)
    return ckpt


def _dcp_dir(ckpt: Path) -> Path:
    """The model's DCP directory (the optimizer's reads no config)."""
    dirs = sorted(p.parent for p in ckpt.rglob(".metadata"))
    return next((d for d in dirs if "model" in d.name), dirs[0])


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_dcp_metadata_planted(hostile: str, command: str, llama_ckpt: Path,
                              tmp_path: Path) -> None:
    ckpt = _dcp_copy(llama_ckpt, tmp_path)
    md = _dcp_dir(ckpt) / ".metadata"
    plant, says = HOSTILE[hostile]
    plant(md)
    r = cli(*_args(command, _dcp_dir(ckpt), tmp_path), cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("ckpttool: error:") == 1, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("hostile", ["fifo", "dev-zero", "sparse-8GB", "deep"])
def test_config_json_planted(hostile: str, command: str, llama_ckpt: Path,
                             tmp_path: Path) -> None:
    """A config.json beside the checkpoint that is not a usable file: skipped with a warning
    or refused with one line, never read from a FIFO or device, never exit 70."""
    ckpt = _dcp_copy(llama_ckpt, tmp_path)
    configs = list(ckpt.rglob("config.json"))
    assert configs
    for c in configs:
        if hostile == "deep":
            _deep_json(c)
        else:
            HOSTILE[hostile][0](c)
    r = cli(*_args(command, _dcp_dir(ckpt), tmp_path), cwd=tmp_path)
    assert r.returncode in (0, 1, 3), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    if r.returncode == 0 and command == "merge":
        out = tmp_path / "out" / "config.json"
        assert not out.exists() or out.stat().st_size < (1 << 20)


@pytest.mark.parametrize("command", COMMANDS)
def test_dcp_data_file_as_src_is_refused(command: str, llama_ckpt: Path, tmp_path: Path
                                         ) -> None:
    """Finding 2: rank 0's data file is a valid torch.save archive (its first record); it is
    a piece of the checkpoint, refused naming the directory to pass."""
    dcp_dir = _dcp_dir(llama_ckpt)
    data = sorted(dcp_dir.glob("*.distcp"))[0]
    r = cli(*_args(command, data, tmp_path), cwd=tmp_path)
    _assert_one_line_exit_3(r, f"{data}: a DCP data file",
                            f"pass the DCP directory that holds it: {dcp_dir}")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# DeepSpeed's latest


@pytest.fixture(scope="module")
def zero2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not ds_layouts.DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    return ds_layouts.write_zero(tmp_path_factory.mktemp("zero2") / "ckpt", 2, 2)


@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.slow
def test_deepspeed_latest_planted(hostile: str, zero2: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(zero2, ckpt, symlinks=True)
    HOSTILE[hostile][0](ckpt / "latest")
    for command in COMMANDS:
        r = cli(*_args(command, ckpt, tmp_path), cwd=tmp_path)
        assert r.returncode in (0, 1, 3), r.stderr  # a tag directory may still be found
        assert "Traceback" not in r.stderr, r.stderr


# --------------------------------------------------------------------------------------------
# The storage helpers themselves


def test_sidefiles_check_before_open(tmp_path: Path) -> None:
    kind = sidefiles.Kind("test file", 16)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="is a FIFO, not a regular file; a test file"):
        sidefiles.read_checked(fifo, kind)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 17)
    with pytest.raises(InputError, match="17 bytes, more than the 16 a test file may hold"):
        sidefiles.read_checked(big, kind)
    link = tmp_path / "link"
    link.symlink_to(big)
    with pytest.raises(InputError):
        sidefiles.read_checked(link, sidefiles.Kind("x", 100), nofollow=True)
    assert sidefiles.read_checked(link, sidefiles.Kind("x", 100)) == b"x" * 17
    with pytest.raises(FileNotFoundError):
        sidefiles.read_checked(tmp_path / "missing", kind)


def test_parse_json_deep_and_ascii_numbers(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="nested too deeply"):
        sidefiles.parse_json("[" * 200_000 + "]" * 200_000, tmp_path, next_step="x")
    assert sidefiles.ascii_number("0012") == 12
    for text in ("\u0663", "\u00b2", "", "1 ", "-1", "+1", "1_0"):
        assert sidefiles.ascii_number(text) is None


# --------------------------------------------------------------------------------------------
# config.json swapped for a link to an outside file during a merge: read once, by descriptor


def test_config_json_is_written_as_it_was_read(llama_ckpt: Path, tmp_path: Path,
                                               tmp_path_factory: pytest.TempPathFactory
                                               ) -> None:
    from ckpttool.core.checkpoint.discover import discover

    ckpt = _dcp_copy(llama_ckpt, tmp_path)
    found = discover(_dcp_dir(ckpt))
    config = found.hf.config_path
    assert config is not None and found.hf.config_data is not None
    before = config.read_bytes()
    secret = tmp_path_factory.mktemp("outside") / "secret.json"
    secret.write_text('{"secret": "not the model\'s"}')
    config.unlink()
    config.symlink_to(secret)  # swapped after it was read and checked
    assert found.hf.read(config) == before
    assert not any(secret.parent.is_relative_to(r) for r in found.hf.roots)
    tokenizer = next((p for p in found.hf.files if p.name != "config.json"), None)
    if tokenizer is not None:  # any other side file swapped so is refused when read
        tokenizer.unlink()
        tokenizer.symlink_to(secret)
        with pytest.raises(InputError, match="outside the checkpoint"):
            found.hf.read(tokenizer)
