"""What a path the user named is: the one classifier of every SRC, OUT, RUN and option path
the CLI and the library take.

:func:`classify` returns a :class:`Place`: a local path, or an object-storage URL of a
scheme in :data:`SCHEMES`. It refuses, before anything is read or written, a URL of any
other scheme (exit 4, naming the supported ones: a ``gs:/`` directory is never made from
one), a URL where only a local path is taken (exit 4), and ``-`` (exit 2: ckpttool reads and
writes directories, never a stream on stdin or stdout, and ``./-/`` is never what was
meant). Every command and mode (merge, ``--all``, ``--watch``, ``--dry-run``, slices,
torchrun, inspect, verify, ``--against``, reshard) asks here; nothing else parses a scheme.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ckpttool.errors import InputError, UnsupportedError, UsageError

# Every object store served, by URL scheme, in the order messages list them
# (ckpttool.storage.remote.backend names the module that serves each).
SCHEMES: tuple[str, ...] = ("s3", "gs", "az", "abfs", "abfss")

# RFC 3986's scheme, then "://": anything else (a Windows drive "C:\\", "a:b") is a path.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

# The name that means a standard stream to most tools.
STREAM = "-"


@dataclass(frozen=True)
class Place:
    """A classified location: ``scheme`` None for a local path, else one of :data:`SCHEMES`
    (``text`` is then the URL as typed)."""

    text: str
    scheme: str | None = None

    @property
    def remote(self) -> bool:
        return self.scheme is not None

    @property
    def path(self) -> Path:
        """The local path (only for a local place)."""
        if self.scheme is not None:
            raise ValueError(f"{self.text}: a {self.scheme}:// URL, not a local path")
        return Path(self.text)

    def __str__(self) -> str:
        return self.text


# What each cloud calls the top of a URL, and its name, for messages.
_BUCKETS = {"s3": ("bucket", "S3"), "gs": ("bucket", "Google Cloud Storage"),
            "az": ("container", "Azure Blob Storage")}


@dataclass(frozen=True)
class Url:
    """An object-storage URL, parsed (one type for every store: s3, gs, az, abfs[s])."""

    scheme: str  # as typed: s3, gs, az, abfs, abfss
    bucket: str  # the bucket (S3, GCS) or container (Azure)
    key: str  # no leading or trailing slash; "" for the bucket itself
    host: str = ""  # abfs[s]: ACCOUNT.dfs.core.windows.net

    @property
    def cloud(self) -> str:
        """"s3", "gs" or "az"."""
        return self.scheme if self.scheme in ("s3", "gs") else "az"

    @property
    def account(self) -> str:
        return self.host.split(".", 1)[0]

    def __str__(self) -> str:
        base = f"{self.scheme}://{self.bucket}" + (f"@{self.host}" if self.host else "")
        return f"{base}/{self.key}" if self.key else base

    @property
    def prefix(self) -> str:
        """The key prefix of the objects "in" this URL as a directory."""
        return f"{self.key}/" if self.key else ""

    def child(self, name: str) -> Url:
        return replace(self, key=f"{self.prefix}{name}")

    def with_key(self, key: str) -> Url:
        return replace(self, key=key)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1] if self.key else self.bucket


def parse_url(value: str) -> Url:
    """``s3://bucket/key``, ``gs://bucket/key``, ``az://container/key`` or
    ``abfss://container@account.dfs.core.windows.net/key`` -> :class:`Url`.

    Raises:
        UnsupportedError: not a URL of a scheme in :data:`SCHEMES`.
        InputError: no bucket (container, account) named.
    """
    place = classify(value, what="location")
    if place.scheme is None:
        raise UnsupportedError(f"{value}: not an object-storage URL; supported: {supported()}")
    scheme = place.scheme
    authority, _, key = value.partition("://")[2].partition("/")
    host = ""
    if scheme in ("abfs", "abfss"):
        authority, _, host = authority.partition("@")
        if not authority or not host:
            raise InputError(f"{value}: names no container and account; use "
                             f"{scheme}://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX")
    if not authority:
        what = _BUCKETS["s3" if scheme == "s3" else "gs" if scheme == "gs" else "az"][0]
        raise InputError(f"{value}: names no {what}; use {scheme}://{what.upper()}/PREFIX")
    return Url(scheme, authority, key.strip("/"), host)


def scheme_of(value: object) -> str | None:
    """The URL scheme ``value`` starts with (``"gs"`` for ``gs://b/k``), as typed; None for
    a path. A ``Path`` made of a URL has lost a slash (``gs:/b/k``): its first part ending in
    ``:`` still names the scheme (the CLI parses some options as paths)."""
    if isinstance(value, os.PathLike):
        parts = Path(value).parts
        first = parts[0] if len(parts) > 1 else ""
        m = _SCHEME.match(first[:-1] + "://") if first.endswith(":") else None
    else:
        m = _SCHEME.match(value) if isinstance(value, str) else None
    return m.group(1) if m else None


def is_remote(value: object) -> bool:
    """Whether ``value`` names object storage served here (no error for anything else)."""
    return scheme_of(value) in SCHEMES


def supported() -> str:
    """The supported locations, for messages: "local paths, s3://, gs://..."."""
    return ", ".join(["local paths", *(f"{s}://" for s in SCHEMES)])


def classify(value: str | os.PathLike[str], *, what: str, remote_ok: bool = True) -> Place:
    """What ``value`` names, or why it is refused.

    Args:
        what: what the value is, for messages ("source", "output", "RUN", "--config").
        remote_ok: False where only a local path is taken.

    Raises:
        UsageError: (exit 2) ``-``: no stream is read or written.
        UnsupportedError: (exit 4) a URL of a scheme not served (naming those that are), or
            a URL where only a local path is taken.
    """
    text = os.fspath(value)
    if text == STREAM:
        raise UsageError(f"-: {what} is a path, not a stream: ckpttool reads and writes "
                         "directories and files, never stdin or stdout; name one (./- for a "
                         "directory really called -)")
    scheme = scheme_of(value)
    if scheme is None:
        return Place(text)
    if isinstance(value, os.PathLike):  # "gs:/b/k" as a Path: the URL as typed
        text = f"{scheme}://" + "/".join(Path(value).parts[1:])
    if scheme not in SCHEMES:
        raise UnsupportedError(f"{text}: {scheme}:// is not a storage ckpttool reads or writes "
                               f"(as {what}); supported: {supported()}")
    if not remote_ok:
        raise UnsupportedError(f"{text}: {what} takes a local path, not a {scheme}:// URL; "
                               "download the file and pass its path")
    return Place(text, scheme)
