"""DCP checkpoints written by PyTorch's HuggingFaceStorageWriter (per-rank safetensors shards),
including integer and bool tensors, written by the real writer on 2 gloo ranks."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.core.reshard import reshard
from ckpttool.formats import hf_dcp
from ckpttool.formats.base import RAW
from tests.core.test_merge import assert_bit_exact, load_out

WORLD = 2


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(5, 3, generator=g),
        "cols": torch.randn(2, 6, generator=g),  # Shard(1)
        "b": torch.randn(3, generator=g).to(torch.bfloat16),  # Replicate
        "ids": torch.arange(7, dtype=torch.int64),  # uneven over 2 ranks
        "mask": torch.tensor([True, False, True, True]),
        "small": torch.randint(0, 255, (1, 4), generator=g).to(torch.uint8),  # rank 1 empty
    }


def _worker(rank: int, out: str, port: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        full = full_state()
        placements = {"cols": Shard(1), "b": Replicate()}
        sd = {k: distribute_tensor(v, mesh, [placements.get(k, Shard(0))])
              for k, v in full.items()}
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def hf_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf_storage") / "ckpt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(str(out), port), nprocs=WORLD, start_method="spawn")
    return out


def test_recognised_by_content(hf_ckpt: Path) -> None:
    assert hf_dcp.is_hf_dcp_dir(hf_ckpt)
    info = hf_dcp.read_info(hf_ckpt)
    shapes = {t.name: t.shape for t in info.tensors}
    assert shapes == {k: tuple(v.shape) for k, v in full_state().items()}
    assert all(c.encoding == RAW for t in info.tensors for c in t.chunks)


def test_merge_is_bit_exact_with_int_and_bool(hf_ckpt: Path, tmp_path: Path) -> None:
    report = ckpttool.merge(hf_ckpt, tmp_path / "out", dtype="keep")
    assert report.num_tensors == len(full_state())
    assert_bit_exact(load_out(tmp_path / "out"), full_state())


def test_merge_cast_spares_integers(hf_ckpt: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["merge", str(hf_ckpt), str(tmp_path / "out"), "--dtype",
                                 "bf16", "-q"])
    assert r.exit_code == 0, r.output
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in full_state().items()}
    assert_bit_exact(load_out(tmp_path / "out"), want, cast=True)


def test_reshard_to_dcp_then_merge_round_trips(hf_ckpt: Path, tmp_path: Path) -> None:
    reshard(hf_ckpt, tmp_path / "dcp", ranks=3)
    ckpttool.merge(tmp_path / "dcp", tmp_path / "out", dtype="keep")
    assert_bit_exact(load_out(tmp_path / "out"), full_state())
