"""A remote checkpoint (an object-store prefix, or one object) as a
:class:`~ckpttool.storage.store.Stores`: what lets every format describe a checkpoint in
object storage with the code that describes a local one, with no local copy of it.

:class:`ObjectTree` lists the prefix once and stands for it by a path under a fresh, empty,
private temporary directory that is never written to (so no local file can stand in for a
remote one). Every call for a path below it is served from the listing
(:meth:`ObjectTree.listdir`, :meth:`ObjectTree.file_size`, :meth:`ObjectTree.is_dir`) or by
ranged GETs pinned to the listed ETag (:meth:`ObjectTree.read_small`,
:meth:`ObjectTree.side_file`, :meth:`ObjectTree.reading`, and the ``RemoteStore`` of
:mod:`ckpttool.storage.remote` that :meth:`ObjectTree.open` returns for a reader); a path
anywhere else goes to the local store. Every file is read where it lies, whatever its size:
configs and tokenizers, metadata and data files alike.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import shutil
import sys
import tempfile
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from ckpttool.errors import InputError
from ckpttool.storage import objects, ranged, remote, sidefiles
from ckpttool.storage.store import LOCAL, PreadFile, Store, Stores

# The longest name a local file system takes for one path segment.
NAME_MAX = 255

class ObjectTree:
    """A remote checkpoint (a prefix, or one object) served from its listing and by ranged
    GETs, under a local path that stands for it (:attr:`local`; nothing is there). A context
    manager: the empty temporary directory holding that path is removed on exit.

    Args:
        value: the URL (``s3://bucket/prefix`` or one object).
        backend: the store that serves ``value`` (None: the one of its scheme,
            :func:`ckpttool.storage.remote.backend`; :mod:`ckpttool.storage.memory` is
            handed over so).

    Raises (on construction):
        InputError: nothing at the URL, the bucket is missing, access is denied, the
            listing is unusable, no temporary directory can be made.
    """

    def __init__(self, value: str, *, warn: Callable[[str], None] | None = None,
                 backend: objects.Backend | None = None) -> None:
        # The backend of this URL's store (s3, objstore, memory).
        self.remote = backend if backend is not None else remote.backend(value)
        self.url = self.remote.parse(value)
        self._warn = warn or _stderr
        objects = self.remote.list_objects(self.url)
        try:
            # Empty, private and never written to: no local file stands for a remote one.
            self.tmp = Path(tempfile.mkdtemp(prefix=f"ckpttool-{remote.scheme(value)}-"))
        except OSError as e:
            raise InputError(f"{self.url}: cannot make a temporary directory in "
                             f"{tempfile.gettempdir()} ({e.strerror}); set TMPDIR to a "
                             "writable directory") from e
        try:
            if objects:  # a prefix: the directory it stands for
                self.base_url = self.url
                self.dir: Path = self.tmp / self.url.name
                self.root: Path = self.dir
            else:  # one object, in the directory of its parent prefix
                single = self.remote.head(self.url) if self.url.key else None
                if single is None:
                    raise InputError(f"{self.url}: no such object or prefix; check the URL")
                self.base_url = self.url.with_key(self.url.key.rpartition("/")[0])
                objects = {self.url.name: single}
                self.dir = self.tmp / self.base_url.name
                self.root = self.dir / self.url.name
            # ``self.dir`` stands for ``base_url``; every file lies below it.
            if self.remote.LOCK_NAME in objects:
                self._warn(f"warning: {self.base_url}: a ckpttool run is writing it, or one "
                           f"was killed while writing it ({self.remote.LOCK_NAME} is there); "
                           "what is "
                           "read may be incomplete")
            self.objects = self._usable(objects)
            self._listing = _tree(self.objects)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _usable(self, objects: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
        """The listed objects a path can stand for: keys that are also a
        "directory" of other keys, names too long for a file system, and impossible sizes
        are skipped with a warning (or refused where the checkpoint needs them)."""
        kept: dict[str, tuple[int, str]] = {}
        prefixes = {rel[:i + 1] for rel in objects for i, c in enumerate(rel) if c == "/"}
        for rel, (size, etag) in sorted(objects.items()):
            where = self.base_url.child(rel)
            if any(len(part.encode()) > NAME_MAX for part in rel.split("/")):
                self._warn(f"warning: {where}: skipped, a name longer than {NAME_MAX} bytes")
                continue
            if not 0 <= size < 1 << 60:
                raise InputError(f"{where}: the store lists an impossible size ({size}); "
                                 "check the object store (or its endpoint)")
            if rel + "/" in prefixes:
                self._warn(f"warning: {where}: skipped, also a prefix of other objects")
                continue
            # A control character (S3 keys may hold one), or one the listing could not spell
            # (U+FFFD: GCS and Azure list a control character so): no file stands for it.
            if any(c == "\ufffd" or unicodedata.category(c) == "Cc" for c in rel):
                shown = rel.encode("unicode_escape").decode("ascii")
                self._warn(f"warning: {self.base_url.child(shown)}: skipped, a control "
                           "character in its name")
                continue
            if not _inside(self.dir, self.dir / rel):
                continue  # a key with ".." segments: not part of any checkpoint we read
            kept[rel] = (size, etag)
        return kept

    # -- Stores: the tree's paths from the listing and by ranged GETs, anything else locally

    def covers(self, path: Path) -> bool:
        return path == self.dir or self.dir in path.parents

    def open(self, base: Path, *, metadata_name: str, follow_links: bool = False
             ) -> Store:
        if not self.covers(base):
            return LOCAL.open(base, metadata_name=metadata_name,
                              follow_links=follow_links)
        rel = base.relative_to(self.dir).as_posix()
        url = self.base_url if rel == "." else self.base_url.child(rel)
        prefix = "" if rel == "." else rel + "/"
        objects = {k[len(prefix):]: v for k, v in self.objects.items() if k.startswith(prefix)}
        store: Store = self.remote.RemoteStore(base, url, objects, metadata_name)
        return store

    @contextlib.contextmanager
    def reading(self, path: Path, *, inside: str | None = None
                ) -> Iterator[Callable[[int, int], bytes]]:
        if not self.covers(path.parent):
            with LOCAL.reading(path, inside=inside) as pread:
                yield pread
            return
        store = self.open(path.parent, metadata_name=path.name)
        try:
            yield functools.partial(store.pread, path.name)
        finally:
            store.close()

    @contextlib.contextmanager
    def side_file(self, path: Path, kind: sidefiles.Kind) -> Iterator[BinaryIO]:
        rel = self._rel(path)
        if rel is None:  # not the tree's: a local file
            with LOCAL.side_file(path, kind) as f:
                yield f
            return
        with self._object(path) as store:
            size = store.size(path.name)
            sidefiles.check_size(self.to_url(str(path)), size, kind)
            raw = PreadFile(functools.partial(store.pread, path.name), size)
            with io.BufferedReader(raw, buffer_size=ranged.GET) as f:
                yield f

    @contextlib.contextmanager
    def _object(self, path: Path) -> Iterator[Store]:
        """The store of the listed object ``path``'s directory, open while the block runs.

        Raises:
            FileNotFoundError: the listing has no object ``path``.
        """
        if self._rel(path) not in self.objects:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        store = self.open(path.parent, metadata_name=path.name)
        try:
            yield store
        finally:
            store.close()

    def _rel(self, path: Path) -> str | None:
        """``path`` relative to the tree's directory ("" for itself); None outside it."""
        if not self.covers(path):
            return None
        rel = path.relative_to(self.dir).as_posix()
        return "" if rel == "." else rel

    # What the listing says, never the local directory: the objects themselves.

    def file_size(self, path: Path) -> int | None:
        rel = self._rel(path)
        if rel is None:
            return LOCAL.file_size(path)
        found = self.objects.get(rel)
        return None if found is None else found[0]

    def is_dir(self, path: Path) -> bool:
        rel = self._rel(path)
        return LOCAL.is_dir(path) if rel is None else rel in self._listing

    def listdir(self, directory: Path) -> dict[str, int | None]:
        rel = self._rel(directory)
        if rel is None:
            return LOCAL.listdir(directory)
        return dict(self._listing.get(rel, {}))

    def read_small(self, path: Path, kind: sidefiles.Kind) -> bytes:
        rel = self._rel(path)
        if rel is None:
            return LOCAL.read_small(path, kind)
        with self._object(path) as store:
            return store.read_small(path.name, kind)

    # --

    def to_url(self, text: str) -> str:
        """``text`` with the tree's paths written as the URLs they stand for."""
        return text.replace(str(self.dir), str(self.base_url))

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> ObjectTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def local(self) -> Path:
        """The local path that stands for the URL given."""
        return self.root


class Mounts:
    """Several object trees (a command reading two remote checkpoints) as one
    :class:`~ckpttool.storage.store.Stores`: each path goes to the tree it lies in."""

    def __init__(self, trees: Sequence[ObjectTree]) -> None:
        self.trees = tuple(trees)

    def _of(self, path: Path) -> Stores:
        return next((t for t in self.trees if t.covers(path)), LOCAL)

    def open(self, base: Path, *, metadata_name: str, follow_links: bool = False
             ) -> Store:
        return self._of(base).open(base, metadata_name=metadata_name, follow_links=follow_links)

    def reading(self, path: Path, *, inside: str | None = None
                ) -> contextlib.AbstractContextManager[Callable[[int, int], bytes]]:
        return self._of(path.parent).reading(path, inside=inside)

    def side_file(self, path: Path, kind: sidefiles.Kind
                  ) -> contextlib.AbstractContextManager[BinaryIO]:
        return self._of(path.parent).side_file(path, kind)

    def file_size(self, path: Path) -> int | None:
        return self._of(path).file_size(path)

    def is_dir(self, path: Path) -> bool:
        return self._of(path).is_dir(path)

    def listdir(self, directory: Path) -> dict[str, int | None]:
        return self._of(directory).listdir(directory)

    def read_small(self, path: Path, kind: sidefiles.Kind) -> bytes:
        return self._of(path).read_small(path, kind)


def _tree(objects: dict[str, tuple[int, str]]) -> dict[str, dict[str, int | None]]:
    """Each "directory" of a listing ("" for the top) -> what lies directly in it: a file's
    name -> its size, a subdirectory's -> None."""
    tree: dict[str, dict[str, int | None]] = {"": {}}
    for rel, (size, _) in objects.items():
        parent, _, name = rel.rpartition("/")
        tree.setdefault(parent, {})[name] = size
        while parent:
            up, _, sub = parent.rpartition("/")
            tree.setdefault(up, {})[sub] = None
            parent = up
    return tree


def _inside(base: Path, target: Path) -> bool:
    real, inside = os.path.normpath(target), os.path.normpath(base)
    return os.path.commonpath([real, inside]) == inside


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)
