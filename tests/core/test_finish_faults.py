"""``--finish`` and ``reshard --overwrite`` under faults, in real processes.

Killed (SIGKILL) or interrupted (SIGINT) at every publishing step (``CKPTTOOL_TEST_FAULT``),
``--finish`` leaves no index or the finished output, and the slices' work stays, so that a
second ``--finish`` commits exactly what a merge alone writes; it also removes (and names) the
slices' temporary files of another plan. ``reshard --overwrite`` killed or interrupted at every
step leaves the previous output, the new one, or no ``.metadata``. After each, ``verify`` says
which: OK for either output, incomplete without the index."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.core.merge import multihost
from tests.helpers import ForkedCli

ROOT = Path(ckpttool.__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
SHARD = "10KB"

pytestmark = pytest.mark.slow


def _slices(src: Path, out: Path) -> None:
    for i in range(2):
        ckpttool.merge(src, out, max_shard_size=SHARD, shared=multihost.Slice(i, 2),
                       weights_only=True)


def _finish(src: Path, out: Path, fault: str) -> ForkedCli:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CKPTTOOL_TEST_FAULT=fault)
    return ForkedCli(["merge", str(src), str(out), "--finish", "--max-shard-size", SHARD, "-q"],
                     env)


def _same(a: Path, b: Path) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        assert (b / p.name).read_bytes() == p.read_bytes(), p.name


@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_finish_killed_or_interrupted_at_every_step(llama_ckpt: Path, tmp_path: Path,
                                                    how: str) -> None:
    alone = tmp_path / "alone"
    ckpttool.merge(llama_ckpt, alone, max_shard_size=SHARD)
    out = tmp_path / "out"
    step = 1
    while True:
        shutil.rmtree(out, ignore_errors=True)
        _slices(llama_ckpt, out)
        if how == "kill":
            p = _finish(llama_ckpt, out, f"kill:{step}")
            p.communicate(timeout=300)
        else:
            mark = tmp_path / f"paused-{step}"
            p = _finish(llama_ckpt, out, f"pause:{step}:{mark}")
            while not mark.exists() and p.poll() is None:
                time.sleep(0.05)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
            p.communicate(timeout=300)
        if p.returncode == 0:  # past the last step
            assert step > 3
            _same(alone, out)
            break
        assert p.returncode == (-signal.SIGKILL if how == "kill" else 130), p.returncode
        # Either finished (the signal came after the last rename) or without its index,
        # which verify says (never "verify OK" on shards put in place without their index).
        if (out / INDEX).exists():
            assert (out / INDEX).read_bytes() == (alone / INDEX).read_bytes()
        elif [q for q in out.iterdir() if not q.name.startswith(".")]:
            r = CliRunner().invoke(app, ["verify", str(out)])
            assert r.exit_code in (1, 3), r.output
            assert "index-missing" in r.output or "no model.safetensors" in r.output, r.output
        # The slices' work is still there: a second --finish commits it.
        ckpttool.merge(llama_ckpt, out, max_shard_size=SHARD, shared=multihost.Finish())
        _same(alone, out)
        step += 1


def test_finish_removes_other_plans_temporary_files(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckpttool.merge(llama_ckpt, out, max_shard_size="20KB", shared=multihost.Slice(0, 2))
    others = sorted(p.name for p in out.iterdir())
    assert others and all(n.endswith(".ckpttool-tmp") for n in others)
    _slices(llama_ckpt, out)
    report = ckpttool.merge(llama_ckpt, out, max_shard_size=SHARD, shared=multihost.Finish())
    assert report.distributed is not None
    assert report.distributed.removed_temporary == others
    assert not [p for p in out.iterdir() if p.name.endswith(".ckpttool-tmp")]


def _dcp_state(out: Path) -> dict[str, bytes] | None:
    """The files of a finished-looking DCP output (None without .metadata)."""
    if not (out / ".metadata").exists():
        return None
    return {p.name: p.read_bytes() for p in out.iterdir() if not p.name.endswith(".ckpttool-tmp")}


def _which(state: dict[str, bytes] | None, old: dict[str, bytes] | None,
           new: dict[str, bytes] | None) -> str:
    """"none", "old" or "new" (a .metadata names a save id, so the new one is told by its data
    files); a mixed output fails."""
    assert old is not None and new is not None
    if state is None:
        return "none"
    data = {k: v for k, v in state.items() if k != ".metadata"}
    if state[".metadata"] == old[".metadata"]:
        assert data == {k: v for k, v in old.items() if k != ".metadata"}, "old index, mixed"
        return "old"
    assert data == {k: v for k, v in new.items() if k != ".metadata"}, "new index, mixed"
    return "new"


@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_reshard_overwrite_killed_or_interrupted_at_every_step(llama_ckpt: Path, tmp_path: Path,
                                                               how: str) -> None:
    refs = {}
    for ranks in ("2", "3"):
        ref = tmp_path / f"ref{ranks}"
        ckpttool.reshard(llama_ckpt, ref, ranks=int(ranks))
        refs[ranks] = _dcp_state(ref)
    out = tmp_path / "out"
    seen = set()
    for step in range(1, 80):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(tmp_path / "ref2", out)
        mark = tmp_path / f"paused-{step}"
        fault = f"kill:{step}" if how == "kill" else f"pause:{step}:{mark}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), CKPTTOOL_TEST_FAULT=fault)
        p = ForkedCli(["reshard", str(llama_ckpt), str(out), "--ranks", "3", "--overwrite",
                       "-q"], env)
        if how == "interrupt":
            while not mark.exists() and p.poll() is None:
                time.sleep(0.05)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        _, stderr = p.communicate(timeout=300)
        state = _which(_dcp_state(out), refs["2"], refs["3"])
        if p.returncode == 0:
            assert state == "new"
            break
        assert p.returncode == (-signal.SIGKILL if how == "kill" else 130), stderr
        if how == "interrupt":
            assert stderr.count("\n") == 1 and "interrupted" in stderr, stderr
            assert not [q for q in out.iterdir() if q.name.endswith(".ckpttool-tmp")]
        seen.add(state)
        # verify says which: the previous or the new output is OK, none is incomplete.
        r = CliRunner().invoke(app, ["verify", str(out)])
        assert r.exit_code == (0 if state in ("old", "new") else 3), r.output
        if state == "none" and list(out.glob("*.distcp")):
            assert "the copy is incomplete" in r.output, r.output
    else:
        raise AssertionError("reshard never finished")
    if how == "kill":
        assert {"old", "none"} <= seen
    else:  # a Ctrl-C while the output is published waits for it (torch's threads included)
        assert seen == {"old", "new"}
