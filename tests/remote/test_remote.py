"""Every command on s3:// URLs, against a real S3-compatible server (moto's, on localhost):
merge, inspect, verify and reshard from and to it, bit for bit the same as on local copies;
uploads that fail leave no index and no multipart upload behind; bad credentials, a missing
bucket or key are one-line errors (exit 3) that print no secret."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.storage import s3 as remote
from tests.helpers import same_files, same_inspect
from tests.remote.conftest import BUCKET, S3, _free_port, boto3


def run(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def cli(s3: S3, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m ckpttool ARGS`` in a fresh process, credentials in its environment only."""
    full = {**os.environ, **s3.env, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ckpttool", *args], capture_output=True,
                          text=True, env=full, timeout=300)


@pytest.fixture(scope="module")
def local_merged(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "merged"
    r = run("merge", llama_ckpt, out, "--max-shard-size", "20KB")
    assert r.exit_code == 0, r.output
    return out


def test_merge_from_s3_is_bit_exact(remote_llama: str, local_merged: Path,
                                    tmp_path: Path) -> None:
    r = run("merge", "--weights-only", remote_llama, tmp_path / "out", "--max-shard-size", "20KB",
            "--json")
    assert r.exit_code == 0, r.output
    same_files(tmp_path / "out", local_merged)
    doc = json.loads(r.stdout)
    assert doc["src"] == remote_llama
    assert doc["checkpoint"] == f"{remote_llama}/pytorch_model_fsdp_0"
    assert "ckpttool-s3-" not in r.stdout  # no temporary path leaks into the report


def test_slices_read_from_s3_into_a_shared_directory(remote_llama: str, local_merged: Path,
                                                     tmp_path: Path) -> None:
    """A merge shared without a launcher reads its source from object storage: each slice
    reads it by ranged GETs, writes its share, and --finish gives the one-process output."""
    out = tmp_path / "out"
    for how in (["--slice", "1/2"], ["--slice", "0/2"], ["--finish"]):
        r = run("merge", "--weights-only", remote_llama, out, "--max-shard-size", "20KB", *how)
        assert r.exit_code == 0, r.output
    same_files(out, local_merged)


def test_a_slice_into_s3_puts_only_staging(s3: S3, llama_ckpt: Path) -> None:
    """A shared merge into object storage (tests/remote/test_multihost_s3.py): a slice alone
    leaves nothing that reads as an output, only the run's staging prefix."""
    r = run("merge", llama_ckpt, f"s3://{BUCKET}/shared-out", "--slice", "0/2")
    assert r.exit_code == 0, r.output
    listed = s3.client.list_objects_v2(Bucket=BUCKET, Prefix="shared-out/")
    keys = [o["Key"] for o in listed.get("Contents", ())]
    assert keys and all(k.startswith("shared-out/.ckpttool-staging/") for k in keys), keys


def test_merge_to_s3_uploads_the_same_files(s3: S3, llama_ckpt: Path, local_merged: Path,
                                            tmp_path: Path) -> None:
    r = run("merge", llama_ckpt, f"s3://{BUCKET}/out/merged", "--max-shard-size", "20KB")
    assert r.exit_code == 0, r.output
    assert f"-> s3://{BUCKET}/out/merged" in r.stdout
    got = s3.download_dir(BUCKET, "out/merged", tmp_path / "got")
    same_files(got, local_merged)
    assert s3.uploads_in_progress(BUCKET) == []
    # Weights there already: refused without --overwrite, replaced with it (old shards gone).
    again = run("merge", llama_ckpt, f"s3://{BUCKET}/out/merged")
    assert again.exit_code == 3
    assert again.output.count("\n") == 1 and "pass --overwrite" in again.output
    again = run("merge", llama_ckpt, f"s3://{BUCKET}/out/merged", "--overwrite")
    assert again.exit_code == 0, again.output
    names = [k.rsplit("/", 1)[1] for k in s3.keys(BUCKET, "out/merged")]
    assert "model.safetensors" in names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")]


def test_merge_s3_to_s3_from_sharded_safetensors(s3: S3, local_merged: Path,
                                                 tmp_path: Path) -> None:
    url = s3.upload_dir(local_merged, BUCKET, "st/sharded")
    r = run("merge", "--weights-only", url, f"s3://{BUCKET}/st/again", "--max-shard-size", "20KB")
    assert r.exit_code == 0, r.output
    local = tmp_path / "local"
    assert run("merge", "--weights-only", local_merged, local, "--max-shard-size",
               "20KB").exit_code == 0
    same_files(s3.download_dir(BUCKET, "st/again", tmp_path / "got"), local)


def test_inspect_json_matches_local(remote_llama: str, llama_ckpt: Path) -> None:
    same_inspect(remote_llama, llama_ckpt)


def test_verify_and_against(remote_llama: str, local_merged: Path) -> None:
    r = run("verify", remote_llama)
    assert r.exit_code == 0, r.output
    r = run("verify", remote_llama, "--against", local_merged, "--allow-cast")
    assert r.exit_code == 0, r.output
    r = run("verify", local_merged, "--against", remote_llama, "--allow-cast")
    assert r.exit_code == 0, r.output


def test_verify_finds_a_corrupted_object(s3: S3, llama_ckpt: Path, tmp_path: Path) -> None:
    url = s3.upload_dir(llama_ckpt / "pytorch_model_fsdp_0", BUCKET, "bad/dcp")
    data = bytearray((llama_ckpt / "pytorch_model_fsdp_0" / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x40
    s3.client.put_object(Bucket=BUCKET, Key="bad/dcp/__1_0.distcp", Body=bytes(data))
    r = run("verify", url, "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    bad = [p for p in doc["problems"] if p["severity"] == "error"]
    assert bad and all(f"{url}/__1_0.distcp" in p["message"] or p["location"]["file"]
                       == "__1_0.distcp" for p in bad)


def test_reshard_from_and_to_s3(s3: S3, remote_llama: str, llama_ckpt: Path,
                                tmp_path: Path) -> None:
    src = f"{remote_llama}/pytorch_model_fsdp_0"
    r = run("reshard", src, f"s3://{BUCKET}/resharded", "--ranks", "3")
    assert r.exit_code == 0, r.output
    local = tmp_path / "local"
    r = run("reshard", llama_ckpt / "pytorch_model_fsdp_0", local, "--ranks", "3")
    assert r.exit_code == 0, r.output
    # .metadata records where it was saved (storage_meta.checkpoint_id): the merges below
    # compare what it describes.
    same_files(s3.download_dir(BUCKET, "resharded", tmp_path / "got"), local, but=(".metadata",))
    # And the resharded checkpoint merges (from S3) to the same model.
    a, b = tmp_path / "a", tmp_path / "b"
    assert run("merge", "--weights-only", f"s3://{BUCKET}/resharded", a).exit_code == 0
    assert run("merge", "--weights-only", local, b).exit_code == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()



def test_multipart_upload_is_bit_exact(s3: S3, big_model: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "PART", 5 << 20)
    parts: list[int] = []
    real = remote.client(remote.parse("s3://x"))
    upload_part = real.upload_part

    def counting(**kw: object) -> object:
        parts.append(int(kw["PartNumber"]))  # type: ignore[call-overload]
        return upload_part(**kw)

    monkeypatch.setattr(real, "upload_part", counting)
    r = run("merge", "--weights-only", big_model, f"s3://{BUCKET}/big/merged", "--max-shard-size",
            "10MB")
    assert r.exit_code == 0, r.output
    assert len(parts) >= 6  # three 8 MB shards, two parts each
    local = tmp_path / "local"
    assert run("merge", "--weights-only", big_model, local, "--max-shard-size",
               "10MB").exit_code == 0
    same_files(s3.download_dir(BUCKET, "big/merged", tmp_path / "got"), local)


def test_failed_upload_leaves_no_index(s3: S3, big_model: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "PART", 5 << 20)
    real = remote.client(remote.parse("s3://x"))
    upload_part = real.upload_part
    calls: list[int] = []

    def failing(**kw: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the second shard
        return upload_part(**kw)

    monkeypatch.setattr(real, "upload_part", failing)
    r = run("merge", "--weights-only", big_model, f"s3://{BUCKET}/cut/merged", "--max-shard-size",
            "10MB")
    assert r.exit_code != 0
    assert s3.keys(BUCKET, "cut/merged") == []  # no index, and no shard left either
    assert s3.uploads_in_progress(BUCKET) == []  # every multipart upload aborted


def test_missing_bucket_key_and_bad_credentials(s3: S3, remote_llama: str,
                                                tmp_path: Path) -> None:
    r = cli(s3, "inspect", "s3://no-such-bucket/x")
    assert r.returncode == 3, r.stderr
    assert r.stderr == ("ckpttool: error: s3://no-such-bucket/x: bucket 'no-such-bucket' "
                        "does not exist; check the URL (and AWS_ENDPOINT_URL for an "
                        "S3-compatible store)\n")
    r = cli(s3, "merge", f"s3://{BUCKET}/no/such/key", str(tmp_path / "out"))
    assert r.returncode == 3, r.stderr
    assert r.stderr == (f"ckpttool: error: s3://{BUCKET}/no/such/key: no such object or "
                        "prefix; check the URL\n")
    assert not (tmp_path / "out").exists()
    r = cli(s3, "merge", str(tmp_path), "s3://no-such-bucket/out")
    assert r.returncode == 3 and "bucket 'no-such-bucket' does not exist" in r.stderr


@pytest.fixture(scope="module")
def checked_s3(s3: S3) -> Iterator[dict[str, str]]:
    """A second moto server that checks credentials (after its first request, which creates
    a bucket): a key it does not know is refused, as AWS refuses it."""
    port = _free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.1):
                    break
            except OSError:
                time.sleep(0.05)
        boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(
            Bucket="locked")
        yield {"AWS_ENDPOINT_URL": endpoint}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_bad_credentials_are_one_line_without_the_secret(s3: S3, checked_s3: dict[str, str]
                                                         ) -> None:
    secret = "wrong-secret-do-not-print"
    r = cli(s3, "verify", "s3://locked/run", env={**checked_s3, "AWS_ACCESS_KEY_ID":
                                                  "AKIAWRONGWRONG",
                                                  "AWS_SECRET_ACCESS_KEY": secret})
    assert r.returncode == 3, r.stderr
    assert r.stderr.startswith("ckpttool: error: s3://locked/run: access denied while listing")
    assert r.stderr.count("\n") == 1
    assert secret not in r.stderr + r.stdout


def test_no_credentials_at_all(s3: S3, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    r = cli(s3, "inspect", f"s3://{BUCKET}/run", env={
        "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "HOME": str(home),
        "AWS_EC2_METADATA_DISABLED": "true"})
    assert r.returncode == 3, r.stderr
    assert r.stderr == (f"ckpttool: error: s3://{BUCKET}/run: no AWS credentials found; set "
                        "AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                        "~/.aws/credentials\n")


def test_without_the_extra_says_what_to_install(s3: S3, remote_llama: str) -> None:
    code = ("import sys\nsys.modules['boto3'] = None\nfrom ckpttool.cli import main\n"
            f"sys.argv = ['ckpttool', 'inspect', {remote_llama!r}]\nmain()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, **s3.env}, timeout=120)
    assert r.returncode == 4
    assert r.stderr == (f"ckpttool: error: {remote_llama}: object storage needs the s3 extra; "
                        "install it with: pip install 'ckpttool[s3]'\n")


def test_planned_reads_are_coalesced(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A million-chunk plan costs a few GETs: 4096 reads of 1 KB are 1 request."""
    data = os.urandom(4 << 20)
    s3.client.put_object(Bucket=BUCKET, Key="blob/data.distcp", Body=data)
    url = remote.parse(f"s3://{BUCKET}/blob")
    store = remote.RemoteStore(Path("/nonexistent"), url,
                               remote.list_objects(url), ".metadata")
    gets: list[tuple[int, int]] = []
    real = remote.get_range

    def counting(u: remote.Url, offset: int, size: int, etag: str | None = None) -> bytes:
        gets.append((offset, size))
        return real(u, offset, size, etag)

    monkeypatch.setattr(remote, "get_range", counting)
    reads = [("data.distcp", k * 1024, 1000) for k in range(4096)]
    store.plan_reads(reads[::-1])  # in any order
    for f, offset, size in reads:
        assert store.read_exact(f, offset, size, what="x") == data[offset:offset + size]
    store.close()
    assert len(gets) == 1
    # A short object is an error, not a retry loop.
    with pytest.raises(Exception, match="ends at byte"):
        store.read_exact("data.distcp", len(data) - 10, 20, what="tensor 'x'")


def test_a_metadata_is_read_in_place(s3: S3, tiny_dcp: Path, tmp_path: Path) -> None:
    """DCP's .metadata is read through the Stores (issue 37, item 5), by ranged GETs: no
    local copy of it is made, whatever its size."""
    url = s3.upload_dir(tiny_dcp, BUCKET, "bigmeta/model")
    same_inspect(url, tiny_dcp)
    r = run("merge", "--weights-only", url, tmp_path / "remote")
    assert r.exit_code == 0, r.output
    assert run("merge", "--weights-only", tiny_dcp, tmp_path / "local").exit_code == 0
    same_files(tmp_path / "remote", tmp_path / "local")
