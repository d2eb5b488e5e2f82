"""The columnar ``.metadata`` reader (formats/dcp_metadata.py) against the allow-list
unpickler it stands in for: on every DCP fixture the two give the same tensors, chunks, objects
and version, field by field; on mutated files the columnar reader either gives what the
allow-list path gives or leaves the file to it (None), never a different answer."""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpttool.errors import InputError
from ckpttool.formats.base import ChunkColumns
from ckpttool.formats.dcp import columns as dcp_metadata
from ckpttool.formats.dcp import machine, opcodes
from ckpttool.formats.dcp import reader as dcp
from ckpttool.formats.dcp.metadata import allowed_global

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_checkpoint  # noqa: E402

from tests.helpers import allow_list_read, columns_agree  # noqa: E402


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "ckpt"
    moe_checkpoint.write_one_process(out, layers=2, experts=3, ranks=8, files=5)
    return out


def _metadata_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.metadata") if p.is_file())


def test_every_fixture_reads_the_same(llama_ckpt: Path, uneven_ckpt: Path, wrappers_ckpt: Path,
                                      mixed_ckpt: Path, placements_ckpt: Path,
                                      dcp_options: Path, moe: Path) -> None:
    answered: dict[Path, bool] = {}
    for root in (llama_ckpt, uneven_ckpt, wrappers_ckpt, mixed_ckpt, placements_ckpt,
                 dcp_options, moe):
        files = _metadata_files(root)
        assert files, root
        for md in files:
            answered[md] = columns_agree(md)
    # Every fixture has saves the columns read (the test would pass vacuously otherwise).
    for root in (llama_ckpt, uneven_ckpt, wrappers_ckpt, mixed_ckpt, placements_ckpt,
                 dcp_options, moe):
        assert any(v for md, v in answered.items() if md.is_relative_to(root)), root
    print(sorted((str(md), v) for md, v in answered.items()))


def test_moe_chunks_are_columns(moe: Path) -> None:
    info = dcp.read_info(moe)
    assert all(isinstance(t.chunks, ChunkColumns) for t in info.tensors)
    t = info.tensors[-1]
    assert t.chunks[-1] == list(t.chunks)[-1] and t.chunks[-len(t.chunks)] == t.chunks[0]
    assert t.chunks[1:3] == tuple(t.chunks)[1:3]
    with pytest.raises(IndexError):
        t.chunks[len(t.chunks)]


def test_read_info_is_unchanged_by_the_columns(moe: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    fast = dcp.read_info(moe)
    monkeypatch.setattr(dcp_metadata, "read", lambda *a, **k: None)
    slow = dcp.read_info(moe)
    assert fast.tensors == slow.tensors and fast.objects == slow.objects
    assert fast.files == slow.files and fast.storage == slow.storage
    assert fast.num_ranks == slow.num_ranks and fast.version == slow.version


def _mutations(data: bytes, rng: random.Random, n: int) -> list[bytes]:
    out = []
    interesting = b"\x94hjKMJ\x8a\x8c)(}]uebR\x81\x85\x86\x87t.N\x95"
    for _ in range(n):
        kind = rng.randrange(5)
        at = rng.randrange(2, len(data))
        if kind == 0:  # flip a bit
            b = bytearray(data)
            b[at] ^= 1 << rng.randrange(8)
        elif kind == 1:  # an opcode in place of a byte
            b = bytearray(data)
            b[at] = interesting[rng.randrange(len(interesting))]
        elif kind == 2:  # truncated
            b = bytearray(data[:at])
        elif kind == 3:  # a byte dropped
            b = bytearray(data[:at] + data[at + 1 :])
        else:  # a byte inserted
            b = bytearray(data[:at] + bytes([rng.randrange(256)]) + data[at:])
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_mutations_agree_or_fall_back(moe: Path, tmp_path: Path, seed: int) -> None:
    root = Path(shutil.copytree(moe, tmp_path / "ckpt"))
    md = root / ".metadata"
    data = md.read_bytes()
    rng = random.Random(seed)
    answered = 0
    for mutated in _mutations(data, rng, 150):
        md.write_bytes(mutated)
        answered += columns_agree(md)
    assert answered  # some mutations (an int of a chunk, a file name) are still read


def test_chunk_int_mutations_agree(moe: Path, tmp_path: Path) -> None:
    """Values inside the chunk and storage runs changed (offsets, sizes, byte ranges, the
    index hint): the columns see exactly what the allow-list sees, or fall back."""
    root = Path(shutil.copytree(moe, tmp_path / "ckpt"))
    md = root / ".metadata"
    data = md.read_bytes()
    rng = random.Random(7)
    spots = [i for i in range(len(data) - 1) if data[i] == 0x4B]  # BININT1 arguments
    answered = 0
    for at in rng.sample(spots, 200):
        b = bytearray(data)
        b[at + 1] = rng.choice([0, 1, 32, 64, 255, b[at + 1] ^ 1])
        md.write_bytes(bytes(b))
        answered += columns_agree(md)
    assert answered


def test_refused_global_falls_back_with_the_same_message(moe: Path, tmp_path: Path) -> None:
    root = Path(shutil.copytree(moe, tmp_path / "ckpt"))
    md = root / ".metadata"
    data = md.read_bytes()
    name = b"ChunkStorageMetadata"
    md.write_bytes(data.replace(b"\x8c\x14" + name, b"\x8c\x14" + b"os\x00system".ljust(20, b"_"),
                                1))
    assert dcp_metadata.read(md, allowed_global) is None
    with pytest.raises(InputError, match="which is no Python name .* the file is damaged"):
        dcp.read_info(root)


def _write_rows(out: Path, sd: dict[str, Any], *, ranks: int, files: int) -> Path:
    """``sd`` saved by torch's DCP writer in the row chunks of ``ranks`` ranks over ``files``
    files (benchmarks/moe_checkpoint.py's planner)."""
    import warnings

    import torch.distributed.checkpoint as tdcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"model": sd}, storage_writer=tdcp.FileSystemWriter(out, thread_count=files),
                  planner=moe_checkpoint.AllRanksPlanner(ranks), no_dist=True)
    return out


@pytest.fixture(scope="module")
def widths(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ints whose pickled widths change inside runs: row offsets 0 (K), 1094.. (M) and
    65640.. (J) in one chunk list; byte offsets K -> M -> J in every file; record lengths that
    alternate M and J from entry to entry (small and 80 kB chunks in turn); 1-D and 2-D
    tensors; a tensor of fewer rows than ranks (empty ranks) and a one-chunk one."""
    import torch

    g = torch.Generator().manual_seed(1)
    sd: dict[str, Any] = {"tall": torch.randn(70000, 1, generator=g).to(torch.bfloat16)}
    for i in range(24):
        sd[f"small.{i}"] = torch.randn(64, 4, generator=g)
        sd[f"wide.{i}"] = torch.randn(64, 20000, generator=g).to(torch.bfloat16)
    sd["norm"] = torch.randn(16, generator=g)
    sd["scalar"] = torch.randn(1, generator=g)
    return _write_rows(tmp_path_factory.mktemp("widths") / "ckpt", sd, ranks=64, files=3)


def test_widths_that_change_inside_runs(widths: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md = widths / ".metadata"
    laid_out, one_by_one = [], []
    gather, matches = opcodes._Layout.gather, machine._matches

    def spy_gather(self: Any, buf: bytes, start: int, n: int, fields: Any) -> Any:
        laid_out.append(n)
        return gather(self, buf, start, n, fields)

    def spy_matches(pattern: Any, buf: bytes, pos: int) -> Any:
        got = matches(pattern, buf, pos)
        one_by_one.append(len(got))
        return got

    monkeypatch.setattr(opcodes._Layout, "gather", spy_gather)
    monkeypatch.setattr(machine, "_matches", spy_matches)
    assert columns_agree(md)
    # Both ways were taken: runs of one layout, and runs whose widths keep changing.
    assert sum(laid_out) > 1000 and sum(one_by_one) > 100
    info = dcp.read_info(widths)
    tall = info.tensor("model.tall")
    assert [c.offsets[0] for c in tall.chunks][:3] == [0, 1094, 2188]
    assert tall.chunks[-1].offsets[0] > 65536


@pytest.mark.slow
def test_width_mutations_agree_or_fall_back(widths: Path, tmp_path: Path) -> None:
    """Value bytes of wide ints changed (a sign bit set, a byte offset moved, a row offset
    changed): the columns see exactly what the allow-list sees, or fall back."""
    root = Path(shutil.copytree(widths, tmp_path / "ckpt"))
    md = root / ".metadata"
    data = md.read_bytes()
    rng = random.Random(11)
    spots = [i for i in range(len(data) - 5) if data[i] in (0x4A, 0x4D)]
    answered = 0
    for at in rng.sample(spots, 150):
        b = bytearray(data)
        width = 4 if data[at] == 0x4A else 2
        b[at + rng.randrange(1, width + 1)] = rng.choice([0, 1, 0x7F, 0x80, 0xFF])
        md.write_bytes(bytes(b))
        answered += columns_agree(md)
    assert answered


def test_columns_are_the_chunks(widths: Path, moe: Path) -> None:
    for root in (widths, moe):
        for t in dcp.read_info(root).tensors:
            assert isinstance(t.chunks, ChunkColumns)
            chunks = list(t.chunks)
            assert t.chunks.boxes() == tuple((c.offsets, c.sizes) for c in chunks)
            nd = len(t.shape)
            for d in range(nd):
                assert list(t.chunks.column(d)) == [c.offsets[d] for c in chunks]
                assert list(t.chunks.column(nd + d)) == [c.sizes[d] for c in chunks]
            with pytest.raises(IndexError):
                t.chunks.column(2 * nd)


def test_small_blocks_read_the_same(widths: Path, moe: Path, monkeypatch: pytest.MonkeyPatch
                                    ) -> None:
    """The numpy passes that place and check the rows, cut into many blocks (entries and
    rows of one run or tensor on both sides of a cut) give what one pass gives."""
    for block in (1, 5, 64):
        monkeypatch.setattr(opcodes, "BLOCK", block)
        assert columns_agree(widths / ".metadata") and columns_agree(moe / ".metadata")


def _wider(data: bytes, spots: list[int]) -> bytes:
    """The ints pickled at ``spots`` (BININT1, BININT2 or BININT) pickled one width wider
    (BININT2, BININT, LONG1 of 4 bytes): the same values, entries of a run laid out otherwise;
    the FRAME around each one lengthened to match."""
    import bisect
    import pickletools

    frames = [pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME"]
    out = bytearray(data)
    for at in sorted(spots, reverse=True):  # from the end: earlier places stay put
        op = data[at]
        if op == 0x4B:
            new, old = b"M" + data[at + 1 : at + 2] + b"\x00", 2
        elif op == 0x4D:
            new, old = b"J" + data[at + 1 : at + 3] + b"\x00\x00", 3
        else:
            assert op == 0x4A
            new, old = b"\x8a\x04" + data[at + 1 : at + 5], 5
        out[at : at + old] = new
        f = frames[bisect.bisect_left(frames, at) - 1] + 1  # its FRAME's length field
        grown = int.from_bytes(out[f : f + 8], "little") + len(new) - old
        out[f : f + 8] = grown.to_bytes(8, "little")
    return bytes(out)


def _int_spots(data: bytes, lo: int, hi: int) -> list[int]:
    """Where ints are pickled between ``lo`` and ``hi``, by the pickle's own opcodes."""
    import pickletools

    return [pos for op, _, pos in pickletools.genops(data)
            if lo <= pos < hi and op.name in ("BININT1", "BININT2", "BININT")]


@pytest.mark.parametrize("section", ["chunks", "storage"])
@pytest.mark.slow
def test_one_entry_of_other_widths_inside_a_run(moe: Path, widths: Path, tmp_path: Path,
                                               section: str) -> None:
    """One int in the middle of a run pickled wider than its neighbours' (the same value, as a
    writer may): the run is read around it, and the answer is the allow-list path's."""
    answered = 0
    for k, src in enumerate((moe, widths)):
        root = Path(shutil.copytree(src, tmp_path / str(k)))
        md = root / ".metadata"
        data = md.read_bytes()
        cut = data.index(b"storage_data")
        lo, hi = (0, cut) if section == "chunks" else (cut, len(data))
        spots = _int_spots(data, lo, hi)
        rng = random.Random(5)
        for at in rng.sample(spots[len(spots) // 4 : -len(spots) // 4], 12):
            md.write_bytes(_wider(data, [at]))
            answered += columns_agree(md)
    assert answered >= 12


def test_every_int_of_a_section_wider(moe: Path, tmp_path: Path) -> None:
    """Every BININT of a section pickled as LONG1, every BININT2 as BININT: runs of one layout
    with ints of those widths (LONG1 signed, gathered as such)."""
    root = Path(shutil.copytree(moe, tmp_path / "ckpt"))
    md = root / ".metadata"
    data = md.read_bytes()
    cut = data.index(b"storage_data")
    for lo, hi in ((0, cut), (cut, len(data))):
        wide = [at for at in _int_spots(data, lo, hi) if data[at] != 0x4B]
        md.write_bytes(_wider(data, wide))
        assert columns_agree(md)


def test_tensor_heads_are_read_at_once(moe: Path, widths: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor entry after the first of its dtype opens by :data:`_TENSOR_HEAD` (one
    match, not its opcodes one by one), and the answer is the allow-list path's."""
    took = []
    head = machine._Machine.tensor_head

    def spy(self: Any, stack: list[Any], marks: list[int]) -> bool:
        took.append(head(self, stack, marks))
        return took[-1]

    monkeypatch.setattr(machine._Machine, "tensor_head", spy)
    for root in (moe, widths):
        took.clear()
        assert columns_agree(root / ".metadata")
        num = len(dcp.read_info(root).tensors)
        assert took.count(True) >= num - 3 and took.count(True) > 10


def _head_spots(data: bytes) -> list[tuple[int, int]]:
    """Where tensor heads are (start, end), by the pattern's own bytes."""
    return [m.span() for m in opcodes._TENSOR_HEAD.finditer(data)]


@pytest.mark.parametrize("seed", range(2))
def test_tensor_head_mutations_agree_or_fall_back(moe: Path, tmp_path: Path, seed: int) -> None:
    """Bytes inside tensor heads changed (a GET of another memo entry, requires_grad or
    pin_memory set, a size int, an opcode in place of a byte, a byte dropped or inserted):
    the columns give the allow-list path's answer, or fall back."""
    root = Path(shutil.copytree(moe, tmp_path / "ckpt"))
    md = root / ".metadata"
    data = md.read_bytes()
    spots = _head_spots(data)
    assert len(spots) > 10
    rng = random.Random(seed)
    interesting = b"\x94hjKMJ\x8a\x8c)(}]uebR\x81\x85\x86\x87t\x88\x89qr"
    answered = 0
    for _ in range(150):
        a, b = spots[rng.randrange(1, len(spots))]
        at = rng.randrange(a, b)
        kind = rng.randrange(4)
        out = bytearray(data)
        if kind == 0:
            out[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            out[at] = interesting[rng.randrange(len(interesting))]
        elif kind == 2:
            del out[at]
        else:
            out.insert(at, rng.randrange(256))
        md.write_bytes(bytes(out))
        answered += columns_agree(md)
    assert answered


def test_tensor_head_flags_and_gets(moe: Path, tmp_path: Path) -> None:
    """requires_grad and pin_memory set (NEWTRUE) in one head, a head's GET of the dtype
    pointing at another memo entry: read as the allow-list path reads them."""
    root = Path(shutil.copytree(moe, tmp_path / "ckpt"))
    md = root / ".metadata"
    data = md.read_bytes()
    a, b = _head_spots(data)[3]
    m = opcodes._TENSOR_HEAD.match(data, a)
    assert m is not None
    flags = bytearray(data)
    flags[m.start(6)] = flags[m.start(8)] = 0x88
    md.write_bytes(bytes(flags))
    assert columns_agree(md)
    props = dcp_metadata.read(md, allowed_global)
    assert props is not None
    for lit in (4, 5, 7):  # dtype, layout, memory format: another entry (the name's memo)
        other = bytearray(data)
        other[m.start(lit) : m.end(lit)] = data[m.start(1) : m.end(1)]
        md.write_bytes(bytes(other))
        columns_agree(md)


def test_storage_gets_of_entries_not_memoized_yet(moe: Path, tmp_path: Path) -> None:
    """A storage entry's name or file GET of a memo entry made only later in the file (or
    never): the allow-list path refuses it, and the columns (which check a run's GETs once all
    is read, against the memo's size when the run was read) leave the file to it."""
    import pickletools

    root = Path(shutil.copytree(moe, tmp_path / "ckpt"))
    md = root / ".metadata"
    data = md.read_bytes()
    cut = data.index(b"storage_data")
    ops = list(pickletools.genops(data))
    last = sum(op.name == "MEMOIZE" for op, _, _ in ops) - 1  # exists by the end only
    gets = [pos for op, _, pos in ops if op.name == "LONG_BINGET" and pos > cut]
    rng = random.Random(3)
    for at in rng.sample(gets[len(gets) // 4 : -len(gets) // 4], 6):
        for index in (last, 1 << 30):
            b = bytearray(data)
            b[at + 1 : at + 5] = index.to_bytes(4, "little")
            md.write_bytes(bytes(b))
            assert not columns_agree(md)
            assert isinstance(allow_list_read(md), InputError)


def test_tensor_head_tuple_opcode_must_match_its_ints(moe: Path, tmp_path: Path) -> None:
    """A head's size tuple whose TUPLE1/2/3 opcode takes fewer or more ints than precede it
    (``K3 K32 TUPLE1``: real pickle builds ``(32,)`` and leaves 3 on the stack, which the
    REDUCE then calls): the allow-list path refuses the file, so the columns must not answer
    for it. Every head whose size has 2 ints, each way."""
    root = Path(shutil.copytree(moe, tmp_path / "ckpt"))
    md = root / ".metadata"
    data = md.read_bytes()
    heads = [m for m in opcodes._TENSOR_HEAD.finditer(data)
             if data[m.end(11) - 2] == 0x86]  # TUPLE2 MEMOIZE
    assert len(heads) > 5
    for m in heads[1:6]:
        for op in (0x85, 0x87):  # TUPLE1, TUPLE3 after two ints
            b = bytearray(data)
            b[m.end(11) - 2] = op
            md.write_bytes(bytes(b))
            assert isinstance(allow_list_read(md), InputError)
            assert not columns_agree(md)


@pytest.mark.parametrize("window", [3000, 3001, 3100, 3399, 4099])
def test_small_windows_read_the_same(moe: Path, window: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The file read through windows of a few KB, so that GETs (and heads, and runs) straddle
    a window's end at every kind of place: the same answer as the allow-list path, and not a
    fall back (a GET across the end was read, then matched from where the old window had it)."""
    monkeypatch.setattr(machine, "_WINDOW", window)
    monkeypatch.setattr(machine, "_AHEAD", 1024)
    assert columns_agree(moe / ".metadata")


def test_many_layouts_fall_back_without_compiling_each(moe: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each distinct layout of GETs costs a compiled pattern: past :data:`_MAX_LAYOUTS` the
    file is left to the allow-list unpickler (a hostile file could make every entry its own
    layout, at ~15 ms each)."""
    monkeypatch.setattr(machine, "_MAX_LAYOUTS", 1)
    md = moe / ".metadata"
    assert dcp_metadata.read(md, allowed_global) is None
    assert not isinstance(allow_list_read(md), Exception)
