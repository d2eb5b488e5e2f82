"""core.partition: a merge's work split between processes by bytes.

The split is pure, so most of this runs in one process: every share is executed into the same
output files (``merge.execute_share``), which must then equal a one-process merge byte for
byte, and the balance is computed from plans, including the 3 GB benchmark's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import ckpttool
from ckpttool.core import dtype_policy
from ckpttool.core.checkpoint.discover import discover, open_reader
from ckpttool.core.merge import multihost, partition
from ckpttool.core.merge.engine import execute, execute_share
from ckpttool.core.merge.plan import MergePlan, plan_merge
from ckpttool.errors import InputError, OutputError
from ckpttool.formats.base import RAW, Chunk, Tensor
from ckpttool.formats.codecs import dtypes
from ckpttool.storage.outputs import AtomicOutputs, pwrite_all
from tests.helpers import assert_bit_exact, load_out


def _plan(src: Path, dtype: str = "keep", shard: int = 1 << 62) -> MergePlan:
    ckpt = discover(src, command="merge")
    policy = dtype_policy.resolve(dtype, None)
    return plan_merge([(t.name, t.tensor) for t in ckpt.tensors], policy=policy,
                      max_shard_size=shard)


def _covered(plan: MergePlan, shares: list[list[partition.Unit]]) -> dict[tuple, list]:
    """Element ranges each (file, tensor, chunk) is written in, over all shares."""
    seen: dict[tuple, list] = {}
    for share in shares:
        for u in share:
            seen.setdefault((u.file, u.tensor, u.chunk), []).append(u.elements)
    return seen


def _assert_tiles(plan: MergePlan, shares: list[list[partition.Unit]]) -> None:
    """Every unit of the plan is written exactly once: whole, or in parts that tile it."""
    whole = {(u.file, u.tensor, u.chunk): u for u in partition.units(plan)}
    seen = _covered(plan, shares)
    assert seen.keys() == whole.keys()
    for key, parts in seen.items():
        u = whole[key]
        if parts == [None]:
            continue
        assert None not in parts, key
        itemsize = plan.files[u.file].tensors[u.tensor].dtype.itemsize
        ranges = sorted(p for p in parts if p is not None)
        assert ranges[0][0] == 0 and ranges[-1][1] * itemsize == u.nbytes, key
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), key
    assert sum(partition.rank_bytes(shares)) == plan.total_bytes


def _merge_by_shares(plan: MergePlan, src: Path, out: Path, shares: list[list[partition.Unit]]
                     ) -> None:
    """Each share written by its own reader into the same files, one after another."""
    out.mkdir()
    fds = {}
    for i, f in enumerate(plan.files):
        fds[i] = os.open(out / f.name, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fds[i], f.size)
        pwrite_all(fds[i], f.layout.header, 0)
    try:
        for share in shares:
            with open_reader(discover(src, command="merge")) as reader:
                execute_share(plan, share, reader, fds, workers=2)
    finally:
        for fd in fds.values():
            os.close(fd)


def _merge_alone(plan: MergePlan, src: Path, out: Path) -> None:
    with (open_reader(discover(src, command="merge")) as reader, AtomicOutputs(out) as outputs):
        out.mkdir(exist_ok=True)  # AtomicOutputs made it (to lock it) already
        execute(plan, reader, outputs)
        outputs.commit()


@pytest.mark.parametrize(("kind", "dtype", "ranks"), [
    ("uneven", "keep", 3),  # Shard(0) pieces of uneven size
    ("placements", "fp16", 4),  # Shard(1) (strided, kept whole), Replicate, a cast
    ("mixed", "bf16", 5),  # every dtype; float8 and integers never cast
])
def test_shares_written_one_by_one_equal_a_merge_alone(kind: str, dtype: str, ranks: int,
                                                       make_checkpoint, tmp_path: Path) -> None:
    src = make_checkpoint(kind) / "pytorch_model_fsdp_0"
    plan = _plan(src, dtype, shard=2000)
    # Cut at every 8 bytes, so that many chunks are cut inside (4096 on real sizes).
    shares = partition.split(plan, ranks, align=8)
    _assert_tiles(plan, shares)
    assert any(u.elements is not None for s in shares for u in s)
    _merge_by_shares(plan, src, tmp_path / "shared", shares)
    _merge_alone(plan, src, tmp_path / "alone")
    if dtype == "keep":
        for f in plan.files:
            assert (tmp_path / "shared" / f.name).read_bytes() == (
                tmp_path / "alone" / f.name).read_bytes(), f.name
    else:  # a cast NaN's bits depend on where torch's kernel meets it (see assert_bit_exact)
        assert_bit_exact(load_out(tmp_path / "shared"), load_out(tmp_path / "alone"), cast=True)


def test_balance_on_a_real_checkpoint(uneven_ckpt: Path) -> None:
    plan = _plan(uneven_ckpt / "pytorch_model_fsdp_0")
    for ranks in (1, 2, 3, 4):
        shares = partition.split(plan, ranks, align=8)
        _assert_tiles(plan, shares)
        sizes = partition.rank_bytes(shares)
        # Every chunk here can be cut: off by at most an 8-byte alignment step.
        assert max(sizes) - min(sizes) <= 8 * 2, sizes
        assert partition.balance(shares) == max(sizes) * ranks / plan.total_bytes
    assert partition.balance([[]] * 3) == 1.0


def _benchmark_plan(world: int = 4, vocab: int = 32000, layers: int = 12, h: int = 2624
                    ) -> MergePlan:
    """The plan of benchmarks/merge.py's 3 GB checkpoint (hidden 2624, 111 bf16 tensors,
    each in 4 Shard(0) chunks from 4 ranks), from its metadata alone (nothing is read)."""
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                   (p + "self_attn.k_proj.weight", (h, h)), (p + "self_attn.v_proj.weight", (h, h)),
                   (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "post_attention_layernorm.weight", (h,)),
                   (p + "mlp.gate_proj.weight", (4 * h, h)), (p + "mlp.up_proj.weight", (4 * h, h)),
                   (p + "mlp.down_proj.weight", (h, 4 * h))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    bf16 = dtypes.get("BF16")
    tensors = []
    for i, (name, shape) in enumerate(shapes):
        rows = shape[0] // world
        rest = math.prod(shape[1:])
        chunks = tuple(Chunk((r * rows, *(0 for _ in shape[1:])), (rows, *shape[1:]),
                             f"__{r}_0.distcp", i * 1000, rows * rest * 2, RAW)
                       for r in range(world))
        tensors.append((name, Tensor(name, ("model", name), bf16, shape, chunks)))
    return plan_merge(tensors, policy=dtype_policy.resolve("keep", None), max_shard_size=5 * 10**9)


def test_the_3gb_benchmark_splits_within_one_percent_even_as_one_file() -> None:
    plan = _benchmark_plan()
    assert len(plan.files) == 1 and len(plan.files[0].tensors) == 111
    assert plan.total_bytes > 2.9e9
    for ranks in (2, 4, 8, 64):
        shares = partition.split(plan, ranks)
        _assert_tiles(plan, shares)
        assert partition.balance(shares) <= 1.01, ranks
        # Cuts inside chunks land on page boundaries of the output file.
        for share in shares:
            for u in share:
                if u.elements is not None and u.elements[0]:
                    t = plan.files[u.file].tensors[u.tensor]
                    assert isinstance(t.source, Tensor) and u.chunk is not None
                    c = t.source.chunks[u.chunk]
                    at = t.slot.begin + (c.offsets[0] * math.prod(t.source.shape[1:])
                                         + u.elements[0]) * 2
                    assert at % partition.ALIGN == 0


@settings(max_examples=200, deadline=None)
@given(sizes=hs.lists(hs.tuples(hs.integers(1, 300), hs.integers(1, 4), hs.booleans()),
                      min_size=1, max_size=12),
       ranks=hs.integers(1, 9), align=hs.sampled_from([8, 64, 4096]))
def test_split_tiles_and_is_off_by_at_most_the_largest_whole_piece(
        sizes: list[tuple[int, int, bool]], ranks: int, align: int) -> None:
    """Tensors of ``rows`` x 3 fp32 in ``parts`` Shard(0) chunks, or Shard(1) (kept whole)."""
    f32 = dtypes.get("F32")
    tensors = []
    for i, (rows, parts, strided) in enumerate(sizes):
        shape = (rows, 3 * parts)
        if strided:  # column pieces: strided, never cut
            chunks = tuple(Chunk((0, 3 * k), (rows, 3), "f", 0, rows * 12, RAW)
                           for k in range(parts))
        else:
            cuts = [rows * k // parts for k in range(parts + 1)]
            chunks = tuple(Chunk((a, 0), (b - a, 3 * parts), "f", 0, (b - a) * 12 * parts, RAW)
                           for a, b in zip(cuts, cuts[1:], strict=False))
        tensors.append((f"t{i}", Tensor(f"t{i}", (f"t{i}",), f32, shape, chunks)))
    plan = plan_merge(tensors, policy=dtype_policy.resolve("keep", None), max_shard_size=4000)
    shares = partition.split(plan, ranks, align=align)
    _assert_tiles(plan, shares)
    whole = max((u.nbytes for s in shares for u in s if u.elements is None
                 and isinstance(plan.files[u.file].tensors[u.tensor].source, Tensor)
                 and u.chunk is not None and _strided(plan, u)), default=0)
    mean = plan.total_bytes / ranks
    # Half a whole piece (or an alignment step) at each end of a share, at most.
    assert max(partition.rank_bytes(shares)) <= mean + whole + align + 1


def _strided(plan: MergePlan, u: partition.Unit) -> bool:
    t = plan.files[u.file].tensors[u.tensor].source
    assert isinstance(t, Tensor) and u.chunk is not None
    c = t.chunks[u.chunk]
    return c.sizes[1] != t.shape[1]


def test_slices_then_finish_equal_a_merge_alone(llama_ckpt: Path, tmp_path: Path) -> None:
    """--slice I/N then --finish, run one after another through the library: the output is
    the one-process merge's, file for file; --finish before every slice is done refuses."""
    alone = tmp_path / "alone"
    ckpttool.merge(llama_ckpt, alone, max_shard_size="10KB")
    out = tmp_path / "sliced"
    ckpttool.merge(llama_ckpt, out, max_shard_size="10KB", shared=multihost.Slice(2, 3))
    ckpttool.merge(llama_ckpt, out, max_shard_size="10KB", shared=multihost.Slice(0, 3))
    with pytest.raises(OutputError, match=r"1 of 3 slices are not done \(1/3\); run them with "
                       r"ckpttool merge SRC OUT --slice 1/3, then --finish again"):
        ckpttool.merge(llama_ckpt, out, max_shard_size="10KB", shared=multihost.Finish())
    with pytest.raises(OutputError, match="no finished slice of this merge"):
        # Other options, another plan: its slices are not these.
        ckpttool.merge(llama_ckpt, out, max_shard_size="20KB", shared=multihost.Finish())
    assert not any(p.name.endswith(".safetensors") for p in out.iterdir())
    ckpttool.merge(llama_ckpt, out, max_shard_size="10KB", shared=multihost.Slice(1, 3))
    report = ckpttool.merge(llama_ckpt, out, max_shard_size="10KB", shared=multihost.Finish())
    assert report.distributed is not None and report.distributed.processes == 3
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in alone.iterdir())
    for p in alone.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


def test_parse_slice() -> None:
    assert multihost.parse_slice("3/8") == (3, 8)
    for bad in ("8/8", "1/0", "a/b", "-1/2", "1"):
        with pytest.raises(InputError, match="expected I/N with 0 <= I < N"):
            multihost.parse_slice(bad)


# --------------------------------------------------------------------------------------------
# Windows: the parts of a shared upload into object storage


@pytest.mark.parametrize(("kind", "dtype", "part"), [
    ("uneven", "keep", 72),  # Shard(0) pieces cut at windows that fall inside elements
    ("placements", "keep", 100),  # Shard(1) (strided: in every window its tensor meets)
    ("mixed", "bf16", 40),  # every dtype, a cast
])
def test_windows_written_one_by_one_equal_a_merge_alone(kind: str, dtype: str, part: int,
                                                        make_checkpoint, tmp_path: Path) -> None:
    """Each window written alone into an empty (sparse) buffer at its offsets, as a process
    uploading parts does, and only its own bytes kept: the files equal a merge alone."""
    src = make_checkpoint(kind) / "pytorch_model_fsdp_0"
    plan = _plan(src, dtype, shard=2000)
    sizes = dict.fromkeys(range(len(plan.files)), part)
    windows = partition.windows(plan, sizes)
    assert any(u.elements is not None for w in windows for u in w.units)
    for i, f in enumerate(plan.files):
        mine = [w for w in windows if w.file == i]
        assert [w.number for w in mine] == list(range(1, len(mine) + 1))
        assert mine[0].begin == 0 and mine[-1].end == f.size
        assert all(a.end == b.begin for a, b in zip(mine, mine[1:], strict=False))
    owners = partition.owners(windows, 3)
    assert owners == sorted(owners) and set(owners) == {0, 1, 2}
    out = tmp_path / "windows"
    out.mkdir()
    buffer = tmp_path / "buffer"
    with open_reader(discover(src, command="merge")) as reader:
        for w in windows:
            f = plan.files[w.file]
            fd = os.open(buffer, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                pwrite_all(fd, f.layout.header, 0)
                execute_share(plan, list(w.units), reader, {w.file: fd}, workers=2)
                data = os.pread(fd, w.nbytes, w.begin)
            finally:
                os.close(fd)
            with open(out / f.name, "ab") as target:
                assert target.tell() == w.begin
                target.write(data)
    _merge_alone(plan, src, tmp_path / "alone")
    if dtype == "keep":
        for f in plan.files:
            assert (out / f.name).read_bytes() == (tmp_path / "alone" / f.name).read_bytes()
    else:
        assert_bit_exact(load_out(out), load_out(tmp_path / "alone"), cast=True)


def test_part_sizes_keep_to_each_stores_limits() -> None:
    """A 4 KiB-aligned grid, at least the store's minimum part, grown to fit its part count;
    beyond the largest part the store allows: one line naming the limit."""
    from ckpttool.errors import UnsupportedError
    from ckpttool.storage import objects, objparts, s3

    limits = s3.Parts.limits
    assert objects.part_size(1 << 20, limits, 1) == 5 << 20  # S3's 5 MiB minimum
    assert objects.part_size(1 << 20, limits) == 16 << 20
    size = 400 << 30  # 400 GiB: 16 MiB parts would be 25,600 of them
    part = objects.part_size(size, limits)
    assert part % 4096 == 0 and -(-size // part) <= 10_000 and part >= size // 10_000
    azure = objparts.AzureParts.limits
    assert -(-size // objects.part_size(size, azure)) <= 50_000
    assert objects.part_size(size, azure, 4096) == -(-(size // 50_000) // 4096) * 4096
    with pytest.raises(UnsupportedError) as e:
        objects.part_size(10_000 * (5 << 30) + 1, limits)
    assert "10,000 parts" in str(e.value) and "\n" not in str(e.value)
