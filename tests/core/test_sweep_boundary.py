"""Issue 34 findings 7 and 13 and the sweep's "also found" items, on a real training run
(:mod:`tests.runs`: FSDP2 on 2 gloo ranks, a DCP checkpoint per step):

- ``--all`` waits out ``--settle`` for a checkpoint whose structure is complete;
- a checkpoint still being copied (data files missing or short, times kept as ``rsync -a``
  keeps them) is ``waiting``, not ``failed``;
- a step re-saved in place while ``--overwrite`` merges it is never published mixed;
- ``--then`` gets its values as environment variables, never spliced into shell text;
- checkpoint names are escaped on the terminal as every command escapes them.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.core.merge import guards
from ckpttool.core.merge import sweep as sweeps
from ckpttool.core.merge.options import MergeOptions
from ckpttool.core.verify import receipt
from tests.helpers import assert_step_exact

MODEL = "pytorch_model_fsdp_0"


# The run's checkpoints have no config.json: weights without the contract's promise.
WEIGHTS = MergeOptions.of(weights_only=True)
REDO = MergeOptions.of(weights_only=True, overwrite=True)

def _run_of(trained: Path, tmp_path: Path, *steps: int) -> Path:
    """A run holding copies of ``steps`` (times kept, as a copy is not a new write)."""
    run = tmp_path / "run"
    run.mkdir()
    for step in steps:
        shutil.copytree(trained / "run" / f"checkpoint-{step}", run / f"checkpoint-{step}")
    return run


def _states(report: sweeps.SweepReport) -> dict[str, str]:
    return {o.found.name: o.status for o in report.outcomes}


# --------------------------------------------------------------------------------------------
# Finding 7: --all waits out --settle


def test_all_waits_for_a_complete_checkpoint_to_settle(trained: Path, tmp_path: Path) -> None:
    run = _run_of(trained, tmp_path, 1)
    (run / "checkpoint-1" / MODEL / ".metadata").touch()  # written a moment ago
    out = tmp_path / "merged"
    report = sweeps.sweep(run, out, settle=1.5, options=WEIGHTS)
    assert _states(report) == {"checkpoint-1": "merged"}, report.outcomes
    assert report.exit_code == 0
    assert_step_exact(out / "checkpoint-1", trained, 1)


def test_watch_and_dry_run_do_not_wait_for_settle(trained: Path, tmp_path: Path) -> None:
    run = _run_of(trained, tmp_path, 1)
    (run / "checkpoint-1" / MODEL / ".metadata").touch()
    report = sweeps.sweep(run, tmp_path / "merged", settle=600,
                          options=MergeOptions.of(weights_only=True, dry_run=True))
    assert _states(report) == {"checkpoint-1": "waiting"}
    assert "for writes to settle" in (report.outcomes[0].reason or "")


# --------------------------------------------------------------------------------------------
# A copy in progress is waiting, not failed


def test_a_copy_in_progress_is_waiting_not_failed(trained: Path, tmp_path: Path) -> None:
    run = _run_of(trained, tmp_path, 2)
    data = sorted((run / "checkpoint-2" / MODEL).glob("*.distcp"))[-1]
    whole = data.read_bytes()
    stat = data.stat()
    data.write_bytes(whole[: len(whole) // 2])  # rsync -a part way: the original's mtime
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    out = tmp_path / "merged"
    report = sweeps.sweep(run, out, settle=0, options=WEIGHTS)
    (o,) = report.outcomes
    assert (o.status, o.exit_code, report.exit_code) == ("waiting", 0, 0), o.reason
    assert "still being copied or saved" in (o.reason or "")
    assert not (out / "checkpoint-2" / "model.safetensors").exists()
    r = CliRunner().invoke(app, ["merge", "--weights-only",
                                 str(run), str(out), "--all", "--settle", "0"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("waiting     checkpoint-2: ")

    data.write_bytes(whole)  # the copy ends
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    report = sweeps.sweep(run, out, settle=0, options=WEIGHTS)
    assert _states(report) == {"checkpoint-2": "merged"}
    assert_step_exact(out / "checkpoint-2", trained, 2)


def test_an_incomplete_checkpoint_left_for_long_is_failed(trained: Path, tmp_path: Path
                                                          ) -> None:
    run = _run_of(trained, tmp_path, 2)
    data = sorted((run / "checkpoint-2" / MODEL).glob("*.distcp"))[-1]
    data.write_bytes(data.read_bytes()[:100])
    assert sweeps.incomplete(run / "checkpoint-2") is not None
    later = time.time() + sweeps.STALE_SECONDS + 60
    assert sweeps.incomplete(run / "checkpoint-2", now=later) is None
    assert sweeps.incomplete(trained / "run" / "checkpoint-1") is None  # whole


# --------------------------------------------------------------------------------------------
# A step re-saved in place during --overwrite: never a mixed output


def _resave(src: Path, dst: Path) -> None:
    """Rewrite ``dst``'s model in place with ``src``'s files (same names, new bytes)."""
    for p in sorted((src / MODEL).iterdir()):
        with open(dst / MODEL / p.name, "r+b") as f:
            f.truncate(0)
            f.write(p.read_bytes())


def test_a_step_resaved_during_overwrite_is_not_published(trained: Path, tmp_path: Path
                                                          ) -> None:
    run = _run_of(trained, tmp_path, 2)
    out = tmp_path / "merged"
    report = sweeps.sweep(run, out, settle=0, options=WEIGHTS)
    assert _states(report) == {"checkpoint-2": "merged"}
    (run / "checkpoint-2" / "config.json").write_text("{}\n")  # the source changed: redo
    before = (out / "checkpoint-2" / "model.safetensors").read_bytes()

    def writer_resumes() -> None:  # the writer goes on while the merge is about to publish
        _resave(trained / "run" / "checkpoint-3", run / "checkpoint-2")

    with guards.before_publish(writer_resumes):
        report = sweeps.sweep(run, out, settle=0, options=REDO)
    (o,) = report.outcomes
    assert (o.status, report.exit_code) == ("waiting", 0), o.reason
    assert "changed while it was merged" in (o.reason or "")
    assert "nothing was published" in (o.reason or "")
    # The previous output is untouched; no receipt vouches for anything new.
    assert (out / "checkpoint-2" / "model.safetensors").read_bytes() == before
    assert not (out / "checkpoint-2" / receipt.RECEIPT_NAME).exists()
    assert not list((out / "checkpoint-2").glob(".*ckpttool-tmp"))

    # Once the save is over, the next sweep merges what is there now (step 3's weights).
    again = sweeps.sweep(run, out, settle=0, options=REDO)
    assert _states(again) == {"checkpoint-2": "merged"}
    assert_step_exact(out / "checkpoint-2", trained, 3)


# --------------------------------------------------------------------------------------------
# Finding 13: --then never splices values into shell text

HOSTILE = "checkpoint-7$(touch${IFS}x)"


def _hostile_run(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(trained / "run" / "checkpoint-1", run / HOSTILE)
    return run


@pytest.mark.parametrize("command", ['echo "{out}" > log', "echo {out} > log",
                                     "echo '{name}' > log", 'echo "{step}{src}"'])
def test_then_placeholders_are_refused(command: str, trained: Path, tmp_path: Path) -> None:
    run = _hostile_run(trained, tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(app, ["merge", "--weights-only",
                                     str(run), str(tmp_path / "merged"), "--all",
                                     "--settle", "0", "--then", command])
    finally:
        os.chdir(old)
    assert r.exit_code == 2, r.output
    assert "is not replaced" in r.stderr and "$CKPTTOOL_" in r.stderr
    assert not (cwd / "x").exists() and not (tmp_path / "merged").exists()


def test_then_gets_values_in_its_environment(trained: Path, tmp_path: Path) -> None:
    run = _hostile_run(trained, tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = tmp_path / "merged"
    command = ('printf "%s|%s|%s|%s" "$CKPTTOOL_OUT" "$CKPTTOOL_SRC" "$CKPTTOOL_STEP" '
               '"$CKPTTOOL_NAME" > log')
    old = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(app, ["merge", "--weights-only",
                                     str(run), str(out), "--all", "--settle", "0",
                                     "--then", command])
    finally:
        os.chdir(old)
    assert r.exit_code == 0, r.output
    assert not (cwd / "x").exists()  # the name's $(...) never ran
    assert (cwd / "log").read_text() == f"{out / HOSTILE}|{run / HOSTILE}|7|{HOSTILE}"


# --------------------------------------------------------------------------------------------
# Names escaped on the terminal


def test_sweep_lines_escape_names(trained: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    name = "checkpoint-5\x1b[2J\nmerged      checkpoint-9 -> forged"
    shutil.copytree(trained / "run" / "checkpoint-1", run / name)
    r = CliRunner().invoke(app, ["merge", "--weights-only",
                                 str(run), str(tmp_path / "merged"), "--all",
                                 "--settle", "0"])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.stdout
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("merged      checkpoint-5\\x1b[2J\\nmerged")
