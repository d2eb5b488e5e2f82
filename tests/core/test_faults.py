"""Faults while writing: two runs into one OUT, kill -9 at every publishing step of
``--overwrite``, Ctrl-C at any moment, fsync before publishing.

Each run is a real ``python -m ckpttool`` process; the fault is placed with the test hook of
:mod:`ckpttool.storage.outputs` (``CKPTTOOL_TEST_FAULT=kill:K`` / ``pause:K:FILE``), which counts
publishing steps (an output file created, fsync'ed, renamed, unlinked).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpttool.storage import outputs as fileio
from tests.helpers import (
    INDEX,
    fault_merge,
    output_state,
    start_fault_merge,
    wait_for_pause,
)

LAYOUTS = {"single": (), "sharded": ("--max-shard-size", "120"),
           "sharded-other": ("--max-shard-size", "200")}


def _write_layouts(src: Path, tmp: Path) -> dict[str, bytes]:
    """Each output layout of ``src`` in ``tmp/<layout>``, written once; returns the model."""
    states = []
    for name, args in LAYOUTS.items():
        done = fault_merge(src, tmp / name, *args)
        assert done.returncode == 0, done.stderr
        states.append(output_state(tmp / name))
    assert len(list((tmp / "sharded").glob("model-*.safetensors"))) > 2
    assert states[0] is not None and states[0] == states[1] == states[2]
    return states[0]


@pytest.mark.parametrize(("old", "new"), [("sharded", "single"), ("sharded", "sharded-other")])
@pytest.mark.slow
def test_kill_at_every_publishing_step_leaves_no_mixed_output(
        tiny_dcp: Path, tmp_path: Path, old: str, new: str) -> None:
    """kill -9 at each step of an --overwrite merge: OUT is never a finished-looking set
    that mixes the two outputs (an index whose shards do not hold what it lists, or
    model.safetensors beside an index); it is the previous output, the new one, or nothing
    finished. Before the previous index was removed first, the new shards stood beside it."""
    reference = _write_layouts(tiny_dcp, tmp_path / "ref")
    out = tmp_path / "out"
    seen_kill = 0
    for k in range(1, 60):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(tmp_path / "ref" / old, out)
        done = fault_merge(tiny_dcp, out, *LAYOUTS[new], "--overwrite", fault=f"kill:{k}")
        if done.returncode == 0:
            assert output_state(out) == reference
            break
        assert done.returncode == -signal.SIGKILL, done.stderr
        seen_kill += 1
        state = output_state(out)
        assert state is None or state == reference, f"step {k}: a model with other values"
    else:
        raise AssertionError("the merge never finished")
    assert seen_kill >= 6  # creates, fsyncs, renames and unlinks were all stepped on


@pytest.mark.parametrize("step", [1, 2, 3, 4, 6])
def test_ctrl_c_at_any_step_exits_130_and_cleans_up(tiny_dcp: Path, tmp_path: Path,
                                                   step: int) -> None:
    """SIGINT while the output is written (step 1: creating model.safetensors) or published
    (2: its fsync, 3: removing the previous index, 4: the rename, 6: removing a previous
    shard): exit 130, one line, no temporary file left, and OUT the previous output or the new
    one, whole."""
    out = tmp_path / "out"
    assert fault_merge(tiny_dcp, out, "--max-shard-size", "120").returncode == 0
    before = output_state(out)
    flag = tmp_path / "paused"
    proc = start_fault_merge(tiny_dcp, out, "--overwrite", fault=f"pause:{step}:{flag}")
    wait_for_pause(flag, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.strip().count("\n") == 0 and "interrupted" in stderr
    assert not [p.name for p in out.iterdir() if p.name.endswith(fileio.TMP_SUFFIX)]
    assert output_state(out) == before  # the same tensors, whichever layout holds them


def test_second_run_into_the_same_out_refuses(tiny_dcp: Path, tmp_path: Path) -> None:
    """Two merges into one OUT: while the first writes, the second exits 3 with one line
    (before, both exited 0 and OUT held files of each); once the first is done, the second
    finds its output (no --overwrite) and refuses too; a killed run's lock is gone with it."""
    out = tmp_path / "out"
    flag = tmp_path / "paused"
    first = start_fault_merge(tiny_dcp, out, fault=f"pause:2:{flag}")
    wait_for_pause(flag, first)
    second = fault_merge(tiny_dcp, out, "--max-shard-size", "120")
    assert second.returncode == 3
    assert second.stderr == (f"ckpttool: error: {out}: another ckpttool process is writing "
                             "into this directory; wait for it to finish or choose another "
                             "output directory\n")
    first.kill()
    first.wait()
    third = fault_merge(tiny_dcp, out)  # the kernel dropped the killed run's lock
    assert third.returncode == 0, third.stderr
    fourth = fault_merge(tiny_dcp, out, "--max-shard-size", "120")
    assert fourth.returncode == 3 and "pass --overwrite" in fourth.stderr


def test_lock_is_rechecked_under_the_lock(tiny_dcp: Path, tmp_path: Path) -> None:
    """A run that looked at OUT before another filled it looks again once it holds the lock
    (without --overwrite it never replaces what the other wrote)."""
    out = tmp_path / "out"
    out.mkdir()
    calls: list[str] = []

    def check() -> None:
        calls.append("checked")
        raise fileio.OutputError("taken")

    with pytest.raises(fileio.OutputError, match="taken"), fileio.AtomicOutputs(out, check=check):
        pass
    assert calls == ["checked"]
    with fileio.AtomicOutputs(out) as outputs:  # the lock was released with the failure
        outputs.write_bytes("a", b"x")
        outputs.commit()
    assert (out / "a").read_bytes() == b"x"


def test_files_and_directory_are_synced_before_the_index_is_published(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every output file, then the directory, reach the disk before the index's rename (a
    power cut must not publish a name whose data never got there)."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
        events.append("rename " + Path(b).name)
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "out"
    out.mkdir()
    with fileio.AtomicOutputs(out) as outputs:
        outputs.write_bytes("model-00001-of-00002.safetensors", b"1")
        outputs.write_bytes(INDEX, b"{}")
        outputs.write_bytes("model-00002-of-00002.safetensors", b"2")
        outputs.commit(last=(INDEX,))
    pid = os.getpid()
    assert events == [
        f"fsync .model-00001-of-00002.safetensors.{pid}{fileio.TMP_SUFFIX}",
        f"fsync .{INDEX}.{pid}{fileio.TMP_SUFFIX}",
        f"fsync .model-00002-of-00002.safetensors.{pid}{fileio.TMP_SUFFIX}",
        "rename model-00001-of-00002.safetensors",
        "rename model-00002-of-00002.safetensors",
        "fsync out",
        f"rename {INDEX}",
        "fsync out",
    ]


def test_fsync_can_be_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CKPTTOOL_FSYNC=0``: no sync at all (scratch outputs)."""
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    monkeypatch.setenv("CKPTTOOL_FSYNC", "0")
    with fileio.AtomicOutputs(tmp_path) as outputs:
        outputs.write_bytes("a", b"x")
        outputs.commit()
    assert synced == [] and (tmp_path / "a").read_bytes() == b"x"


def test_a_pause_that_no_signal_ends_exits_with_its_own_code(tmp_path: Path) -> None:
    """The pause hook waits for the test's signal; when none comes, the run ends with a code
    of its own rather than publish as if interrupted (a test that lost its signal fails)."""
    flag = tmp_path / "paused"
    code = ("from ckpttool.storage import outputs as o; o.PAUSE_LIMIT_S = 0.2; o._step(); "
            "print('went on')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "CKPTTOOL_TEST_FAULT": f"pause:1:{flag}"})
    assert done.returncode == fileio.PAUSE_EXPIRED_EXIT, done.stderr
    assert done.stdout == "" and "no signal came" in done.stderr
    assert flag.read_text().isdigit()  # the pid, where the test waits for it
