"""Remote outputs killed (SIGKILL) during the upload, on GCS and Azure as
tests/remote/test_remote_faults.py does on S3: an ``--overwrite`` upload into a prefix holding
a previous output, killed at several steps (``CKPTTOOL_TEST_REMOTE_FAULT``), leaves the
previous output, the new one or no index; the killed run's lock stays, and the next run takes
it over (its process has ended) and publishes."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.storage import objstore
from tests.clouds.conftest import Cloud
from tests.helpers import start_publish


def publish(cloud: Cloud, staged: Path, url: str, hook: str | None = None
            ) -> subprocess.CompletedProcess[str]:
    p = start_publish(cloud.env, staged, url, hook)
    out, err = p.communicate(timeout=300)
    assert p.returncode is not None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.fixture(scope="module")
def two_outputs(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[dict[str, bytes], dict[str, bytes], Path]:
    tmp = tmp_path_factory.mktemp("cloud-faults")
    got = []
    for shard in ("20KB", "35KB"):
        r = CliRunner().invoke(app, ["merge", str(llama_ckpt), str(tmp / shard),
                                     "--max-shard-size", shard, "-q"])
        assert r.exit_code == 0, r.output
        got.append({p.name: p.read_bytes() for p in (tmp / shard).iterdir()})
    return got[0], got[1], tmp / "35KB"


def test_killed_at_a_step_leaves_old_new_or_no_index(
        cloud: Cloud, two_outputs: tuple[dict[str, bytes], dict[str, bytes], Path]) -> None:
    old, new, staged = two_outputs
    prefix = f"faults/{cloud.name}"
    url = cloud.url(prefix)
    index = "model.safetensors.index.json"
    seen = set()
    for step in (1, 2, 6, 10_000):
        for k in cloud.keys(prefix):
            cloud.delete(k)
        for name, data in old.items():
            cloud.put(f"{prefix}/{name}", data)
        p = publish(cloud, staged, url, hook=f"kill:{step}")
        found = cloud.contents(prefix)
        lock = found.pop(objstore.LOCK_NAME, None)
        if p.returncode == 0:
            assert step == 10_000 and lock is None
            assert found == new
            seen.add("new")
            continue
        assert p.returncode == -signal.SIGKILL, p.stderr
        assert lock is not None  # a killed run's lock stays
        if index not in found:
            seen.add("no index")
        else:
            want = old if found[index] == old[index] else new
            assert found[index] == want[index]
            for f in set(json.loads(want[index])["weight_map"].values()):
                assert found[f] == want[f], f
            seen.add("old" if want is old else "new")
        if step == 1:
            # The killed run's process has ended: the next run takes its lock over
            # (storage/locks.py) and publishes.
            again = publish(cloud, staged, url)
            assert again.returncode == 0, again.stderr
            assert cloud.contents(prefix) == new
    assert seen == {"old", "no index", "new"}
