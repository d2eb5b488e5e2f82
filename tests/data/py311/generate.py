"""Writes the checkpoints in this folder with a Python that pickles Enum members by name.

Python 3.11.0 to 3.11.x (here Debian 12's system ``python3``, 3.11.2) pickles an Enum member
as ``getattr(Class, 'NAME')``; other versions as ``Class(value)``. DCP's ``.metadata`` holds
one (``TensorProperties.memory_format``), and so does an FSDP1 ``SHARDED_STATE_DICT`` rank
file. Run once, from this folder's parent's parent's parent (the repository root)::

    /usr/bin/python3.11 -m venv /work/venvs/py311deb
    /work/venvs/py311deb/bin/pip install torch==2.13.0+cpu numpy
    /work/venvs/py311deb/bin/python tests/data/py311/generate.py

It writes, on 2 gloo ranks, a ``fully_shard``-ed model of two ``Linear`` layers:

* ``dcp/``: ``torch.distributed.checkpoint.save`` of its state dict (FSDP2 DTensors);
* ``fsdp1_sharded/``: FSDP1 ``SHARDED_STATE_DICT`` rank files
  (``model_world_size_2_rank_R.pt``, ShardedTensors, the verl FSDP1 naming);
* ``reference.pt``: the full state dict, gathered (the bytes every merge must reproduce);
* ``versions.json``: the Python and torch that wrote them.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent


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
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType, fully_shard

    torch.manual_seed(1234)
    model = Small()
    fsdp1 = FSDP(Small(), device_id=torch.device("cpu"))
    fsdp1.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    dcp.save(state, checkpoint_id=str(HERE / "dcp"))
    full = {k: v.full_tensor().detach().clone() for k, v in state.items()}
    with FSDP.state_dict_type(fsdp1, StateDictType.SHARDED_STATE_DICT):
        sharded = fsdp1.state_dict()
    (HERE / "fsdp1_sharded").mkdir(exist_ok=True)
    torch.save(sharded, HERE / "fsdp1_sharded" / f"model_world_size_{world_size}_rank_{rank}.pt")
    if rank == 0:
        torch.save(full, HERE / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    if b"getattr" not in pickle.dumps(member, protocol=4):
        sys.exit(f"Python {sys.version.split()[0]} pickles Enum members by value; run this "
                 "with a Python 3.11 that pickles them by name (Debian 12's python3)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_main, args=(2, port), nprocs=2, join=True)
    (HERE / "versions.json").write_text(json.dumps(
        {"python": sys.version.split()[0], "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
