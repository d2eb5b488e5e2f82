"""Writes the checkpoints of ``tests/data/pythons/pyXY-torchA.B/`` with the Python and the
torch that run it: what each Python the package declares (3.10 to 3.13) and each torch
release (2.6, the floor ``pyproject.toml`` declares, to the newest) pickles differently
(3.13: every path as ``pathlib._local.PosixPath``, DCP's ``StorageMeta.checkpoint_id``
among them). Run once per Python and torch, from the repository root, in a venv with that
torch::

    /root/.pyenv/versions/3.11.7/bin/python -m venv /work/venvs/torches-214
    /work/venvs/torches-214/bin/pip install torch==2.14.1 numpy
    /work/venvs/torches-214/bin/python tests/data/pythons/generate.py

(a CUDA build of torch is fine: everything runs on the CPU, with gloo). The directories
written by torch 2.13.0 (``py310``, ``py312``, ``py313``) predate the torch in the name;
they are kept as they were written, not regenerated.

It writes, on 2 gloo ranks, a ``fully_shard``-ed model of two ``Linear`` layers, into
``pyXY-torchA.B/`` (XY: this Python's version; A.B: this torch's):

* ``dcp/``: ``torch.distributed.checkpoint.save`` of its state dict (FSDP2 DTensors);
* ``plain.pt``: ``torch.save`` of the full state dict beside inert non-tensor values a
  training state holds (a path, a signal, an ``argparse.Namespace``, an enum);
* ``reference.pt``: the full state dict alone (the bytes every merge must reproduce);
* ``versions.json``: the Python and torch that wrote them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

TORCH = ".".join(torch.__version__.split("+")[0].split(".")[:2])  # "2.14" of "2.14.1+cu130"
OUT = Path(__file__).resolve().parent / f"py{sys.version_info[0]}{sys.version_info[1]}-torch{TORCH}"


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 5)
        self.down = nn.Linear(5, 3)


def _main(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 private
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

    torch.manual_seed(1234)
    model = Small()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    dcp.save(state, checkpoint_id=str(OUT / "dcp"))
    full = {k: v.full_tensor().detach().clone() for k, v in state.items()}
    if rank == 0:
        torch.save(full, OUT / "reference.pt")
        torch.save({**full, "run_dir": pathlib.Path("runs/small"), "exit_signal": signal.SIGTERM,
                    "args": argparse.Namespace(lr=0.5, exit_signal=signal.SIGTERM)},
                   OUT / "plain.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_main, args=(2, port), nprocs=2, join=True)
    (OUT / "versions.json").write_text(json.dumps(
        {"python": sys.version.split()[0], "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
