"""The store contract on local files (:class:`ckpttool.storage.store.LocalStore`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpttool.errors import InputError
from ckpttool.storage.store import LOCAL, LocalStore, Store
from tests.storage.contract import META, StoreTests


def write(files: dict[str, bytes], base: Path) -> Path:
    for name, data in files.items():
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_bytes(data)
    return base


class TestLocalStore(StoreTests):
    def store_of(self, files: dict[str, bytes], tmp: Path) -> Store:
        return LOCAL.open(write(files, tmp / "ckpt"), metadata_name=META)


def test_a_link_out_of_the_directory_needs_follow_links(tmp_path: Path) -> None:
    base = write({"inside.bin": b"x"}, tmp_path / "ckpt")
    (tmp_path / "outside.bin").write_bytes(b"secret")
    os.symlink(tmp_path / "outside.bin", base / "link.bin")
    with pytest.raises(InputError, match="outside the checkpoint directory; pass --follow-links"):
        LocalStore(base, metadata_name=META).size("link.bin")
    followed = LOCAL.open(base, metadata_name=META, follow_links=True)
    assert followed.pread("link.bin", 10, 0) == b"secret"
    followed.close()


def test_a_fifo_is_refused(tmp_path: Path) -> None:
    base = write({}, tmp_path)
    os.mkfifo(base / "f.bin")
    with pytest.raises(InputError, match="is not a regular file; .metadata names it as data"):
        LocalStore(base, metadata_name=META).size("f.bin")
