"""DCP checkpoints of many small chunks (the shape of mixture-of-experts models), written by
torch's own writer through benchmarks/moe_checkpoint.py: records decoded as templates must give
exactly what a full decode gives, and damage in any record is still found."""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckpttool
from ckpttool.formats.base import Checksummed, Payload, Tensor
from ckpttool.formats.codecs.crc import crc32
from ckpttool.formats.dcp import reader as dcp
from tests.helpers import load_out

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_checkpoint  # noqa: E402

LAYERS, EXPERTS, RANKS = 2, 3, 8


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "ckpt"
    counts = moe_checkpoint.write_one_process(out, layers=LAYERS, experts=EXPERTS, ranks=RANKS,
                                              files=5)
    assert counts["chunks"] > 150
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def _late_chunk(info: object, name: str = "model.model.layers.1.mlp.experts.2.up_proj.weight"
                ) -> tuple[Tensor, dcp.Chunk]:
    """The last chunk of a tensor: decoded through a template built from earlier ones."""
    t = info.tensor(name)  # type: ignore[attr-defined]
    return t, t.chunks[-1]


def test_merge_is_bit_exact(moe: Path, tmp_path: Path) -> None:
    ckpttool.merge(moe, tmp_path / "out", dtype="keep", weights_only=True)
    got = load_out(tmp_path / "out")
    want = moe_checkpoint.moe_state(LAYERS, EXPERTS)
    assert set(got) == set(want)
    for name, ref in want.items():
        assert torch.equal(got[name].view(torch.uint8), ref.view(torch.uint8)), name


def test_templates_decode_exactly_as_a_full_decode(moe: Path) -> None:
    info = dcp.read_info(moe)
    unread = 0
    with dcp.DcpReader(info) as fast, dcp.DcpReader(info, templates=False) as full:
        for t in info.tensors:
            for c in t.chunks:
                got, want = fast.payload(t, c, checksums=True), full.payload(t, c, checksums=True)
                # A template hands over the side entries' bytes it read; a full decode does not.
                for s in got.side:
                    assert s.data is None or s.data == (moe / c.file).read_bytes()[
                        s.offset : s.offset + s.size]
                bare = tuple(dataclasses.replace(s, data=None) for s in got.side)
                # ...and the stored bytes it read with the record (small records; not the
                # record a template is made from, which is decoded in full).
                if got.data is None:
                    unread += 1
                else:
                    assert bytes(got.data) == _stored(moe, got)
                assert dataclasses.replace(got, side=bare, data=None) == want
    assert fast._templates and not full._templates
    assert unread == len(fast._templates)


def _stored(root: Path, p: Payload) -> bytes:
    """The bytes a payload's ``storage_offset`` and ``storage_size`` name, from the file."""
    with open(root / p.file, "rb") as f:
        f.seek(p.storage_offset)
        return f.read(p.storage_size)


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(data)


def _flipped_payload(moe: Path, tmp_path: Path, at: int
                     ) -> tuple[Path, Tensor, dcp.Chunk, int]:
    """A copy with byte ``at`` of a late chunk's stored bytes flipped; and where they begin."""
    damaged = _copy(moe, tmp_path)
    info = dcp.read_info(damaged)
    t, c = _late_chunk(info)
    with dcp.DcpReader(info, templates=False) as r:
        p = r.payload(t, c)
    _flip(damaged / c.file, p.storage_offset + at)
    return damaged, t, c, p.storage_offset


def test_flipped_payload_byte_in_a_templated_record(moe: Path, tmp_path: Path) -> None:
    damaged, _, _, stored = _flipped_payload(moe, tmp_path, 3)
    report = ckpttool.verify(damaged)
    assert [x.code for x in report.problems if x.severity == "error"] == ["crc-mismatch"]
    assert report.problems[0].location.offset == stored


@pytest.mark.parametrize("entry", ["data.pkl", "version", "byteorder"])
def test_damage_in_a_templated_record_header(entry: str, moe: Path, tmp_path: Path) -> None:
    damaged = _copy(moe, tmp_path)
    info = dcp.read_info(damaged)
    t, c = _late_chunk(info)
    with dcp.DcpReader(info, templates=False) as r:
        side = {s.what: s for s in r.payload(t, c, checksums=True).side}
    s = side[f"record entry '{entry}'"]
    _flip(damaged / c.file, s.offset + s.size - 1, 0x02)
    report = ckpttool.verify(damaged)
    errors = [x for x in report.problems if x.severity == "error"]
    assert errors, "damage in a record header went unnoticed"
    assert errors[0].code in ("crc-mismatch", "record-corrupt")
    assert any(f"'{entry}'" in x.message or x.code == "record-corrupt" for x in errors)


def test_changed_crc_field_in_a_templated_record(moe: Path, tmp_path: Path) -> None:
    """The CRC the central directory records, read through the template's positions."""
    damaged = _copy(moe, tmp_path)
    info = dcp.read_info(damaged)
    t, c = _late_chunk(info)
    raw = (damaged / c.file).read_bytes()[c.offset : c.offset + c.length]
    central = raw.rfind(b"PK\x01\x02")  # the last central entry; its CRC field is at +16
    (crc,) = struct.unpack_from("<I", raw, central + 16)
    data = bytearray((damaged / c.file).read_bytes())
    struct.pack_into("<I", data, c.offset + central + 16, crc ^ 0xFFFF)
    (damaged / c.file).write_bytes(data)
    report = ckpttool.verify(damaged)
    assert [x.code for x in report.problems if x.severity == "error"] == ["crc-mismatch"]


def test_a_record_that_differs_from_its_template_is_decoded_in_full(moe: Path,
                                                                    tmp_path: Path) -> None:
    """A late record whose pickle promises another shape: refused, not copied by template."""
    damaged = _copy(moe, tmp_path)
    info = dcp.read_info(damaged)
    t, c = _late_chunk(info)
    with dcp.DcpReader(info, templates=False) as r:
        side = {s.what: s for s in r.payload(t, c, checksums=True).side}
    pkl = side["record entry 'data.pkl'"]
    data = bytearray((damaged / c.file).read_bytes())
    body = bytes(data[pkl.offset : pkl.offset + pkl.size])
    rows = c.sizes[0]
    # The chunk's size (rows, 32) is pickled as two small ints (BININT1): make it (rows, 16).
    at = body.find(bytes([0x4B, rows, 0x4B, 32]))
    assert at >= 0
    data[pkl.offset + at + 3] = 16
    (damaged / c.file).write_bytes(data)
    with pytest.raises(ckpttool.InputError, match="record holds BF16 .* but .metadata promises"):
        ckpttool.merge(damaged, tmp_path / "out", weights_only=True)


@pytest.mark.parametrize("name", ["model.model.embed_tokens.weight",  # data larger than headers
                                  "model.model.layers.1.mlp.experts.2.up_proj.weight"])
def test_any_header_byte_changed_decodes_as_a_full_decode(name: str, moe: Path,
                                                          tmp_path: Path) -> None:
    """Every byte of a late record outside its storage's data, changed in turn: the templated
    reader must agree with a full decode (the same payload, or an error)."""
    damaged = _copy(moe, tmp_path)
    info = dcp.read_info(damaged)
    t, c = _late_chunk(info, name)
    with dcp.DcpReader(info, templates=False) as r:
        p = r.payload(t, c)
    path = damaged / c.file
    data_lo, data_hi = p.storage_offset - c.offset, p.storage_offset - c.offset + p.storage_size

    def outcome(reader: dcp.DcpReader) -> object:
        try:
            got = reader.payload(t, c, checksums=True)
        except ckpttool.CkptError as e:
            return type(e)
        assert got.data is None or bytes(got.data) == _stored(damaged, got)
        return dataclasses.replace(got, side=tuple(dataclasses.replace(s, data=None)
                                                   for s in got.side), data=None)

    with dcp.DcpReader(info) as fast:
        fast.payload(t, t.chunks[0])  # the template, from an intact record
        for i in _each_byte_changed(path, c.offset, [*range(0, data_lo),
                                                     *range(data_hi, c.length)]):
            fast.store.close()  # reopen the changed file
            with dcp.DcpReader(info, templates=False) as full:
                assert outcome(fast) == outcome(full), f"byte {i} of the record"


def _each_byte_changed(path: Path, base: int, offsets: list[int]) -> Iterator[int]:
    """Each of ``offsets`` in turn, with byte ``base + offset`` of the file at ``path``
    changed (xor 0x04) and every other byte as it was. The byte is changed and put back in
    place: rewriting the whole file each time made the sweeps wait on the disk (each
    truncating open waited for the last rewrite's writeback, 40 ms a time on a busy disk)."""
    fd = os.open(path, os.O_RDWR)
    try:
        for i in offsets:
            (was,) = os.pread(fd, 1, base + i)
            os.pwrite(fd, bytes([was ^ 0x04]), base + i)
            try:
                yield i
            finally:
                os.pwrite(fd, bytes([was]), base + i)
    finally:
        os.close(fd)


def _bare(p: Payload) -> Payload:
    return dataclasses.replace(p, data=None, side=tuple(dataclasses.replace(s, data=None)
                                                       for s in p.side))


def _stored_side(root: Path, s: Checksummed) -> bytes:
    with open(root / s.file, "rb") as f:
        f.seek(s.offset)
        return f.read(s.size)


def _check_batched(root: Path, *, file_order: bool = True) -> int:
    """``Reader.payloads`` over every chunk (in file and offset order, as merge asks, or in
    the tensors' order, as verify asks) against ``payload`` one chunk at a time; returns how
    many payloads came with their stored bytes."""
    info = dcp.read_info(root)
    items = [(t, c) for t in info.tensors for c in t.chunks]
    if file_order:
        items.sort(key=lambda tc: (tc[1].file, tc[1].offset))
    with_data = 0
    with dcp.DcpReader(info) as batched, dcp.DcpReader(info, templates=False) as one:
        for _ in range(2):  # cold (templates being made), then warm
            got = list(batched.payloads(items, checksums=True))
            assert len(got) == len(items)
            for (t, c), p in zip(items, got, strict=True):
                q = one.payload(t, c, checksums=True)
                if p.checked:  # the record's other entries, checked while decoding...
                    assert not p.side and p.checked == sum(s.size for s in q.side)
                    # ...and rightly so: each one's bytes have the CRC-32 its header records.
                    assert all(crc32(_stored_side(root, s)) == s.crc32 for s in q.side)
                    q = dataclasses.replace(q, side=(), checked=p.checked)
                assert _bare(p) == _bare(q), (t.name, c)
                if p.data is not None:
                    assert bytes(p.data) == _stored(root, p)
                    with_data += 1
    return with_data


def test_payloads_read_back_to_back_records_together(moe: Path) -> None:
    """In file order, each file's records come in one read (they lie back to back), all
    decoded from memory with their stored bytes, exactly as one at a time."""
    info = dcp.read_info(moe)
    items = sorted(((t, c) for t in info.tensors for c in t.chunks),
                   key=lambda tc: (tc[1].file, tc[1].offset))
    with dcp.DcpReader(info) as r:
        list(r.payloads(items))  # templates made
        reads = []
        pread = r.store.pread
        r.store.pread = lambda name, size, offset: reads.append(size) or pread(  # type: ignore[method-assign]
            name, size, offset)
        got = list(r.payloads(items))
    assert len(reads) == len(info.files)  # one per file (each well under dcp._SPAN)
    assert all(p.data is not None for p in got)
    assert _check_batched(moe) > len(items)  # and the same as one at a time, cold and warm


def test_payloads_in_tensor_order(moe: Path) -> None:
    assert _check_batched(moe, file_order=False) > 0


@pytest.mark.parametrize("kind,world", [("placements", None), ("uneven", 11), ("mixed", None)])
def test_payloads_of_real_layouts(kind: str, world: int | None, make_checkpoint) -> None:
    """Replicate, Shard(1), bf16, uneven and empty pieces, several dtypes: batched as one
    at a time."""
    from examples.fsdp2_checkpoint import MODEL_DIR

    root = make_checkpoint(kind, world) / MODEL_DIR
    assert _check_batched(root) > 0
    assert _check_batched(root, file_order=False) > 0


def test_payloads_of_a_truncated_file_fail_as_one_at_a_time(moe: Path, tmp_path: Path) -> None:
    damaged = _copy(moe, tmp_path)
    info = dcp.read_info(damaged)
    t, c = _late_chunk(info)
    path = damaged / c.file
    path.write_bytes(path.read_bytes()[: c.offset + c.length // 2])
    items = sorted(((t2, c2) for t2 in info.tensors for c2 in t2.chunks if c2.file == c.file),
                   key=lambda tc: tc[1].offset)
    with dcp.DcpReader(info) as r, pytest.raises(ckpttool.InputError) as one:
        r.payload(t, c)
    with dcp.DcpReader(info) as r:
        got = []
        with pytest.raises(ckpttool.InputError) as batched:
            for p in r.payloads(items):
                got.append(p)
    assert str(batched.value) == str(one.value)
    assert len(got) == next(i for i, (_, c2) in enumerate(items) if c2.end > c.offset)


def _check_elements(root: Path) -> int:
    """``Reader.elements`` and ``checked_elements`` over every chunk in stored order (as merge
    windows and verify groups ask), cold then warm: each chunk they hand over equals its
    ``read_chunk`` bytes, and what they count as checked is the record's stored entries;
    returns how many came from memory."""
    from ckpttool.core.checkpoint.tensors import stored_order

    info = dcp.read_info(root)
    tensors = list(info.tensors)
    items = [(tensors[i], k) for _, _, i, k in stored_order(tensors)]
    given = 0
    with dcp.DcpReader(info) as r, dcp.DcpReader(info, templates=False) as full:
        for _ in range(2):
            for (t, k), data, checked in zip(items, r.elements(items),
                                             r.checked_elements(items), strict=True):
                c = t.chunks[k]
                want = full.read_chunk(t, c)
                if data is None:  # the caller reads it itself, which makes its template
                    assert checked is None
                    assert r.read_chunk(t, c) == want
                    continue
                assert bytes(data) == want, (t.name, c)
                assert checked is not None and bytes(checked[0]) == want
                p = full.payload(t, c, checksums=True)
                assert checked[1] == p.storage_size + sum(s.size for s in p.side)
                given += 1
    return given


def test_elements_of_many_chunks(moe: Path) -> None:
    info = dcp.read_info(moe)
    num = sum(len(t.chunks) for t in info.tensors)
    # Every chunk but the first of each record shape, in both passes.
    assert _check_elements(moe) >= 2 * num - 2 * len({(c.length, t.dtype, c.sizes)
                                                      for t in info.tensors for c in t.chunks})


@pytest.mark.parametrize("kind,world", [("placements", None), ("uneven", 11), ("mixed", None)])
def test_elements_of_real_layouts(kind: str, world: int | None, make_checkpoint) -> None:
    """Replicate, Shard(1), uneven and empty pieces, several dtypes and files per rank."""
    from examples.fsdp2_checkpoint import MODEL_DIR

    assert _check_elements(make_checkpoint(kind, world) / MODEL_DIR) > 0


def test_checked_elements_withhold_a_chunk_whose_checksum_fails(moe: Path,
                                                               tmp_path: Path) -> None:
    damaged, t, c, _ = _flipped_payload(moe, tmp_path, 1)
    info = dcp.read_info(damaged)
    from ckpttool.core.checkpoint.tensors import stored_order

    tensors = list(info.tensors)
    items = [(tensors[i], k) for _, _, i, k in stored_order(tensors)]
    with dcp.DcpReader(info) as r:
        for (t2, k2), data in zip(items, r.elements(items), strict=True):
            if data is None:
                r.read_chunk(t2, t2.chunks[k2])  # templates made, as a caller makes them
        got = dict(zip([(t.name, k) for t, k in items], r.checked_elements(items),
                       strict=True))
        plain = dict(zip([(t.name, k) for t, k in items], r.elements(items), strict=True))
    k = next(i for i, x in enumerate(t.chunks) if x == c)
    assert got[(t.name, k)] is None  # withheld: the caller reads it and reports the CRC
    assert plain[(t.name, k)] is not None  # a copy checks no CRC
    assert sum(v is not None for v in got.values()) == len(got) - 1


def _whole(reader: dcp.DcpReader, t: Tensor) -> bytes:
    from ckpttool.core.checkpoint.tensors import read_range

    return bytes(read_range(reader, t, 0, t.numel))


def _check_fill(root: Path) -> tuple[int, int]:
    """``Reader.fill_rows`` over every tensor of rows at once, cold then warm, without and
    with checksums: each tensor it fills equals its chunks decoded in full one by one, and
    what it counts as checked is every entry of every record. Returns (tensors of rows,
    tensors filled in the three passes)."""
    from ckpttool.core.checkpoint.tensors import row_starts

    info = dcp.read_info(root)
    ts = [t for t in info.tensors if row_starts(t) is not None]
    dsts = list(itertools.accumulate((t.nbytes for t in ts), initial=0))
    filled = 0
    with dcp.DcpReader(info) as r, dcp.DcpReader(info, templates=False) as full:
        assert full.fill_rows(ts, bytearray(dsts[-1]), dsts[:-1]) == [None] * len(ts)
        for checksums in (False, True, True):
            out = bytearray(dsts[-1])
            got = r.fill_rows(ts, out, dsts[:-1], checksums=checksums)
            for t, at, n in zip(ts, dsts, got, strict=False):
                if n is None:
                    continue
                assert bytes(out[at : at + t.nbytes]) == _whole(full, t), t.name
                payloads = [full.payload(t, c, checksums=True) for c in t.chunks]
                assert n == (sum(p.storage_size + sum(s.size for s in p.side)
                                 for p in payloads) if checksums else 0)
                filled += 1
    return len(ts), filled


def test_fill_rows_of_many_chunks(moe: Path) -> None:
    num, filled = _check_fill(moe)
    assert filled == 3 * num  # every tensor, cold and warm


def test_fill_rows_past_the_kept_span_buffer(moe: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """Spans that claim more than a thread's kept buffer (a damaged .metadata can claim
    gigabytes) are read one by one, each at most to its file's end, and fill the same."""
    from ckpttool.formats.dcp import records

    monkeypatch.setattr(records, "_KEEP", 0)
    num, filled = _check_fill(moe)
    assert filled == 3 * num


@pytest.mark.parametrize("kind,world", [("placements", None), ("uneven", 11), ("mixed", None)])
def test_fill_rows_of_real_layouts(kind: str, world: int | None, make_checkpoint) -> None:
    """Replicate, Shard(1), uneven and empty pieces, several dtypes and files per rank."""
    from examples.fsdp2_checkpoint import MODEL_DIR

    _check_fill(make_checkpoint(kind, world) / MODEL_DIR)


def test_fill_rows_withholds_a_tensor_whose_checksum_fails(moe: Path, tmp_path: Path) -> None:
    damaged, t, _, _ = _flipped_payload(moe, tmp_path, 1)
    info = dcp.read_info(damaged)
    ts = list(info.tensors)
    dsts = list(itertools.accumulate((x.nbytes for x in ts), initial=0))
    i = next(j for j, x in enumerate(ts) if x.name == t.name)
    with dcp.DcpReader(info) as r, dcp.DcpReader(info, templates=False) as full:
        checked = r.fill_rows(ts, bytearray(dsts[-1]), dsts[:-1], checksums=True)
        out = bytearray(dsts[-1])
        plain = r.fill_rows(ts, out, dsts[:-1])
        assert bytes(out[dsts[i] : dsts[i + 1]]) == _whole(full, ts[i])
    assert checked[i] is None  # withheld: the caller reads it and reports the CRC
    assert plain[i] is not None  # a copy checks no CRC
    assert sum(v is not None for v in checked) == len(ts) - 1


@pytest.mark.parametrize("entry", ["data.pkl", "byteorder", ".format_version"])
def test_fill_rows_withholds_a_record_unlike_its_neighbours(entry: str, moe: Path,
                                                            tmp_path: Path) -> None:
    """A byte changed in one record amid records that lie back to back (compared in place,
    in runs, by ``fill_rows``): that tensor alone is withheld, with or without checksums
    (``data.pkl`` and ``byteorder`` are compared with the template; ``.format_version``'s
    CRC-32 is computed), and every other tensor is filled as a full decode fills it."""
    from ckpttool.formats.dcp import records

    damaged = _copy(moe, tmp_path)
    info = dcp.read_info(damaged)
    t, c = _late_chunk(info)
    path = damaged / c.file
    data = bytearray(path.read_bytes())
    ts = list(info.tensors)
    dsts = list(itertools.accumulate((x.nbytes for x in ts), initial=0))
    i = next(j for j, x in enumerate(ts) if x.name == t.name)
    with open(path, "rb") as f:
        entries = records.record_entries(lambda size, off: (f.seek(off), f.read(size))[1],
                                         offset=c.offset, length=c.length, where=c.file)
    (e,) = (e for e in entries if e.name.endswith(entry))
    data[e.data_offset] ^= 0x01
    path.write_bytes(data)
    with dcp.DcpReader(info) as r, dcp.DcpReader(info, templates=False) as full:
        for checksums in ([True] if entry == ".format_version" else [False, True]):
            out = bytearray(dsts[-1])
            got = r.fill_rows(ts, out, dsts[:-1], checksums=checksums)
            assert got[i] is None, checksums
            assert sum(v is None for v in got) == 1
            for j in (0, i - 1, i + 1, len(ts) - 1):
                assert bytes(out[dsts[j] : dsts[j + 1]]) == _whole(full, ts[j])


@pytest.mark.parametrize("name", ["model.model.embed_tokens.weight",
                                  "model.model.layers.1.mlp.experts.2.up_proj.weight"])
@pytest.mark.slow
def test_any_header_byte_changed_fills_as_a_full_decode(name: str, moe: Path,
                                                        tmp_path: Path) -> None:
    """Every byte of a late record outside its storage's data, changed in turn: a tensor
    ``fill_rows`` fills is one whose every chunk a full decode reads, to the same bytes, with
    every CRC-32 matching; else it is withheld."""
    damaged = _copy(moe, tmp_path)
    info = dcp.read_info(damaged)
    t, c = _late_chunk(info, name)
    with dcp.DcpReader(info, templates=False) as r:
        p = r.payload(t, c)
    path = damaged / c.file
    data_lo, data_hi = p.storage_offset - c.offset, p.storage_offset - c.offset + p.storage_size
    withheld = 0
    with dcp.DcpReader(info) as fast:
        fast.payload(t, t.chunks[0])  # the template, from an intact record
        for i in _each_byte_changed(path, c.offset, [*range(0, data_lo),
                                                     *range(data_hi, c.length)]):
            fast.store.close()  # reopen the changed file
            for checksums in (False, True):
                out = bytearray(t.nbytes)
                (got,) = fast.fill_rows([t], out, [0], checksums=checksums)
                if got is None:
                    withheld += 1
                    continue
                with dcp.DcpReader(info, templates=False) as full:
                    assert bytes(out) == _whole(full, t), f"byte {i} of the record"
                    if checksums:
                        for x in t.chunks:
                            q = full.payload(t, x, checksums=True)
                            assert crc32(_stored(damaged, q)) == q.crc32, f"byte {i}"
                            assert all(crc32(_stored_side(damaged, s)) == s.crc32
                                       for s in q.side), f"byte {i}"
    assert withheld  # a changed header byte is never silently accepted everywhere
