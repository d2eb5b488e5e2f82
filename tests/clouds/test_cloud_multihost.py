"""A merge shared by several processes into Google Cloud Storage (fake-gcs-server: parts as
objects, joined by compose in rounds of 32) and Azure Blob Storage (Azurite: staged blocks,
one block list): ``--slice I/N`` as separate processes with their own TMPDIR and working
directory, then ``--finish``; torchrun x3. Bit-exact against a one-process merge; a killed
finish leaves no finished-looking model and the rerun works."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

import ckpttool
from ckpttool.core.merge.multihost import FAIL_ENV
from tests.clouds.conftest import Cloud
from tests.helpers import host_cli, killed_slice_runs_again, same_files

pytestmark = pytest.mark.slow

ROOT = Path(ckpttool.__file__).resolve().parents[1]
PART = str(256 << 10)  # 96 parts of the 24 MB file: GCS composes them in rounds of 32
_N = {"gcs": 0, "azure": 0}


def cli(cloud: Cloud, tmp: Path, *args: str | Path, **env: str
        ) -> subprocess.CompletedProcess[str]:
    return host_cli(cloud.env, PART, tmp, *args, **env)


def fresh(cloud: Cloud, what: str) -> str:
    _N[cloud.name] += 1
    return f"mh-{what}/{_N[cloud.name]}"


def top(cloud: Cloud, prefix: str) -> list[str]:
    return [k[len(prefix) + 1:] for k in cloud.keys(prefix) if "/" not in k[len(prefix) + 1:]]





def test_three_slices_then_finish_bit_exact(cloud: Cloud, big_model: Path, big_alone: Path,
                                            tmp_path: Path) -> None:
    prefix = fresh(cloud, "one")
    url = cloud.url(prefix)
    for i in (2, 0, 1):
        r = cli(cloud, tmp_path / f"h{i}", "merge", "--weights-only", big_model, url,
                "--slice", f"{i}/3")
        assert r.returncode == 0, r.stderr
        assert top(cloud, prefix) == []
    r = cli(cloud, tmp_path / "f", "merge", "--weights-only", big_model, url, "--finish")
    assert r.returncode == 0, r.stderr
    same_files(cloud.download_dir(prefix, tmp_path / "got"), big_alone)


def test_torchrun_three_ranks_bit_exact(cloud: Cloud, llama_ckpt: Path, llama_alone: Path,
                                        tmp_path: Path) -> None:
    prefix = fresh(cloud, "torchrun")
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", FAIL_ENV)}
    full.update(cloud.env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CKPTTOOL_PART_SIZE=PART,
                CKPTTOOL_DIST_TIMEOUT="120")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         "-m", "ckpttool", "merge", str(llama_ckpt), cloud.url(prefix), "--max-shard-size",
         "20KB"], capture_output=True, text=True, timeout=300, env=full, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    same_files(cloud.download_dir(prefix, tmp_path / "got"), llama_alone)


@pytest.mark.parametrize("step", [1, 2, 3, "last"])
def test_a_killed_finish_leaves_no_model_and_the_rerun_works(
        cloud: Cloud, llama_ckpt: Path, llama_alone: Path, tmp_path: Path, step: int | str
        ) -> None:
    """As on S3 (tests/remote/test_multihost_s3.py): killed at each publishing step of
    --finish, no index; the rerun takes the killed run's lock over and completes it."""
    if step == "last":
        weights = [p for p in llama_alone.iterdir() if p.name.endswith(".safetensors")]
        step = len(weights) * 2 + len(list(llama_alone.iterdir())) - len(weights)
    prefix = fresh(cloud, f"kill{step}")
    args = ("merge", llama_ckpt, cloud.url(prefix), "--max-shard-size", "20KB")
    for i in range(2):
        assert cli(cloud, tmp_path / f"h{i}", *args, "--slice", f"{i}/2").returncode == 0
    r = cli(cloud, tmp_path / "f1", *args, "--finish", CKPTTOOL_TEST_REMOTE_FAULT=f"kill:{step}")
    assert r.returncode == -9, r.stderr
    assert "model.safetensors.index.json" not in top(cloud, prefix)
    r = cli(cloud, tmp_path / "f2", *args, "--finish")
    assert r.returncode == 0, r.stderr
    assert "removed the lock of a killed run" in r.stderr, r.stderr
    same_files(cloud.download_dir(prefix, tmp_path / "got"), llama_alone)


@pytest.mark.parametrize("step", [1, 2, 3, 4])
def test_a_slice_killed_at_each_step_is_named_and_run_again(
        cloud: Cloud, big_model: Path, big_alone: Path, tmp_path: Path, step: int) -> None:
    """As on S3: a slice killed before each of its parts and before its record."""
    prefix = fresh(cloud, f"kill-slice-{step}")
    killed_slice_runs_again(partial(cli, cloud), partial(top, cloud, prefix),
                            partial(cloud.download_dir, prefix), tmp_path,
                            ("merge", "--weights-only", big_model, cloud.url(prefix)),
                            {"CKPTTOOL_TEST_REMOTE_FAULT": f"kill:{step}"}, big_alone,
                            may_finish=step == 4)
