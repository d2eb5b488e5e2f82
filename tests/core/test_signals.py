"""SIGTERM (Slurm, Kubernetes, systemd, ``timeout``) and SIGHUP (a closed terminal) stop a
merge as Ctrl-C does (finding 12 of issue 34): one line naming the signal, exit 128 + its
number, no temporary file left, OUT the previous output; a large merge keeps its finished
pieces, and the message says so only when they are there."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ckpttool.storage import outputs as fileio
from tests.helpers import fault_merge, output_state, start_fault_merge, wait_for_pause


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129),
                                           (signal.SIGINT, 130)])
@pytest.mark.parametrize("step", [1, 4])
def test_a_stop_signal_cleans_up_like_ctrl_c(tiny_dcp: Path, tmp_path: Path,
                                            sig: signal.Signals, code: int, step: int) -> None:
    out = tmp_path / "out"
    assert fault_merge(tiny_dcp, out, "--max-shard-size", "120").returncode == 0
    before = output_state(out)
    flag = tmp_path / "paused"
    proc = start_fault_merge(tiny_dcp, out, "--overwrite", fault=f"pause:{step}:{flag}")
    wait_for_pause(flag, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    name = "" if sig == signal.SIGINT else f" ({sig.name})"
    assert stderr == (f"ckpttool: interrupted{name}; no incomplete output was put in "
                      "place\n")
    assert not [p.name for p in out.iterdir() if p.name.endswith(fileio.TMP_SUFFIX)]
    assert output_state(out) == before


def test_a_stopped_large_merge_says_it_resumes_and_does(tiny_dcp: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTTOOL_RESUME_PIECE", "64")
    out = tmp_path / "out"
    flag = tmp_path / "paused"
    # Paused creating the index: the pieces are written by then, nothing is put in place.
    proc = start_fault_merge(tiny_dcp, out, "--max-shard-size", "120", fault=f"pause:1:{flag}")
    wait_for_pause(flag, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert stderr == ("ckpttool: interrupted (SIGTERM); no incomplete output was put in place; "
                      f"the finished pieces of the merge are kept in {out}: the same command "
                      "resumes from them\n")
    assert output_state(out) is None
    again = fault_merge(tiny_dcp, out, "--max-shard-size", "120", "--json")
    assert again.returncode == 0, again.stderr
    assert '"done_before"' in again.stdout and output_state(out) is not None


def test_no_resume_is_claimed_where_no_piece_is_kept(tiny_dcp: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    flag = tmp_path / "paused"
    proc = start_fault_merge(tiny_dcp, out, fault=f"pause:1:{flag}")
    wait_for_pause(flag, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "resume" not in stderr
    assert not os.path.exists(out) or not [p for p in out.iterdir()
                                           if p.name.endswith(fileio.TMP_SUFFIX)]
