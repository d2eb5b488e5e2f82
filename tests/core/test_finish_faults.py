"""``--finish`` under faults, in real processes: killed (SIGKILL) or interrupted (SIGINT) at
every publishing step (``CKPTTOOL_TEST_FAULT``), it leaves no index or the finished output,
and the slices' work stays, so that a second ``--finish`` commits exactly what a merge alone
writes. A finish also removes (and names) the slices' temporary files of another plan."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckpttool
from ckpttool.core.merge import multihost

ROOT = Path(ckpttool.__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
SHARD = "10KB"

pytestmark = pytest.mark.slow


def _slices(src: Path, out: Path) -> None:
    for i in range(2):
        ckpttool.merge(src, out, max_shard_size=SHARD, shared=multihost.Slice(i, 2))


def _finish(src: Path, out: Path, fault: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CKPTTOOL_TEST_FAULT=fault)
    return subprocess.Popen([sys.executable, "-m", "ckpttool", "merge", str(src), str(out),
                             "--finish", "--max-shard-size", SHARD, "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


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
        # Either finished (the signal came after the last rename) or without its index.
        if (out / INDEX).exists():
            assert (out / INDEX).read_bytes() == (alone / INDEX).read_bytes()
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
    assert report.distributed["removed_temporary"] == others
    assert not [p for p in out.iterdir() if p.name.endswith(".ckpttool-tmp")]
