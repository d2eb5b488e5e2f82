"""A DCP checkpoint's ``.metadata`` read through the Stores a reader is handed (issue 37,
item 5), on the in-memory backend: a remote ``.metadata`` larger than the mirror downloads
is read in place by ranged GETs (it was refused), and it describes the checkpoint exactly as
the local copy does."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ckpttool.core.runtime import urls
from ckpttool.errors import UnsupportedError
from ckpttool.formats.dcp import reader as dcp
from ckpttool.storage import memory
from ckpttool.storage import mirror as mirrors

BUCKET = "meta"
_prefixes = itertools.count()


def _upload(local: Path) -> str:
    memory.create_bucket(BUCKET)
    prefix = f"dcp/{next(_prefixes)}"
    for p in sorted(local.rglob("*")):
        if p.is_file():
            rel = p.relative_to(local).as_posix()
            memory.put(memory.parse(f"s3://{BUCKET}/{prefix}/{rel}"), p.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


def test_a_large_metadata_is_read_by_ranges(tiny_dcp: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    url = _upload(tiny_dcp)
    monkeypatch.setattr(mirrors, "DOWNLOAD_LIMIT", 0)  # every side file "large"
    with pytest.raises(UnsupportedError, match="reads only from a local disk"):
        mirrors.Mirror(url, data_suffixes=urls.DATA_SUFFIXES, backend=memory)
    with mirrors.Mirror(url, data_suffixes=urls.DATA_SUFFIXES, by_store=urls.BY_STORE,
                        backend=memory) as mirror:
        placeholder = (mirror.local / dcp.METADATA_FILE).read_bytes()
        assert placeholder == bytes(len(placeholder))  # nothing of it on the local disk
        remote = dcp.read_info(mirror.local, stores=mirror)
    local = dcp.read_info(tiny_dcp)
    assert remote.tensors == local.tensors
    assert remote.objects == local.objects
    assert [p.code for p in remote.problems] == [p.code for p in local.problems]


def test_a_metadata_over_its_cap_is_refused_before_a_read(tiny_dcp: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from ckpttool.errors import InputError
    from ckpttool.formats.dcp import columns, metadata
    from ckpttool.storage import sidefiles

    url = _upload(tiny_dcp)
    monkeypatch.setattr(mirrors, "DOWNLOAD_LIMIT", 0)
    small = sidefiles.Kind(columns.METADATA_KIND.what, 10)
    monkeypatch.setattr(columns, "METADATA_KIND", small)
    with mirrors.Mirror(url, data_suffixes=urls.DATA_SUFFIXES, by_store=urls.BY_STORE,
                        backend=memory) as mirror, \
            pytest.raises(InputError, match=r"more than the 10 a DCP \.metadata file may hold"):
        metadata.read_metadata_object(mirror.local / dcp.METADATA_FILE, stores=mirror)
