"""integrity.json of a local Megatron-Core save, read through the reader's store as a remote
one is: held to the rules of every file of the save (a link out of it, a FIFO or a directory
there is an error, not followed or skipped), and its messages name integrity.json."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import ckpttool

SAVE = Path(__file__).parents[1] / "data" / "megatron" / "llama-common_state"


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(SAVE, run)
    return run


@pytest.mark.parametrize("planted", ["link-out", "fifo", "directory"])
def test_integrity_json_planted_is_an_error(tmp_path: Path, planted: str) -> None:
    """Not followed out of the save (as no data file is without --follow-links), never opened
    as a FIFO (it would block), not taken for absent when it is a directory: verify fails,
    saying the digests were not checked."""
    run = _run(tmp_path)
    integrity = run / "iter_0000002" / "integrity.json"
    if planted == "link-out":
        shutil.copy(integrity, tmp_path / "integrity.json")
        integrity.unlink()
        integrity.symlink_to(tmp_path / "integrity.json")
    elif planted == "fifo":
        integrity.unlink()
        os.mkfifo(integrity)
    else:
        integrity.unlink()
        integrity.mkdir()
    report = ckpttool.verify(run)
    assert not report.ok
    found = [p.message for p in report.problems if p.code == "integrity-unreadable"]
    assert len(found) == 1 and "the file digests were not checked" in found[0], found


def test_a_listed_file_missing_names_integrity_json(tmp_path: Path) -> None:
    run = _run(tmp_path)
    integrity = run / "iter_0000002" / "integrity.json"
    doc = json.loads(integrity.read_text())
    doc["files"]["extra.bin"] = "0" * 64
    integrity.write_text(json.dumps(doc))
    found = [p.message for p in ckpttool.verify(run).problems if p.code == "integrity-missing"]
    assert len(found) == 1 and ".metadata" not in found[0], found
    assert "listed in integrity.json but missing" in found[0]


def test_a_save_in_object_storage_has_its_digests_checked(tmp_path: Path) -> None:
    """The same save in object storage: every file integrity.json lists is hashed by ranged
    GETs (fetched ahead), and a byte changed in one is found."""
    from ckpttool.storage import memory
    from ckpttool.storage.objtree import ObjectTree
    from tests.storage.objects import upload_tree

    run = _run(tmp_path)
    url = upload_tree(run, "s3://integrity/save")
    with ObjectTree(url, backend=memory) as tree:
        report = ckpttool.verify(tree.local, stores=tree)
    assert report.ok, [p.message for p in report.problems]
    data = next((run / "iter_0000002").glob("*.distcp"))
    flipped = bytearray(data.read_bytes())
    flipped[len(flipped) // 2] ^= 1
    data.write_bytes(bytes(flipped))
    url = upload_tree(run, "s3://integrity/flipped")
    with ObjectTree(url, backend=memory) as tree:
        report = ckpttool.verify(tree.local, stores=tree)
    assert "integrity-mismatch" in {p.code for p in report.problems}
