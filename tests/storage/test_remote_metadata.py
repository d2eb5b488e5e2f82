"""A DCP checkpoint's ``.metadata`` read through the Stores a reader is handed (issue 37,
item 5), on the in-memory backend: a remote ``.metadata`` is read in place by ranged GETs,
with no local copy of it, and it describes the checkpoint exactly as the local copy does."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ckpttool.formats.dcp import reader as dcp
from ckpttool.storage import memory
from ckpttool.storage.objtree import ObjectTree
from tests.storage.objects import upload_tree

BUCKET = "meta"
_prefixes = itertools.count()


def _upload(local: Path) -> str:
    return upload_tree(local, f"s3://{BUCKET}/dcp/{next(_prefixes)}")


def test_the_metadata_is_read_by_ranges(tiny_dcp: Path) -> None:
    url = _upload(tiny_dcp)
    with ObjectTree(url, backend=memory) as tree:
        assert not (tree.local / dcp.METADATA_FILE).exists()  # nothing of it on the local disk
        remote = dcp.read_info(tree.local, stores=tree)
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
    small = sidefiles.Kind(columns.METADATA_KIND.what, 10)
    monkeypatch.setattr(columns, "METADATA_KIND", small)
    with ObjectTree(url, backend=memory) as tree, \
            pytest.raises(InputError, match=r"more than the 10 a DCP \.metadata file may hold"):
        metadata.read_metadata_object(tree.local / dcp.METADATA_FILE, stores=tree)
