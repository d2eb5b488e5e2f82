"""Shared uploads on Google Cloud Storage and Azure Blob Storage
(:class:`ckpttool.storage.objects.Parts`), beside :class:`ckpttool.storage.s3.Parts`.

* Azure: each part is a block of the blob (``Put Block``, its id the part number), staged by
  whichever process owns it; ``Put Block List`` commits them in order, and only then does the
  blob exist (or change). Uncommitted blocks are invisible and Azure discards them after 7 days,
  so there is nothing to abort. Requests are signed with the account key (Shared Key) or carry
  the SAS, from the same settings as :mod:`ckpttool.storage.objstore`; other credentials
  (managed identity, service principal) are refused with a one-line error for now.
* GCS: each part is an object of its own below the run's staging prefix; ``compose`` joins at
  most 32 sources per call, so more parts are joined in rounds (32 into one, then 32 of
  those...). The staging prefix, parts included, is removed by the finish. The emulator
  (``STORAGE_EMULATOR_HOST``) is reached without credentials; Google Cloud Storage itself with
  the application-default credentials of google-auth.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import json
import urllib.parse
import urllib.request
from typing import Any

from ckpttool.errors import InputError, UnsupportedError
from ckpttool.storage import objects, objstore, places

Url = places.Url

# GCS compose: at most this many sources per call.
COMPOSE = 32


class _Common:
    """Small objects (records) through objstore's requests."""

    def get(self, url: Url) -> bytes | None:
        if objstore.head(url) is None:
            return None
        with objstore.errors(url, "reading"):
            return objstore._get_all(url)

    def put(self, url: Url, data: bytes, *, create: bool = False) -> bool:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        if create and objstore.head(url) is not None:
            return False  # refused before the put: fake-gcs-server ignores the condition
        try:
            with objstore.errors(url, "writing"):
                objstore._put(url, data, create=create)
        except InputError as e:
            if create and isinstance(e.__cause__, AlreadyExistsError | PreconditionError):
                return False
            raise
        return True

    def delete(self, url: Url) -> None:
        with objstore.errors(url, "removing"):
            objstore._delete(url)

    def listing(self, url: Url) -> dict[str, tuple[int, str]]:
        return objstore.list_objects(url)

    def abort(self, url: Url, upload: str) -> None:
        return None  # uncommitted blocks expire; GCS parts go with the staging prefix


def _call(url: Url, request: urllib.request.Request, doing: str, size: int = 0) -> bytes:
    return objstore.http(url, request, doing, size=size, statuses={404: InputError(
        f"{url}: {doing} failed: not found (status code: 404); run every slice again")})


class GcsParts(_Common):
    limits = objects.Limits("Google Cloud Storage", max_parts=10_000, min_part=1,
                            max_part=5 << 40, what="composed parts")

    def start(self, url: Url, staging: Url) -> str:
        return staging.key  # the parts' prefix: any process finds them there

    def put_part(self, url: Url, upload: str, number: int, data: bytes) -> str:
        part = url.with_key(f"{upload}/{number:05d}")
        with objstore.errors(part, f"uploading part {number}"):
            objstore._put(part, data)
        return hashlib.md5(data, usedforsecurity=False).hexdigest()

    def complete(self, url: Url, upload: str, parts: list[tuple[int, str]]) -> None:
        names = [f"{upload}/{n:05d}" for n, _ in parts]
        level = 0
        while len(names) > COMPOSE:
            joined = []
            for k in range(0, len(names), COMPOSE):
                dest = f"{upload}/r{level}-{k // COMPOSE:05d}"
                self._compose(url, names[k:k + COMPOSE], dest)
                joined.append(dest)
            names, level = joined, level + 1
        self._compose(url, names, url.key)

    def _compose(self, url: Url, sources: list[str], dest: str) -> None:
        base = objstore.emulator()
        headers = {"Content-Type": "application/json"}
        if base is None:
            base = "https://storage.googleapis.com"
            headers["Authorization"] = f"Bearer {_gcs_token(url)}"
        target = objstore.gcs_object(base, url.bucket, dest) + "/compose"
        body = json.dumps({"sourceObjects": [{"name": s} for s in sources],
                           "destination": {"contentType": "application/octet-stream"}})
        _call(url, urllib.request.Request(target, data=body.encode(), method="POST",
                                          headers=headers), "composing the parts")


def _gcs_token(url: Url) -> str:
    try:
        import google.auth
        import google.auth.transport.requests
    except ImportError as e:
        raise UnsupportedError(f"{url}: composing parts on Google Cloud Storage needs "
                               "google-auth (pip install google-auth); or merge into a shared "
                               "directory and upload it") from e
    credentials, _ = google.auth.default(
        scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    credentials.refresh(google.auth.transport.requests.Request())
    return str(credentials.token)


class AzureParts(_Common):
    limits = objects.Limits("Azure Blob Storage", max_parts=50_000, min_part=1,
                            max_part=4000 << 20, what="blocks")

    def start(self, url: Url, staging: Url) -> str:
        return "blocks"  # a blob's blocks need no upload id

    def put_part(self, url: Url, upload: str, number: int, data: bytes) -> str:
        block = _block_id(number)
        self._send(url, "PUT", {"comp": "block", "blockid": block}, data,
                   f"uploading block {number}")
        return block

    def complete(self, url: Url, upload: str, parts: list[tuple[int, str]]) -> None:
        body = ("<?xml version=\"1.0\" encoding=\"utf-8\"?><BlockList>"
                + "".join(f"<Latest>{_block_id(n)}</Latest>" for n, _ in parts)
                + "</BlockList>").encode()
        self._send(url, "PUT", {"comp": "blocklist"}, body, "committing the blocks")

    def _send(self, url: Url, method: str, query: dict[str, str], data: bytes,
              doing: str) -> None:
        account = objstore.azure_account(url)
        endpoint = account.blob_endpoint
        path = urllib.parse.urlparse(endpoint).path + "/" + urllib.parse.quote(
            f"{url.bucket}/{url.key}")
        target = f"{endpoint}/{urllib.parse.quote(f'{url.bucket}/{url.key}')}?" \
            + urllib.parse.urlencode(query)
        headers = {"x-ms-date": email.utils.formatdate(usegmt=True),
                   "x-ms-version": "2021-08-06", "Content-Length": str(len(data)),
                   "Content-Type": "application/octet-stream"}
        if account.sas:
            target += "&" + account.sas.lstrip("?")
        elif account.key:
            headers["Authorization"] = _shared_key(account.name, account.key, method, path,
                                                   query, headers)
        else:
            raise UnsupportedError(f"{url}: a merge shared into Azure Blob Storage signs its "
                                   "block uploads with the account key or a SAS "
                                   "(AZURE_STORAGE_CONNECTION_STRING); other credentials are "
                                   "not supported yet")
        _call(url, urllib.request.Request(target, data=data, method=method, headers=headers),
              doing, len(data))


def _block_id(number: int) -> str:
    return base64.b64encode(f"ckpttool-{number:06d}".encode()).decode()


def _shared_key(account: str, key: str, method: str, path: str, query: dict[str, str],
                headers: dict[str, str]) -> str:
    length = headers.get("Content-Length", "")
    standard = ["", "", "" if length == "0" else length, "", headers.get("Content-Type", ""),
                "", "", "", "", "", ""]
    ms = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()) if k.startswith("x-ms-"))
    resource = f"/{account}{path}" + "".join(f"\n{k}:{v}" for k, v in sorted(query.items()))
    text = f"{method}\n" + "\n".join(standard) + "\n" + ms + resource
    digest = hmac.new(base64.b64decode(key), text.encode(), hashlib.sha256).digest()
    return f"SharedKey {account}:{base64.b64encode(digest).decode()}"


def parts(url: Url) -> Any:
    """The shared-upload primitives of ``url``'s store."""
    if url.cloud == "gs":
        return GcsParts()
    return AzureParts()

