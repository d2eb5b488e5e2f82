"""A real S3-compatible server for the remote tests: moto's standalone server on a free
localhost port (started once per session), reached through the standard environment
variables, exactly as a user's MinIO or Ceph endpoint would be. No client is mocked.

* ``s3``: the server's environment (``AWS_ENDPOINT_URL``, test credentials), set for this
  process and handed to subprocesses; and helpers to upload, download and list;
* ``remote_dcp``: the ``llama`` training checkpoint uploaded to ``s3://ckpt/run/checkpoint-500``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3", reason="the s3 extra (pip install 'ckpttool[s3]')")
moto_server = pytest.importorskip("moto.server", reason="moto[server] (the test extra)")

BUCKET = "ckpt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3:
    env: dict[str, str]
    client: Any

    def upload_dir(self, local: Path, bucket: str, prefix: str) -> str:
        for p in sorted(local.rglob("*")):
            if p.is_file():
                self.client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(local)}")
        return f"s3://{bucket}/{prefix}"

    def download_dir(self, bucket: str, prefix: str, local: Path) -> Path:
        local.mkdir(parents=True, exist_ok=True)
        for key in self.keys(bucket, prefix):
            target = local / key[len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(bucket, key, str(target))
        return local

    def keys(self, bucket: str, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix.rstrip("/") + "/")
        return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))

    def uploads_in_progress(self, bucket: str) -> list[str]:
        r = self.client.list_multipart_uploads(Bucket=bucket)
        return [u["Key"] for u in r.get("Uploads", ())]


@pytest.fixture(scope="session")
def s3() -> Iterator[S3]:
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in (*env, "AWS_PROFILE", "AWS_SESSION_TOKEN")}
    os.environ.update(env)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    client = boto3.session.Session().client("s3")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield S3(env, client)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def remote_llama(s3: S3, llama_ckpt: Path) -> str:
    """``s3://ckpt/run/checkpoint-500``: the llama training checkpoint, uploaded."""
    return s3.upload_dir(llama_ckpt, BUCKET, "run/checkpoint-500")
