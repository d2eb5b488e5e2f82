"""Training runs for ``merge --all``: a real FSDP2 training loop on 2 gloo ranks that saves a
checkpoint with ``torch.distributed.checkpoint`` after every step, as accelerate's
``save_state`` lays it out (``checkpoint-<step>/pytorch_model_fsdp_0`` for the model,
``checkpoint-<step>/optimizer_0`` for the optimizer state).

``write_run(out, steps=3, cut=True)`` writes ``out/run/checkpoint-1 .. checkpoint-<steps>``;
with ``cut``, one more, ``checkpoint-<steps + 1>``, whose writer stops after the data files,
before its last step (``.metadata``), as a writer killed there leaves it. The full state dict
the ranks gathered at each step, the reference a merge must equal bit for bit, is
``out/reference/<step>.pt`` (``{canonical name: tensor}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.fixture_cache import on_disk
from tests.layouts import _full, _run

MODEL_DIR = "pytorch_model_fsdp_0"
OPTIMIZER_DIR = "optimizer_0"
SEED = 4321


class RunModel(nn.Module):
    """A few tens of kilobytes: enough for a merge to have many pieces when they are small."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(96, 32)
        self.up = nn.Linear(32, 72)
        self.down = nn.Linear(72, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(x))))


class _CutWriter(dcp.FileSystemWriter):
    """Writes every data file, then stops before ``finish`` (which writes ``.metadata``)."""

    def finish(self, metadata: Any, results: Any) -> None:
        return None


def _loop(rank: int, world_size: int, out: Path, steps: int, cut: bool) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(SEED)
    model = RunModel()
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(SEED + 1)
    for step in range(1, steps + 1 + int(cut)):
        x = torch.randint(0, 96, (4, 6), generator=g)
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        ckpt = out / "run" / f"checkpoint-{step}"
        writer = _CutWriter(ckpt / MODEL_DIR) if step > steps else None
        dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt / MODEL_DIR,
                 storage_writer=writer)
        if step > steps:
            continue
        dcp.save({"optimizer": get_optimizer_state_dict(model, optim)},
                 checkpoint_id=ckpt / OPTIMIZER_DIR)
        full = _full(model.state_dict())
        if rank == 0:
            (out / "reference").mkdir(exist_ok=True)
            torch.save(full, out / "reference" / f"{step}.pt")


def _loop_3(rank: int, world_size: int, out: Path) -> None:
    _loop(rank, world_size, out, 3, True)


def _loop_2(rank: int, world_size: int, out: Path) -> None:
    _loop(rank, world_size, out, 2, False)


@on_disk()
def write_run(out: Path, *, steps: int = 3, cut: bool = True) -> Path:
    """The training run (see the module docstring); returns ``out/"run"``."""
    jobs = {(3, True): _loop_3, (2, False): _loop_2}
    _run(jobs[steps, cut], 2, out)
    return out / "run"


def reference(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The full state dict the ranks gathered after ``step``."""
    state: dict[str, torch.Tensor] = torch.load(out / "reference" / f"{step}.pt",
                                                weights_only=True)
    return state
