"""Remote outputs under faults, against moto's S3 server on localhost, in real processes:
an ``--overwrite`` upload into a prefix that holds a previous output, killed (SIGKILL) and
interrupted (SIGINT) at every step (``CKPTTOOL_TEST_REMOTE_FAULT``), leaves the previous
output, the new one, or no index, and ``verify`` says which; a concurrent writer is refused.

The process killed runs what a remote ``merge`` runs after its local (staged) output is
complete, ``urls.claimed`` then ``urls.upload``, without the merge before it: the steps before
the upload are the local ones, which tests/core/test_faults.py kills at every step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.storage import s3 as remote
from tests.helpers import s3_contents, s3_publish, s3_put_all
from tests.remote.conftest import BUCKET, S3

OLD = "20KB"  # the previous output's shard size
NEW = "35KB"  # the new one's: other shard names, another index


def run(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def state(found: dict[str, bytes], old: dict[str, bytes], new: dict[str, bytes]) -> str:
    """"old", "new" or "no index"; anything else fails."""
    index = "model.safetensors.index.json"
    found = {k: v for k, v in found.items() if k != remote.LOCK_NAME}
    if index not in found:
        return "no index"
    for name, want in (("old", old), ("new", new)):
        if found[index] == want[index]:
            weights = json.loads(want[index])["weight_map"].values()
            assert all(found.get(f) == want[f] for f in set(weights)), f"{name} index, mixed shards"
            return name
    raise AssertionError("an index that is neither the previous nor the new one")


@pytest.fixture(scope="module")
def outputs(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[dict[str, bytes], dict[str, bytes], Path]:
    """The previous output's files, the new one's, and the new one staged locally."""
    tmp = tmp_path_factory.mktemp("faults")
    got = []
    for shard in (OLD, NEW):
        out = tmp / shard
        r = run("merge", llama_ckpt, out, "--max-shard-size", shard, "-q")
        assert r.exit_code == 0, r.output
        got.append({p.name: p.read_bytes() for p in out.iterdir()})
    assert set(got[0]) != set(got[1])
    return got[0], got[1], tmp / NEW


@pytest.mark.slow
def test_overwrite_killed_or_interrupted_at_every_step(
        s3: S3, outputs: tuple[dict[str, bytes], dict[str, bytes], Path],
        tmp_path: Path) -> None:
    old, new, staged = outputs
    prefix = "faults/overwrite"
    url = f"s3://{BUCKET}/{prefix}"
    seen = set()
    steps: dict[str, int] = {}  # the step each way finished at: the same publishing steps
    for how in ("kill", "interrupt"):
        step = 1
        while True:
            s3_put_all(s3, prefix, old)
            if how == "kill":
                p = s3_publish(s3, staged, url, hook=f"kill:{step}")
                p.communicate(timeout=300)
            else:
                mark = tmp_path / f"paused-{step}"
                p = s3_publish(s3, staged, url, hook=f"pause:{step}:{mark}")
                while not mark.exists() and p.poll() is None:
                    time.sleep(0.05)
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
                p.communicate(timeout=300)
            found = s3_contents(s3, prefix)
            seen.add(state(found, old, new))
            # verify says which: either output is OK; shards without their index are not.
            r = run("verify", url)
            if state(found, old, new) == "no index":
                # (index-missing, or two shard sets side by side: several candidates)
                assert r.exit_code in (1, 3) and "verify OK" not in r.output, r.output
            else:
                assert r.exit_code == 0, r.output
            if p.returncode == 0:  # past the last step: it finished
                assert state(found, old, new) == "new" and remote.LOCK_NAME not in found
                steps[how] = step
                break
            if how == "kill":
                assert p.returncode == -signal.SIGKILL
                # The killed run's lock stays; its process has ended, so the next run takes
                # it over (storage/locks.py) and publishes.
                assert remote.LOCK_NAME in found
                if step == 1:
                    again = s3_publish(s3, staged, url)
                    _, err = again.communicate(timeout=300)
                    assert again.returncode == 0, err
                    assert s3_contents(s3, prefix) == new
            else:
                assert p.returncode == 130, p.returncode
                assert remote.LOCK_NAME not in found  # an interrupted run cleans up
                assert s3.uploads_in_progress(BUCKET) == []
                # What it did not replace is still there (config.json was deleted before).
                assert found.get("config.json") == old["config.json"] or \
                    found.get("config.json") == new["config.json"]
            step += 1
    # Interrupted at every step the kill found, not finished early (a run that ignored
    # SIGINT once paused its 60 s, then published: exit 0 at step 1; the hook now ends such
    # a run with its own code, which the loop above refuses).
    assert steps["interrupt"] == steps["kill"] > 2, steps
    assert seen == {"old", "new", "no index"}


def test_a_second_writer_is_refused(s3: S3, llama_ckpt: Path) -> None:
    url = f"s3://{BUCKET}/faults/two"
    lock = remote.Lock(remote.parse(url))
    lock.acquire()
    try:
        r = run("merge", llama_ckpt, url)
        assert r.exit_code == 3
        assert r.output.startswith(f"ckpttool: error: {url}: another ckpttool run is writing "
                                   f"this output ({remote.LOCK_NAME} by ")
        assert s3.keys(BUCKET, "faults/two") == [f"faults/two/{remote.LOCK_NAME}"]
        # A reader is told that what it reads may be incomplete.
        r = run("inspect", url)
        assert "a ckpttool run is writing it, or one was killed while writing it" in r.output
    finally:
        lock.release()
    assert s3.keys(BUCKET, "faults/two") == []
    assert run("merge", llama_ckpt, url, "-q").exit_code == 0
    assert remote.LOCK_NAME not in [k.rsplit("/", 1)[1] for k in s3.keys(BUCKET, "faults/two")]


def _ended_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("how", ["ended process", "no heartbeat"])
def test_a_killed_runs_lock_is_taken_over(how: str, s3: S3, llama_ckpt: Path) -> None:
    """A lock that ``kill -9`` left (issue 34): a process of this host that has ended, or a
    lock not renewed for CKPTTOOL_LOCK_STALE, is removed by the next run, which says so."""
    import socket

    prefix = f"faults/stale-{how.replace(' ', '-')}"
    host, pid = ((socket.gethostname(), _ended_pid()) if how == "ended process"
                 else ("another-host", 4242))
    beat = time.time() - (5 if how == "ended process" else 601)
    s3.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{remote.LOCK_NAME}", Body=json.dumps(
        {"run": f"{host}:{pid}:x", "host": host, "pid": pid, "started": beat, "beat": beat}))
    r = run("merge", llama_ckpt, f"s3://{BUCKET}/{prefix}")
    assert r.exit_code == 0, r.output
    assert f"{remote.LOCK_NAME}: removed the lock of a killed run ({host}:{pid}:x: " in r.output
    assert remote.LOCK_NAME not in [k.rsplit("/", 1)[1] for k in s3.keys(BUCKET, prefix)]


def test_a_live_runs_lock_is_renewed_and_kept(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTTOOL_LOCK_STALE", "0.4")
    url = remote.parse(f"s3://{BUCKET}/faults/renewed")
    lock = remote.Lock(url)
    lock.acquire()
    try:
        key = f"faults/renewed/{remote.LOCK_NAME}"
        first = json.loads(s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        time.sleep(0.6)
        later = json.loads(s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        assert later["run"] == first["run"] and later["beat"] > first["beat"]
        with pytest.raises(ckpttool.OutputError, match="another ckpttool run is writing"):
            remote.Lock(url).acquire()  # renewed, and its process alive: not stale
    finally:
        lock.release()
    assert s3.keys(BUCKET, "faults/renewed") == []
