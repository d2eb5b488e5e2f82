"""A resumed merge trusts no journal line for bytes it cannot read back (finding 5 of issue
34): each finished piece's CRC-32 is kept in the journal and checked before the piece is
skipped; forged lines or bytes changed in place are written again, never exit 0 with
zeros."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from ckpttool.core.merge.operation import merge
from tests.helpers import RESUME_PIECE, assert_step_exact, cut_merge


@pytest.mark.parametrize("doubt", ["lines forged", "lines without a CRC", "bytes zeroed",
                                   "byte flipped"])
def test_a_journal_line_is_checked_against_the_bytes(trained: Path, tmp_path: Path,
                                                     doubt: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src, out = tmp_path / "checkpoint-3", tmp_path / "out"
    shutil.copytree(trained / "run" / "checkpoint-3", src)
    cut_merge([str(src), str(out)])
    (journal,) = out.glob(".*.journal.ckpttool-tmp")
    (temp,) = out.glob(".model.safetensors.*.ckpttool-tmp")
    head, *done = journal.read_text().splitlines()
    assert len(done) == 2 and all("crc32" in json.loads(line) for line in done)
    with open(temp, "rb") as f:
        data_start = 8 + struct.unpack("<Q", f.read(8))[0]
    if doubt == "lines forged":
        # Every piece claimed done, with made-up CRCs, over a file whose last piece is zeros.
        lines = [json.dumps({"piece": json.loads(line)["piece"], "bytes": 1, "crc32": 0})
                 for line in done]
        lines.append(json.dumps({"piece": "0:0-999999", "bytes": 1, "crc32": 0}))
        journal.write_text("\n".join([head, *lines]) + "\n")
        redone = 0
    elif doubt == "lines without a CRC":  # the journal of an older ckpttool
        lines = [json.dumps({"piece": json.loads(line)["piece"], "bytes": 1}) for line in done]
        journal.write_text("\n".join([head, *lines]) + "\n")
        redone = 0
    elif doubt == "bytes zeroed":
        size = temp.stat().st_size
        with open(temp, "r+b") as f:
            f.seek(data_start)
            f.write(bytes(size - data_start))
        redone = 0
    else:  # one byte of the first piece changed in place
        with open(temp, "r+b") as f:
            f.seek(data_start + 10)
            byte = f.read(1)
            f.seek(data_start + 10)
            f.write(bytes([byte[0] ^ 1]))
        redone = 1
    monkeypatch.setenv("CKPTTOOL_RESUME_PIECE", RESUME_PIECE)
    report = merge(src, out, weights_only=True)
    assert report.resumed is not None and report.resumed.done_before == redone
    assert_step_exact(out, trained, 3)


def test_a_piece_that_cannot_be_recorded_stops_the_merge_and_the_rest_resumes(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces are recorded in a thread of their own while the next one is written: a piece
    whose record fails (a full disk under the journal: here the second piece's) still stops
    the merge with the output error, nothing is published, the piece recorded before it
    stays for the next run, which finishes bit-exact."""
    from ckpttool.core.merge import resume
    from ckpttool.errors import OutputError

    src, out = trained / "run" / "checkpoint-3", tmp_path / "out"
    monkeypatch.setenv("CKPTTOOL_RESUME_PIECE", RESUME_PIECE)
    real = resume._record
    calls: list[str] = []

    def failing(journal: Path, fd: int, piece: resume.Piece, plan: object) -> None:
        calls.append(piece.key)
        if len(calls) == 2:  # a fault injected on the failure path only
            raise OutputError(f"{journal}: no space left on device")
        real(journal, fd, piece, plan)  # type: ignore[arg-type]

    monkeypatch.setattr(resume, "_record", failing)
    with pytest.raises(OutputError, match="no space left"):
        merge(src, out, weights_only=True)
    assert not (out / "model.safetensors").exists()
    (journal,) = out.glob(".*.journal.ckpttool-tmp")
    assert len(journal.read_text().splitlines()) == 2  # its head, and the first piece

    monkeypatch.setattr(resume, "_record", real)
    report = merge(src, out, weights_only=True)
    assert report.resumed is not None and report.resumed.done_before == 1
    assert_step_exact(out, trained, 3)
