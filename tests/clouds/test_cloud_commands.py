"""Every command on gs:// and az:// URLs, against the emulators (fake-gcs-server, Azurite):
merge, inspect, verify and reshard from and to each store, bit for bit the same as on local
copies; an object changed while read, an interrupted upload, bad credentials, a missing
bucket or key are one-line errors (exit 3) that leave nothing behind and print no secret."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.errors import InputError
from ckpttool.storage import objstore, outputs
from ckpttool.storage.objtree import ObjectTree
from tests.clouds.conftest import BUCKET, Cloud
from tests.helpers import same_files, same_inspect

_PREFIXES = {"gcs": 0, "azure": 0}


def run(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def cli(cloud: Cloud, *args: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """``python -m ckpttool ARGS`` in a fresh process, the store's settings in its
    environment only."""
    full = {**os.environ, **cloud.env, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ckpttool", *args], capture_output=True,
                          text=True, env=full, timeout=300)


def fresh(cloud: Cloud, what: str) -> str:
    """A prefix no other test used."""
    _PREFIXES[cloud.name] += 1
    return f"{what}/{_PREFIXES[cloud.name]}"


@pytest.fixture(scope="module")
def local_merged(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "merged"
    r = run("merge", llama_ckpt, out, "--max-shard-size", "20KB")
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture
def remote_llama(cloud: Cloud, llama_ckpt: Path) -> str:
    """The llama training checkpoint in the store (once per store)."""
    prefix = "run/checkpoint-500"
    if not cloud.keys(prefix):
        cloud.upload_dir(llama_ckpt, prefix)
    return cloud.url(prefix)


def test_merge_from_the_store_is_bit_exact(cloud: Cloud, remote_llama: str,
                                           local_merged: Path, tmp_path: Path) -> None:
    r = run("merge", "--weights-only", remote_llama, tmp_path / "out", "--max-shard-size", "20KB",
            "--json")
    assert r.exit_code == 0, r.output
    same_files(tmp_path / "out", local_merged)
    doc = json.loads(r.stdout)
    assert doc["src"] == remote_llama
    assert doc["checkpoint"] == f"{remote_llama}/pytorch_model_fsdp_0"
    assert f"ckpttool-{cloud.scheme}-" not in r.stdout  # no temporary path in the report


def test_merge_to_the_store_uploads_the_same_files(cloud: Cloud, llama_ckpt: Path,
                                                   local_merged: Path, tmp_path: Path) -> None:
    prefix = fresh(cloud, "out")
    url = cloud.url(prefix)
    r = run("merge", llama_ckpt, url, "--max-shard-size", "20KB")
    assert r.exit_code == 0, r.output
    assert f"-> {url}" in r.stdout
    same_files(cloud.download_dir(prefix, tmp_path / "got"), local_merged)
    # Weights there already: refused without --overwrite, replaced with it (old shards gone).
    again = run("merge", llama_ckpt, url)
    assert again.exit_code == 3
    assert again.output.count("\n") == 1 and "pass --overwrite" in again.output
    again = run("merge", llama_ckpt, url, "--overwrite")
    assert again.exit_code == 0, again.output
    names = [k.rsplit("/", 1)[1] for k in cloud.keys(prefix)]
    assert "model.safetensors" in names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")]
    assert objstore.LOCK_NAME not in names


def test_merge_store_to_store_from_sharded_safetensors(cloud: Cloud, local_merged: Path,
                                                       tmp_path: Path) -> None:
    src = cloud.upload_dir(local_merged, fresh(cloud, "st"))
    prefix = fresh(cloud, "st-again")
    r = run("merge", "--weights-only", src, cloud.url(prefix), "--max-shard-size", "20KB")
    assert r.exit_code == 0, r.output
    local = tmp_path / "local"
    assert run("merge", "--weights-only", local_merged, local, "--max-shard-size",
               "20KB").exit_code == 0
    same_files(cloud.download_dir(prefix, tmp_path / "got"), local)


def test_inspect_json_matches_local(remote_llama: str, llama_ckpt: Path) -> None:
    same_inspect(remote_llama, llama_ckpt)


def test_verify_and_against(remote_llama: str, local_merged: Path) -> None:
    r = run("verify", remote_llama)
    assert r.exit_code == 0, r.output
    r = run("verify", remote_llama, "--against", local_merged, "--allow-cast")
    assert r.exit_code == 0, r.output
    r = run("verify", local_merged, "--against", remote_llama, "--allow-cast")
    assert r.exit_code == 0, r.output


def test_verify_finds_a_corrupted_object(cloud: Cloud, llama_ckpt: Path) -> None:
    prefix = fresh(cloud, "bad")
    url = cloud.upload_dir(llama_ckpt / "pytorch_model_fsdp_0", prefix)
    data = bytearray((llama_ckpt / "pytorch_model_fsdp_0" / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x40
    cloud.put(f"{prefix}/__1_0.distcp", bytes(data))
    r = run("verify", url, "--json")
    assert r.exit_code == 1, r.output
    bad = [p for p in json.loads(r.stdout)["problems"] if p["severity"] == "error"]
    assert bad


def test_reshard_from_and_to_the_store(cloud: Cloud, remote_llama: str, llama_ckpt: Path,
                                       tmp_path: Path) -> None:
    prefix = fresh(cloud, "resharded")
    r = run("reshard", f"{remote_llama}/pytorch_model_fsdp_0", cloud.url(prefix), "--ranks", "3")
    assert r.exit_code == 0, r.output
    local = tmp_path / "local"
    r = run("reshard", llama_ckpt / "pytorch_model_fsdp_0", local, "--ranks", "3")
    assert r.exit_code == 0, r.output
    # .metadata records where it was saved: the merges below compare what it describes.
    same_files(cloud.download_dir(prefix, tmp_path / "got"), local, but=(".metadata",))
    a, b = tmp_path / "a", tmp_path / "b"
    assert run("merge", "--weights-only", cloud.url(prefix), a).exit_code == 0
    assert run("merge", "--weights-only", local, b).exit_code == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_abfss_spelling_names_the_account(azure: Cloud, llama_ckpt: Path,
                                          local_merged: Path, tmp_path: Path) -> None:
    """An ``abfss://container@account.dfs.core.windows.net/...`` URL pasted from Spark or
    Databricks reads the same blobs (the endpoint from the connection string)."""
    prefix = "run/checkpoint-500"
    if not azure.keys(prefix):
        azure.upload_dir(llama_ckpt, prefix)
    url = f"abfss://{BUCKET}@devstoreaccount1.dfs.core.windows.net/{prefix}"
    r = run("merge", "--weights-only", url, tmp_path / "out", "--max-shard-size", "20KB", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["src"] == url
    same_files(tmp_path / "out", local_merged)



def test_a_large_upload_is_bit_exact(cloud: Cloud, big_model: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objstore, "PART", 5 << 20)
    prefix = fresh(cloud, "big")
    r = run("merge", "--weights-only", big_model, cloud.url(prefix), "--max-shard-size", "10MB")
    assert r.exit_code == 0, r.output
    local = tmp_path / "local"
    assert run("merge", "--weights-only", big_model, local, "--max-shard-size",
               "10MB").exit_code == 0
    same_files(cloud.download_dir(prefix, tmp_path / "got"), local)


@pytest.mark.parametrize("at", [2, 4])
def test_an_interrupted_upload_leaves_nothing(cloud: Cloud, big_model: Path, at: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C at an object (2) or inside a large object's parts (4, Azure: between blocks):
    no object of the output is left, not even the lock."""
    monkeypatch.setattr(objstore, "PART", 5 << 20)
    steps: list[int] = []

    def step() -> None:
        steps.append(1)
        if len(steps) == at:
            raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "fault_step", step)
    prefix = fresh(cloud, "cut")
    r = run("merge", "--weights-only", big_model, cloud.url(prefix), "--max-shard-size", "10MB")
    assert r.exit_code != 0
    assert len(steps) == at
    assert cloud.keys(prefix) == []


def test_an_interrupted_overwrite_leaves_the_previous_output_or_no_index(
        cloud: Cloud, llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = fresh(cloud, "over")
    url = cloud.url(prefix)
    assert run("merge", llama_ckpt, url, "--max-shard-size", "20KB", "-q").exit_code == 0
    old = cloud.contents(prefix)
    index = "model.safetensors.index.json"
    seen = set()
    # Early steps (the previous index deleted), one among the shards, and past the last.
    for at in (1, 2, 3, 9, 10_000):
        steps: list[int] = []

        def step(at: int = at, steps: list[int] = steps) -> None:
            steps.append(1)
            if len(steps) == at:
                raise KeyboardInterrupt

        monkeypatch.setattr(outputs, "fault_step", step)
        r = run("merge", llama_ckpt, url, "--max-shard-size", "35KB", "--overwrite", "-q")
        found = cloud.contents(prefix)
        assert objstore.LOCK_NAME not in found
        if r.exit_code == 0:
            seen.add("new")
            break
        if index not in found:
            seen.add("no index")
        else:  # the index is the previous one, with all its shards
            assert found[index] == old[index]
            for f in set(json.loads(old[index])["weight_map"].values()):
                assert found[f] == old[f]
            seen.add("old")
        # Put the previous output back for the next step.
        for k in cloud.keys(prefix):
            cloud.delete(k)
        for name, data in old.items():
            cloud.put(f"{prefix}/{name}", data)
    assert seen == {"old", "no index", "new"}


def test_an_object_changed_while_read_is_one_line(cloud: Cloud, llama_ckpt: Path) -> None:
    prefix = fresh(cloud, "changed")
    cloud.upload_dir(llama_ckpt / "pytorch_model_fsdp_0", prefix)
    with ObjectTree(cloud.url(prefix)) as m:
        store = m.open(m.dir, metadata_name=".metadata")
        first = store.read_exact("__0_0.distcp", 0, 100, what="x")
        data = (llama_ckpt / "pytorch_model_fsdp_0" / "__0_0.distcp").read_bytes()
        assert first == data[:100]
        cloud.put(f"{prefix}/__0_0.distcp", data[::-1])  # another object of the same size
        with pytest.raises(InputError) as e:
            store.read_exact("__0_0.distcp", 200, 100, what="x")
        store.close()
    text = str(e.value)
    assert text == (f"{cloud.url(prefix)}/__0_0.distcp: the object changed while it was being "
                    "read; run again once it is no longer being written")


def test_a_second_writer_is_refused(cloud: Cloud, llama_ckpt: Path) -> None:
    prefix = fresh(cloud, "two")
    url = cloud.url(prefix)
    lock = objstore.Lock(objstore.parse(url))
    lock.acquire()
    try:
        r = run("merge", llama_ckpt, url)
        assert r.exit_code == 3
        assert r.output.startswith(f"ckpttool: error: {url}: another ckpttool run is writing "
                                   f"this output ({objstore.LOCK_NAME} by ")
        assert r.output.count("\n") == 1
        assert cloud.keys(prefix) == [f"{prefix}/{objstore.LOCK_NAME}"]
        r = run("inspect", url)
        assert "a ckpttool run is writing it, or one was killed while writing it" in r.output
    finally:
        lock.release()
    assert cloud.keys(prefix) == []
    assert run("merge", llama_ckpt, url, "-q").exit_code == 0
    assert objstore.LOCK_NAME not in [k.rsplit("/", 1)[1] for k in cloud.keys(prefix)]


def test_a_killed_runs_lock_is_taken_over(cloud: Cloud, llama_ckpt: Path) -> None:
    """A lock not renewed for CKPTTOOL_LOCK_STALE (a run killed with kill -9 on another
    host) is removed by the next run, which says so (issue 34)."""
    import time

    prefix = fresh(cloud, "stale")
    beat = time.time() - 601
    cloud.put(f"{prefix}/{objstore.LOCK_NAME}", json.dumps(
        {"run": "node-7:4242:x", "host": "node-7", "pid": 4242, "started": beat,
         "beat": beat}).encode())
    r = run("merge", llama_ckpt, cloud.url(prefix))
    assert r.exit_code == 0, r.output
    assert "removed the lock of a killed run (node-7:4242:x: not renewed for" in r.output
    assert objstore.LOCK_NAME not in [k.rsplit("/", 1)[1] for k in cloud.keys(prefix)]


def test_missing_bucket_and_key(cloud: Cloud, tmp_path: Path) -> None:
    what = "bucket" if cloud.scheme == "gs" else "container"
    hint = " (and STORAGE_EMULATOR_HOST)" if cloud.scheme == "gs" else ""
    r = cli(cloud, "inspect", f"{cloud.scheme}://no-such-bucket/x")
    assert r.returncode == 3, r.stderr
    assert r.stderr == (f"ckpttool: error: {cloud.scheme}://no-such-bucket/x: {what} "
                        f"'no-such-bucket' does not exist; check the URL{hint}\n")
    r = cli(cloud, "merge", cloud.url("no/such/key"), str(tmp_path / "out"))
    assert r.returncode == 3, r.stderr
    assert r.stderr == (f"ckpttool: error: {cloud.url('no/such/key')}: no such object or "
                        "prefix; check the URL\n")
    assert not (tmp_path / "out").exists()
    r = cli(cloud, "merge", str(tmp_path), f"{cloud.scheme}://no-such-bucket/out")
    assert r.returncode == 3 and f"{what} 'no-such-bucket' does not exist" in r.stderr


def test_azure_bad_credentials_are_one_line_without_the_secret(azure: Cloud) -> None:
    secret = "d3JvbmctYnV0LXZhbGlkLWJhc2U2NC1rZXktZG8tbm90LXByaW50"
    env = {"AZURE_STORAGE_CONNECTION_STRING": azure.env["AZURE_STORAGE_CONNECTION_STRING"]
           .replace(azure.env["AZURE_STORAGE_CONNECTION_STRING"].split("AccountKey=")[1]
                    .split(";")[0], secret)}
    r = cli(azure, "verify", azure.url("run"), env=env)
    assert r.returncode == 3, r.stderr
    assert r.stderr.startswith(f"ckpttool: error: {azure.url('run')}: access denied while "
                               "listing (403")
    assert r.stderr.count("\n") == 1
    assert secret not in r.stderr + r.stdout


def test_azure_without_an_account_says_what_to_set(azure: Cloud) -> None:
    r = cli(azure, "inspect", azure.url("run"), env={"AZURE_STORAGE_CONNECTION_STRING": ""})
    assert r.returncode == 3, r.stderr
    assert r.stderr == (f"ckpttool: error: {azure.url('run')}: no Azure storage account named; "
                        "set AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME, or "
                        "use abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX\n")


def test_gcs_bad_credentials_are_one_line_without_the_secret(gcs: Cloud,
                                                             tmp_path: Path) -> None:
    secret = "-----BEGIN PRIVATE KEY-----not-a-key-do-not-print"
    key = tmp_path / "key.json"
    key.write_text(json.dumps({"type": "service_account", "private_key": secret,
                               "client_email": "x@y.iam.gserviceaccount.com"}))
    r = cli(gcs, "inspect", gcs.url("run"), env={"STORAGE_EMULATOR_HOST": "",
                                                 "GOOGLE_APPLICATION_CREDENTIALS": str(key)})
    assert r.returncode == 3, r.stderr
    assert r.stderr == (f"ckpttool: error: {gcs.url('run')}: cannot use the credentials in "
                        f"{key} (GOOGLE_APPLICATION_CREDENTIALS): not a readable service "
                        "account key; check the file, or unset the variable to use gcloud's "
                        "application-default credentials\n")
    assert secret not in r.stderr + r.stdout and "not-a-key" not in r.stderr


@pytest.mark.parametrize("scheme,extra", [("gs", "gcs"), ("az", "azure")])
def test_without_the_extra_says_what_to_install(scheme: str, extra: str) -> None:
    code = ("import sys\nsys.modules['obstore'] = None\nfrom ckpttool.cli import main\n"
            f"sys.argv = ['ckpttool', 'inspect', '{scheme}://b/run']\nmain()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "AZURE_STORAGE_ACCOUNT_NAME": "a"})
    assert r.returncode == 4, r.stderr
    name = "Google Cloud Storage" if scheme == "gs" else "Azure Blob Storage"
    assert r.stderr == (f"ckpttool: error: {scheme}://b/run: {name} needs the {extra} extra; "
                        f"install it with: pip install 'ckpttool[{extra}]'\n")


def test_inspect_one_object(cloud: Cloud, local_merged: Path, tmp_path: Path) -> None:
    """A URL naming one object (not a prefix) reads that file alone."""
    prefix = fresh(cloud, "one")
    name = sorted(p.name for p in local_merged.glob("*.safetensors"))[0]
    local = tmp_path / "one" / name
    local.parent.mkdir()
    local.write_bytes((local_merged / name).read_bytes())
    cloud.put(f"{prefix}/{name}", local.read_bytes())
    a = run("inspect", f"{cloud.url(prefix)}/{name}", "--json")
    b = run("inspect", local, "--json")
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    da = json.loads(a.stdout.replace(cloud.url(prefix), str(local.parent)))
    db = json.loads(b.stdout)
    da.pop("seconds", None), db.pop("seconds", None)
    assert da == db
