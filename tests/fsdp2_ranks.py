"""Run a function on M gloo ranks (CPU processes) and collect what each rank returns.

    from tests.fsdp2_ranks import run_on_ranks
    results = run_on_ranks(load_and_gather, 3, str(dcp_dir))  # [rank 0's, rank 1's, rank 2's]

``fn(rank, world_size, *args)`` runs on every rank inside an initialised gloo process group
(``torch.set_num_threads(1)``, like the checkpoint writers, so that reductions run in the
same order on every rank and in every run). It must be a top-level function of an importable
module: the ranks are forked by the same torch-preloaded forkserver that writes the
fixtures (:func:`examples.fsdp2_checkpoint.start_rank_server`), so they start in a fraction
of a second. What it returns goes back through ``torch.save`` (tensors, dicts, lists,
numbers); ``None`` is fine.

An exception on any rank fails the whole call (``torch.multiprocessing`` re-raises it with
that rank's traceback), so a hung collective cannot outlive a failing peer by long.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from examples.fsdp2_checkpoint import KINDS, start_rank_server

__all__ = ["rank_server", "run_on_ranks"]

# What the tests' own ranks import besides the kinds' modules, imported once in the server
# that forks every rank of a test process: torchtitan's models cost about 2.3 s a rank, and
# its writers run 14 ranks. (megatron-core, 3 s, is left to its 2 ranks: only one job of a
# session imports it.)
ALSO_PRELOAD = ("torchtitan.models.llama3", "torchtitan.models.qwen3",
                "torchtitan.models.deepseek_v3", "torchtitan.models.gpt_oss",
                "torchtitan.components.checkpoint")


def rank_server() -> str:
    """The start method of the tests' ranks: one forkserver per test process, started with
    every kind's modules and :data:`ALSO_PRELOAD` (whoever starts it first decides what it
    imports, so every writer of tests/ starts it here)."""
    return start_rank_server(KINDS, also=ALSO_PRELOAD)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any],
               args: tuple[Any, ...], results: str) -> None:
    # What torchrun sets, so that libraries that read it (accelerate's PartialState) agree.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        value = fn(rank, world_size, *args)
        torch.save(value, Path(results) / f"{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their results by rank."""
    method = rank_server()
    with tempfile.TemporaryDirectory(prefix="ranks-") as results:
        mp.start_processes(
            _rank_main,
            args=(world_size, _free_port(), fn, args, results),
            nprocs=world_size,
            join=True,
            start_method=method,
        )
        return [torch.load(Path(results) / f"{r}.pt", weights_only=False)
                for r in range(world_size)]
