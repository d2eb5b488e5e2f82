"""The contract every format module keeps, as one base class of tests (zarr's ``StoreTests``
pattern): :class:`FormatContract`. ``tests/formats/test_contract.py`` runs it once per format.

Everything here is generic: it knows a format only by its ``NAME`` and by what its
``read_info`` and ``Reader`` say (data files, chunks, payloads), never by its layout. Damaged
copies are made from that description alone: a byte of a chunk's elements flipped
(:func:`payload_sites`), a data file cut in the middle of a payload (:func:`truncate`), a data
file replaced by a directory or a FIFO (:func:`replace_data_file`).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from typer.testing import CliRunner, Result

import ckpttool
from ckpttool.cli import app
from ckpttool.core.checkpoint.discover import discover
from ckpttool.core.merge.report import MergeReport
from ckpttool.formats import registry
from ckpttool.formats.base import Whole
from tests.helpers import as_table, assert_bit_exact, json_table, load_out

Reference = dict[str, torch.Tensor]  # canonical name -> the full tensor
Ckpt = tuple[Path, Reference]  # what a subclass's ``ckpt`` fixture returns
Merged = tuple[Path, MergeReport]  # merge's output directory and report
HANG_SECONDS = 30  # a command on a hostile checkpoint that takes longer is hung


# --------------------------------------------------------------------------------------------
# Generic damage, from the format's own description of the checkpoint


@dataclass(frozen=True)
class Site:
    """A byte of a chunk's elements, and whether a checksum the format records covers it."""

    file: str  # relative to the checkpoint's base directory, as Location.file names it
    offset: int  # absolute byte offset in ``file``
    tensor: str  # canonical name
    checksummed: bool  # the chunk's Payload.crc32 is not None
    # The chunk's stored bytes are compressed (Payload.compression): no element byte lies in
    # the file, so the site is the middle of the compressed record, which the record's own
    # checks (decompression, the CRC-32s inside) must catch.
    compressed: bool = False


def copy_checkpoint(path: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoint (a directory, or a single file in a directory of its own)."""
    dst = tmp_path / "copy" / path.name
    dst.parent.mkdir(parents=True)
    if path.is_dir():
        shutil.copytree(path, dst)
    else:
        shutil.copy2(path, dst)
    return dst


def payload_sites(path: Path) -> list[Site]:
    """The first element byte of every non-empty chunk (the middle byte of a compressed one),
    in stored order."""
    fmt = registry.detect(path)
    assert fmt is not None, f"{path}: no format claims it"
    info = fmt.read_info(path)
    canonical = discover(path).canonical()
    sites = []
    with fmt.open_reader(info) as reader:
        for t in info.tensors:
            for c in t.chunks:
                if c.numel == 0:
                    continue
                p = reader.payload(t, c)
                if p.compression is not None:
                    sites.append(Site(p.file, p.storage_offset + p.storage_size // 2,
                                      canonical[t.name], False, compressed=True))
                    continue
                first = (p.start if p.start is not None
                         else p.storage_offset + p.view_offset * t.dtype.itemsize)
                sites.append(Site(p.file, first, canonical[t.name], p.crc32 is not None))
    return sites


def representative_sites(path: Path) -> list[Site]:
    """The first site a checksum covers and the first it does not, and the first compressed
    one (those that exist): a format may have several kinds (per-rank files: a piece that is
    a whole storage has the zip's CRC, a padded one has none)."""
    sites = payload_sites(path)
    assert sites, f"{path}: no chunk holds any bytes"
    chosen: dict[tuple[bool, bool], Site] = {}
    for s in sites:
        chosen.setdefault((s.checksummed, s.compressed), s)
    return list(chosen.values())


def flip(base: Path, site: Site) -> None:
    """Change one bit of the byte at ``site`` (the low bit: a bool stays a valid bool)."""
    with open(base / site.file, "r+b") as f:
        f.seek(site.offset)
        byte = f.read(1)
        assert len(byte) == 1
        f.seek(site.offset)
        f.write(bytes([byte[0] ^ 0x01]))


def base_of(path: Path) -> Path:
    """The directory the format's file names are relative to (``CheckpointInfo.base``)."""
    fmt = registry.detect(path)
    assert fmt is not None
    return fmt.read_info(path).base


def truncate(path: Path) -> str:
    """Cut the first data file that holds tensor bytes in the middle of the last of them;
    returns its name."""
    sites = payload_sites(path)
    file = sites[0].file
    fmt = registry.detect(path)
    assert fmt is not None
    info = fmt.read_info(path)
    ends = []
    with fmt.open_reader(info) as reader:
        for t in info.tensors:
            for c in t.chunks:
                if c.file == file and c.numel:
                    p = reader.payload(t, c)
                    start = p.start if p.start is not None else p.storage_offset
                    ends.append((start, p.storage_size if p.compression is not None
                                 else c.numel * t.dtype.itemsize))
    start, nbytes = max(ends)
    target = info.base / file
    with open(target, "r+b") as f:
        f.truncate(start + nbytes // 2)
    return file


def replace_data_file(path: Path, how: str) -> Path:
    """Replace the first data file by an empty directory or a FIFO; returns its path."""
    fmt = registry.detect(path)
    assert fmt is not None
    info = fmt.read_info(path)
    target = info.base / info.files[0].name
    target.unlink()
    if how == "directory":
        target.mkdir()
    else:
        os.mkfifo(target)
    return target


class Hung(BaseException):
    """Raised by the alarm: not an Exception, so neither ckpttool nor CliRunner catches it."""


def _release(fifo: Path | None) -> None:
    """Let a reader blocked opening ``fifo`` go on (it then reads end-of-file)."""
    if fifo is None:
        return
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: nobody is waiting to read it
        return
    os.close(fd)


@contextmanager
def no_hang(fifo: Path | None = None, seconds: int = HANG_SECONDS) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the body blocks longer than ``seconds``. A
    reader blocked on ``fifo`` (possibly in a worker thread) is released first, so that the
    worker can finish and the test fail cleanly."""

    def alarm(signum: int, frame: Any) -> None:
        _release(fifo)
        raise Hung(f"still running after {seconds} s (blocked on {fifo}?)")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        _release(fifo)


def cli(*args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def no_output_files(out: Path) -> bool:
    return not out.exists() or not any(out.rglob("*"))


# --------------------------------------------------------------------------------------------
# The contract


class FormatContract:
    """What every format module of :mod:`ckpttool.formats.registry` must do, checked on a
    checkpoint its real writer wrote at test time. Not collected itself (no ``Test`` prefix).

    Adding a format takes one small subclass named ``Test<Format>`` in
    ``tests/formats/test_contract.py`` (``test_every_format_runs_the_contract`` there fails
    until it exists) that provides two things:

    * ``FORMAT``: the format's ``NAME``;
    * a fixture ``ckpt``, scope ``class`` (as below) or ``session`` (the class-scoped
      ``merged`` builds on it), returning ``(path, reference)``: a checkpoint written by the
      format's real writer and what it holds, ``{canonical name: full torch.Tensor}``. Keep it
      tiny. Tests never damage it, only copies of it.

    For example::

        class TestTorchSave(FormatContract):
            FORMAT = "torch-save"

            @pytest.fixture(scope="class")
            @classmethod
            def ckpt(cls, tmp_path_factory):
                path = tmp_path_factory.mktemp("torch-save") / "pytorch_model.bin"
                torch.save(state := small_state(), path)
                return path, state

    Nothing else is per format: damage (a flipped payload byte, a truncated data file, a data
    file replaced by a directory or a FIFO) is made from what ``read_info`` and the ``Reader``
    say, and whether a damaged chunk must be caught by its own checksum (``crc-mismatch``) or
    only by comparison with an intact copy (``data-differs``) is decided per chunk from its
    ``Payload.crc32``, never by format name. A known bug of one format is marked by overriding
    that test in its subclass with ``pytest.mark.xfail(strict=True, reason=...)`` and calling
    ``super()``.
    """

    FORMAT: ClassVar[str]

    # -- shared results

    @pytest.fixture(scope="class")
    @classmethod
    def merged(cls, ckpt: Ckpt, tmp_path_factory: pytest.TempPathFactory) -> Merged:
        """``(output directory, MergeReport)`` of ``merge(path, out, dtype="keep",
        weights_only=True)``: the fixtures' tensors are no transformers model (a model in
        each format is held to its contract by tests/core/test_contract.py)."""
        out = tmp_path_factory.mktemp(f"contract-{cls.FORMAT}-merged") / "out"
        return out, ckpttool.merge(ckpt[0], out, dtype="keep", weights_only=True)

    # -- 1. detect

    def test_detect_claims_it(self, ckpt: Ckpt) -> None:
        path, _ = ckpt
        fmt = registry.detect(path)
        assert fmt is not None and fmt.NAME == self.FORMAT
        assert registry.by_name(self.FORMAT).detect(path)

    def test_pending_says_a_whole_checkpoint_is_complete(self, ckpt: Ckpt) -> None:
        """What the writer left complete is never waited for by merge --all."""
        path, _ = ckpt
        assert registry.by_name(self.FORMAT).pending(path) is None

    def test_detect_leaves_other_paths_alone(self, tmp_path: Path) -> None:
        fmt = registry.by_name(self.FORMAT)
        empty = tmp_path / "empty"
        empty.mkdir()
        text = tmp_path / "notes.txt"
        text.write_text("not a checkpoint\n")
        holds_text = tmp_path / "with-text"
        holds_text.mkdir()
        (holds_text / "README.md").write_text("# a model\n")
        for p in (empty, text, holds_text):
            assert not fmt.detect(p), p

    # -- 2. inspect

    def test_inspect_matches_reference(self, ckpt: Ckpt) -> None:
        path, reference = ckpt
        doc = ckpttool.inspect(path).to_json()
        assert doc["format"] == self.FORMAT
        assert json_table(doc) == as_table(reference)
        summary = doc["summary"]
        assert summary["num_tensors"] == len(reference) == len(doc["tensors"])
        assert summary["bytes"] == sum(v.numel() * v.element_size() for v in reference.values())

    def test_inspect_imports_no_torch(self, ckpt: Ckpt) -> None:
        path, _ = ckpt
        code = ("import json, sys\nfrom ckpttool import inspect\n"
                f"doc = inspect({str(path)!r}).to_json()\n"
                "assert 'torch' not in sys.modules, 'torch was imported'\n"
                "print(json.dumps(doc))\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=HANG_SECONDS, check=False)
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["format"] == self.FORMAT
        assert doc["tensors"] == ckpttool.inspect(path).to_json()["tensors"]

    # -- 3. verify, intact

    def test_verify_intact(self, ckpt: Ckpt) -> None:
        report = ckpttool.verify(ckpt[0])
        errors = [p for p in report.problems if p.severity == "error"]
        assert report.ok and not errors, errors
        assert report.format == self.FORMAT
        assert report.num_tensors == len(ckpt[1])

    def test_verify_against_merge_output(self, ckpt: Ckpt, merged: Merged) -> None:
        report = ckpttool.verify(ckpt[0], against=merged[0])
        assert "against" in report.checks
        assert report.ok, [p for p in report.problems if p.severity == "error"]

    # -- 4. verify, a flipped payload byte

    def test_flipped_payload_byte_is_found(self, ckpt: Ckpt, merged: Merged,
                                           tmp_path: Path) -> None:
        path, _ = ckpt
        for i, site in enumerate(representative_sites(path)):
            damaged = copy_checkpoint(path, tmp_path / str(i))
            flip(base_of(damaged), site)
            if site.compressed:  # the record's decompression or its CRC-32s must fail
                report = ckpttool.verify(damaged)
                found = [p for p in report.problems if p.severity == "error"
                         and p.code in ("crc-mismatch", "record-corrupt")]
                assert not report.ok, site
                assert found and {(p.location.file, p.location.tensor) for p in found} == {
                    (site.file, site.tensor)}, report.problems
            elif site.checksummed:
                report = ckpttool.verify(damaged)
                found = [p for p in report.problems if p.code == "crc-mismatch"]
                assert not report.ok, site
                assert found and all(p.severity == "error" for p in found), report.problems
                assert site.file in {p.location.file for p in found}, found
            else:  # nothing records a checksum: only a comparison can tell
                report = ckpttool.verify(damaged, against=merged[0])
                found = [p for p in report.problems if p.code == "data-differs"]
                assert not report.ok, site
                assert [p.location.tensor for p in found] == [site.tensor], report.problems

    # -- 5. a truncated data file

    def test_truncated_data_file_is_never_ok(self, ckpt: Ckpt, tmp_path: Path) -> None:
        damaged = copy_checkpoint(ckpt[0], tmp_path)
        file = truncate(damaged)
        try:
            report = ckpttool.verify(damaged)
        except ckpttool.InputError as e:  # the metadata itself was cut
            assert "\n" not in str(e) and file in str(e), str(e)
        else:
            errors = [p for p in report.problems if p.severity == "error"]
            assert not report.ok and errors
            assert any(p.location.file == file or file in p.message for p in errors), errors
        out = tmp_path / "out"
        with pytest.raises(ckpttool.CkptError):
            ckpttool.merge(damaged, out, dtype="keep", weights_only=True)
        assert no_output_files(out)

    # -- 6. merge

    def test_merge_is_bit_exact(self, ckpt: Ckpt, merged: Merged) -> None:
        out, report = merged
        assert report.format == self.FORMAT
        assert report.num_tensors == len(ckpt[1])
        assert_bit_exact(load_out(out), ckpt[1])

    def test_read_whole_gives_every_tensor(self, ckpt: Ckpt) -> None:
        """The one data verb: ``Reader.read(Whole(...))`` makes every tensor whole as the
        reference holds it, with and without checksums; not strict, each tensor is the
        same or None (the caller then reads it its own way)."""
        path, reference = ckpt
        fmt = registry.detect(path)
        assert fmt is not None
        info = fmt.read_info(path)
        canonical = discover(path).canonical()
        ts = list(info.tensors)
        dsts = list(itertools.accumulate((t.nbytes for t in ts), initial=0))
        want = b"".join(reference[canonical[t.name]].reshape(-1).contiguous()
                        .view(torch.uint8).numpy().tobytes() for t in ts)
        with fmt.open_reader(info) as reader:
            for strict, checksums in ((True, False), (True, True), (False, True)):
                out = bytearray(dsts[-1])
                got = reader.read(Whole(ts, out, dsts[:-1], checksums=checksums,
                                        strict=strict))
                assert len(got) == len(ts)
                for t, at, g in zip(ts, dsts, got, strict=False):
                    if strict or g is not None:
                        assert out[at : at + t.nbytes] == want[at : at + t.nbytes], t.name

    # -- 7. hostile data files: an error, never a hang, never success

    def _check_replaced_data_file(self, how: str, ckpt: Ckpt, tmp_path: Path) -> None:
        damaged = copy_checkpoint(ckpt[0], tmp_path)
        target = replace_data_file(damaged, how)
        out = tmp_path / "out"
        with no_hang(target if how == "fifo" else None):
            inspected = cli("inspect", damaged, "--json")
            verified = cli("verify", damaged)
            merging = cli("merge", damaged, out, "--dtype", "keep", "--weights-only", "-q")
        # inspect reads metadata only: it may describe the checkpoint, or refuse it (never a
        # traceback: exit 70 is an internal error)
        assert inspected.exit_code in (0, 3), inspected.output
        if inspected.exit_code == 0:
            assert json.loads(inspected.stdout)["format"] == self.FORMAT
        assert verified.exit_code in (1, 3), verified.output
        assert merging.exit_code == 3, merging.output
        assert no_output_files(out)

    def test_data_file_replaced_by_directory(self, ckpt: Ckpt, tmp_path: Path) -> None:
        self._check_replaced_data_file("directory", ckpt, tmp_path)

    def test_data_file_replaced_by_fifo(self, ckpt: Ckpt, tmp_path: Path) -> None:
        self._check_replaced_data_file("fifo", ckpt, tmp_path)

    # -- 8. the command line

    def test_cli_inspect_json_names_the_format(self, ckpt: Ckpt) -> None:
        r = cli("inspect", ckpt[0], "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        assert doc["format"] == self.FORMAT
        assert json_table(doc) == as_table(ckpt[1])

    def test_cli_verify_intact_exit_0(self, ckpt: Ckpt) -> None:
        r = cli("verify", ckpt[0])
        assert r.exit_code == 0, r.output
        assert r.stdout.splitlines()[-1].startswith("verify OK: ")

    def test_cli_verify_damaged_exit_1(self, ckpt: Ckpt, merged: Merged, tmp_path: Path) -> None:
        path, _ = ckpt
        site = representative_sites(path)[0]
        damaged = copy_checkpoint(path, tmp_path / "flipped")
        flip(base_of(damaged), site)
        against = () if site.checksummed or site.compressed else ("--against", merged[0])
        r = cli("verify", damaged, *against)
        assert r.exit_code == 1, r.output

        cut = copy_checkpoint(path, tmp_path / "cut")
        truncate(cut)
        try:
            ckpttool.verify(cut)
            want = 1
        except ckpttool.InputError:  # the metadata itself is unreadable
            want = 3
        r = cli("verify", cut)
        assert r.exit_code == want, r.output
