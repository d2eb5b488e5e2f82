"""A remote merge stopped by SIGTERM or SIGHUP cleans up as Ctrl-C does (finding 12 of issue
34): the prefix's lock released, the staged output in TMPDIR removed, exit 143 or 129, one
line that claims no resume (the staging is gone: the same command starts again). A run
killed outright leaves its staging directory; the next remote run removes it and says so,
and never touches the staging of a run that is alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpttool.storage import s3 as remote
from tests.remote.conftest import BUCKET, S3

ROOT = Path(__file__).resolve().parents[2]


def _env(s3: S3, tmpdir: Path, fault: str | None = None) -> dict[str, str]:
    env = {**os.environ, **s3.env, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmpdir)}
    env.pop("CKPTTOOL_TEST_REMOTE_FAULT", None)
    if fault is not None:
        env["CKPTTOOL_TEST_REMOTE_FAULT"] = fault
    return env


def _start(s3: S3, src: Path, url: str, tmpdir: Path, fault: str | None = None
           ) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ckpttool", "merge", "--weights-only",
                             str(src), url, "-q"],
                            env=_env(s3, tmpdir, fault), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _paused(flag: Path, proc: subprocess.Popen[str]) -> None:
    for _ in range(2400):
        if flag.exists() and flag.read_text():
            return
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    raise AssertionError("the run never reached the pause")


def _staging(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith(remote.STAGING_PREFIX))


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_stopped_remote_merge_releases_the_lock_and_its_staging(
        s3: S3, tiny_dcp: Path, tmp_path: Path, sig: signal.Signals, code: int) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    prefix = f"signals/{sig.name}"
    url = f"s3://{BUCKET}/{prefix}"
    flag = tmp_path / "paused"
    proc = _start(s3, tiny_dcp, url, tmpdir, fault=f"pause:1:{flag}")  # the first upload
    _paused(flag, proc)
    assert len(_staging(tmpdir)) == 1
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert stderr == f"ckpttool: interrupted ({sig.name}); no incomplete output was put in place\n"
    assert remote.LOCK_NAME not in [k.rsplit("/", 1)[-1] for k in s3.keys(BUCKET, prefix)]
    assert _staging(tmpdir) == []
    again = _start(s3, tiny_dcp, url, tmpdir)  # not refused: no lock was left
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr


def test_a_killed_runs_staging_is_removed_by_the_next_run(
        s3: S3, tiny_dcp: Path, tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    killed = _start(s3, tiny_dcp, f"s3://{BUCKET}/staging/killed", tmpdir, fault="kill:1")
    killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL
    (left,) = _staging(tmpdir)
    # A live run's staging stays while another run comes and goes.
    flag = tmp_path / "paused"
    alive = _start(s3, tiny_dcp, f"s3://{BUCKET}/staging/alive", tmpdir,
                   fault=f"pause:1:{flag}")
    _paused(flag, alive)
    assert left not in _staging(tmpdir)  # removed by the live run as it started
    live = _staging(tmpdir)
    assert len(live) == 1
    other = _start(s3, tiny_dcp, f"s3://{BUCKET}/staging/other", tmpdir)
    _, stderr = other.communicate(timeout=300)
    assert other.returncode == 0, stderr
    assert _staging(tmpdir) == live
    alive.send_signal(signal.SIGINT)
    alive.communicate(timeout=120)
    assert _staging(tmpdir) == []


def test_the_next_run_says_what_it_removed(s3: S3, tiny_dcp: Path, tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    killed = _start(s3, tiny_dcp, f"s3://{BUCKET}/staging/said", tmpdir, fault="kill:1")
    killed.communicate(timeout=300)
    (left,) = _staging(tmpdir)
    nxt = _start(s3, tiny_dcp, f"s3://{BUCKET}/staging/said-next", tmpdir)
    _, stderr = nxt.communicate(timeout=300)
    assert nxt.returncode == 0, stderr
    assert f"ckpttool: warning: {tmpdir / left}: removed the staging directory (" in stderr
    assert "of a remote output that a killed run left" in stderr
