"""A merge shared by several processes, written straight into S3 (moto's server on localhost):
``--slice I/N`` as separate processes, each with its own TMPDIR and working directory, in any
order, then ``--finish``; torchrun x3 into s3://. Bit-exact against a one-process merge; a
killed slice or finish leaves no finished-looking model, and the rerun works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

import ckpttool
from ckpttool.core.merge.multihost import FAIL_ENV
from tests.helpers import host_cli, killed_slice_runs_again, same_files
from tests.remote.conftest import BUCKET, S3

pytestmark = pytest.mark.slow

ROOT = Path(ckpttool.__file__).resolve().parents[1]
PART = str(5 << 20)  # S3's smallest part


def cli(s3: S3, tmp: Path, *args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
    return host_cli(s3.env, PART, tmp, *args, **env)


def fresh(s3: S3, prefix: str) -> str:
    for key in s3.keys(BUCKET, prefix):
        s3.client.delete_object(Bucket=BUCKET, Key=key)
    for key in s3.uploads_in_progress(BUCKET):
        if key.startswith(prefix + "/"):
            r = s3.client.list_multipart_uploads(Bucket=BUCKET, Prefix=key)
            for u in r.get("Uploads", ()):
                s3.client.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=u["UploadId"])
    return f"s3://{BUCKET}/{prefix}"


def top(s3: S3, prefix: str) -> list[str]:
    """The output's objects, staging left out."""
    return [k[len(prefix) + 1:] for k in s3.keys(BUCKET, prefix)
            if "/" not in k[len(prefix) + 1:]]


def in_progress(s3: S3, prefix: str) -> list[str]:
    return [k for k in s3.uploads_in_progress(BUCKET) if k.startswith(prefix + "/")]





@pytest.mark.parametrize("order", [(2, 0, 1)])
def test_three_slices_then_finish_share_one_file_bit_exact(
        s3: S3, big_model: Path, big_alone: Path, tmp_path: Path, order: tuple[int, ...]
) -> None:
    url = fresh(s3, "mh/one-file")
    for i in order:
        r = cli(s3, tmp_path / f"host{i}", "merge", "--weights-only", big_model, url,
                "--slice", f"{i}/3", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)["distributed"]
        assert doc["slice"] == i and doc["processes"] == 3
        # One part (5 MiB) at a time in the local buffer: under 2x a part.
        assert doc["local_bytes"] < 2 * (5 << 20), doc
        assert not any((tmp_path / f"host{i}" / "tmp").iterdir())
        assert top(s3, "mh/one-file") == []  # nothing reads as a model before --finish
    r = cli(s3, tmp_path / "finisher", "merge", "--weights-only", big_model, url, "--finish",
            "--json")
    assert r.returncode == 0, r.stderr
    got = s3.download_dir(BUCKET, "mh/one-file", tmp_path / "got")
    same_files(got, big_alone)
    assert not in_progress(s3, "mh/one-file")
    assert not s3.keys(BUCKET, "mh/one-file/.ckpttool-staging")


def test_slices_of_a_sharded_model_with_config_bit_exact(
        s3: S3, llama_ckpt: Path, llama_alone: Path, tmp_path: Path) -> None:
    url = fresh(s3, "mh/llama")
    for i in (1, 0, 2):
        r = cli(s3, tmp_path / f"h{i}", "merge", llama_ckpt, url, "--max-shard-size", "20KB",
                "--slice", f"{i}/3")
        assert r.returncode == 0, r.stderr
    r = cli(s3, tmp_path / "f", "merge", llama_ckpt, url, "--max-shard-size", "20KB",
            "--finish")
    assert r.returncode == 0, r.stderr
    same_files(s3.download_dir(BUCKET, "mh/llama", tmp_path / "got"), llama_alone)


def test_finish_names_the_missing_slice(s3: S3, big_model: Path, tmp_path: Path) -> None:
    url = fresh(s3, "mh/missing")
    assert cli(s3, tmp_path / "a", "merge", "--weights-only", big_model, url,
               "--slice", "0/2").returncode == 0
    r = cli(s3, tmp_path / "f", "merge", "--weights-only", big_model, url, "--finish")
    assert r.returncode == 3, r.stderr
    assert "1 of 2 slices are not done (1/2)" in r.stderr and r.stderr.count("\n") == 1
    assert top(s3, "mh/missing") == []
    # The half-done merge keeps its upload for the missing slice; abandoned here, so later
    # tests that count the bucket's uploads in progress see none of it.
    for u in s3.client.list_multipart_uploads(Bucket=BUCKET, Prefix="mh/missing/").get(
            "Uploads", ()):
        s3.client.abort_multipart_upload(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])


def test_torchrun_three_ranks_into_s3_bit_exact(s3: S3, big_model: Path, big_alone: Path,
                                                tmp_path: Path) -> None:
    url = fresh(s3, "mh/torchrun")
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", FAIL_ENV)}
    full.update(s3.env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CKPTTOOL_PART_SIZE=PART,
                CKPTTOOL_DIST_TIMEOUT="120")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         "-m", "ckpttool", "merge", "--weights-only", str(big_model), url], capture_output=True,
        text=True, timeout=300, env=full, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    same_files(s3.download_dir(BUCKET, "mh/torchrun", tmp_path / "got"), big_alone)
    assert not in_progress(s3, "mh/torchrun")


@pytest.mark.parametrize("step", [1, 2, 3, "last"])
def test_a_killed_finish_leaves_no_model_and_the_rerun_works(
        s3: S3, llama_ckpt: Path, llama_alone: Path, tmp_path: Path, step: int | str) -> None:
    """Killed (SIGKILL) at publishing steps of --finish (before and after each weight file is
    completed, before each object put; step 2: a file completed but not yet recorded as
    placed; "last": the index, after every other object is in place): no index (nothing
    reads as a finished model); the same --finish again completes it, bit-exact."""
    if step == "last":
        weights = [p for p in llama_alone.iterdir() if p.name.endswith(".safetensors")]
        step = len(weights) * 2 + len(list(llama_alone.iterdir())) - len(weights)
    prefix = f"mh/kill-finish-{step}"
    url = fresh(s3, prefix)
    args = ("merge", llama_ckpt, url, "--max-shard-size", "20KB")
    for i in range(2):
        assert cli(s3, tmp_path / f"h{i}", *args, "--slice", f"{i}/2").returncode == 0
    r = cli(s3, tmp_path / "f1", *args, "--finish", CKPTTOOL_TEST_REMOTE_FAULT=f"kill:{step}")
    assert r.returncode == -9, r.stderr
    assert "model.safetensors.index.json" not in top(s3, prefix)
    # The killed finish left its lock; its process has ended, so the rerun takes it over
    # (storage/locks.py) and says so: nothing to remove by hand.
    r = cli(s3, tmp_path / "f2", *args, "--finish")
    assert r.returncode == 0, r.stderr
    assert "removed the lock of a killed run" in r.stderr, r.stderr
    same_files(s3.download_dir(BUCKET, prefix, tmp_path / "got"), llama_alone)


def test_a_killed_slice_is_run_again(s3: S3, big_model: Path, big_alone: Path,
                                     tmp_path: Path) -> None:
    prefix = "mh/kill-slice"
    url = fresh(s3, prefix)
    killed_slice_runs_again(partial(cli, s3), partial(top, s3, prefix),
                            partial(s3.download_dir, BUCKET, prefix), tmp_path,
                            ("merge", "--weights-only", big_model, url), {FAIL_ENV: "1:kill"},
                            big_alone)


def test_finish_cleans_and_names_an_abandoned_plan(s3: S3, big_model: Path, big_alone: Path,
                                                   tmp_path: Path) -> None:
    """A slice run with other options (another plan) and abandoned leaves staging and an
    upload in progress; the finish of this plan aborts and removes them, and names them."""
    prefix = "mh/abandoned"
    url = fresh(s3, prefix)
    args = ("merge", "--weights-only", big_model, url)
    assert cli(s3, tmp_path / "x", *args, "--dtype", "fp16", "--slice", "0/2").returncode == 0
    assert in_progress(s3, prefix)
    assert cli(s3, tmp_path / "a", *args, "--slice", "0/1").returncode == 0
    r = cli(s3, tmp_path / "f", *args, "--finish", "--json")
    assert r.returncode == 0, r.stderr
    removed = json.loads(r.stdout)["distributed"]["removed_temporary"]
    assert len(removed) == 1 and removed[0].startswith(".ckpttool-staging/"), removed
    assert not in_progress(s3, prefix)
    assert not s3.keys(BUCKET, f"{prefix}/.ckpttool-staging")
    same_files(s3.download_dir(BUCKET, prefix, tmp_path / "got"), big_alone)


@pytest.mark.parametrize("step", [1, 2, 3, 4])
def test_a_slice_killed_at_each_step_is_named_and_run_again(
        s3: S3, big_model: Path, big_alone: Path, tmp_path: Path, step: int) -> None:
    """A slice killed (SIGKILL) before each of its parts and before its record: nothing reads
    as a model, --finish names the slice, and the slice run again completes it bit-exact."""
    prefix = f"mh/kill-slice-{step}"
    url = fresh(s3, prefix)
    killed_slice_runs_again(partial(cli, s3), partial(top, s3, prefix),
                            partial(s3.download_dir, BUCKET, prefix), tmp_path,
                            ("merge", "--weights-only", big_model, url),
                            {"CKPTTOOL_TEST_REMOTE_FAULT": f"kill:{step}"}, big_alone,
                            may_finish=step == 4)
