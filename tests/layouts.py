"""Real writers of per-rank ``torch.save`` checkpoints, for :mod:`ckpttool.formats.rank_files`.

Every file here is written by the real API on real gloo ranks (CPU processes forked by the
same torch-preloaded forkserver as the DCP fixtures, :func:`examples.fsdp2_checkpoint.
start_rank_server`, so a rank starts in a fraction of a second):

* :func:`write_fsdp2` ``(out, world_size, *, extras=False)``: the verl layout. Each rank
  ``fully_shard``\\ s :class:`Small` (``Linear(4, 5)``, ``Linear(5, 3)``: dim 0 uneven on any
  world but 1 and 5; on 11 ranks most pieces are empty) plus its int64 buffer, and saves
  ``torch.save(model.state_dict(), out/"actor"/f"model_world_size_{W}_rank_{R}.pt")``.
  Rank 0 saves the gathered full state dict (``DTensor.full_tensor()``) as
  ``out/"reference.pt"``, beside the checkpoint directory. With ``extras`` the same ranks
  also write

  - ``out/"placements"``: DTensors placed ``Replicate()``, ``Shard(1)`` and (bf16)
    ``Shard(0)`` plus a plain tensor, reference ``out/"placements_reference.pt"``;
  - ``out/"partial"``: a ``Partial()`` DTensor (not mergeable);
  - ``out/"fsdp1_local"`` and ``out/"fsdp1_accelerate"``: FSDP1 ``LOCAL_STATE_DICT`` files
    (flat parameters as ShardedTensor) named the verl way and the accelerate way
    (``pytorch_model_fsdp_rank<R>.bin``).

* :func:`write_mesh_2d` ``(out)``: 4 ranks on a 2 x 2 mesh: HSDP (``fully_shard`` on the 2-D
  mesh, placements ``(Replicate(), Shard(0))``), DTensors placed ``(Shard(0), Shard(1))`` and
  ``(Shard(0), Shard(0))``, and DTensors on each 1-D sub-mesh (``mesh["dp"]``,
  ``mesh["tp"]``, whose rank lists interleave). Checkpoint ``out/"actor"``, reference
  ``out/"reference.pt"``.
* :func:`write_single` ``(out)``: a world of one, plain ``torch.save(model.state_dict())``
  without FSDP, as ``out/"actor"/"model_world_size_1_rank_0.pt"``; the reference is the same
  state dict.
* :func:`write_unlisted_global` ``(out, marker)``: a rank file whose pickle names a function
  of this module (:func:`touch`) that would create ``marker`` if it ever ran.

And for :mod:`ckpttool.formats.hf_dcp`:

* :func:`write_hf_storage` ``(out)``: PyTorch's ``HuggingFaceStorageWriter``
  (``save_distributed=True``) on :data:`HF_WORLD` ranks, saving :func:`hf_full_state`
  (float, bf16, int64, bool and uint8 tensors) as DTensors placed ``Shard(0)`` (uneven over 2
  ranks; rank 1's piece of ``small`` is empty), ``Shard(1)`` (``cols``) and ``Replicate()``
  (``b``). The reference is :func:`hf_full_state` itself.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from examples.fsdp2_checkpoint import write_checkpoint
from tests.fixture_cache import on_disk
from tests.fsdp2_ranks import rank_server

CKPT_DIR = "actor"  # verl: global_step_<n>/actor/model_world_size_<W>_rank_<R>.pt
SEED = 1234


def rank_file(world_size: int, rank: int) -> str:
    return f"model_world_size_{world_size}_rank_{rank}.pt"


class Small(nn.Module):
    """Dim 0 of every parameter is 5 or 3: uneven on 2, 3, 4 ranks; empty pieces on 11."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 5)
        self.down = nn.Linear(5, 3)
        self.register_buffer("steps", torch.arange(7, dtype=torch.int64) * 3 - 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, job: Callable[..., None],
               out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # FSDP1 and ShardedTensor deprecation notices, per rank
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        job(rank, world_size, Path(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(job: Callable[..., None], world_size: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(world_size, _free_port(), job, str(out)),
                       nprocs=world_size, join=True, start_method=rank_server())


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full state dict, gathered: a collective, every rank calls it."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in state.items()}


def _save_with_reference(rank: int, world_size: int, state: dict[str, Any], ckpt: Path,
                         reference: Path) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.save(state, ckpt / rank_file(world_size, rank))
    full = _full(state)
    if rank == 0:
        torch.save(full, reference)


# --------------------------------------------------------------------------------------------
# FSDP2, 1-D mesh (verl)


def _fsdp2_job(rank: int, world_size: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(SEED)
    model = Small()
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _save_with_reference(rank, world_size, model.state_dict(), out / CKPT_DIR,
                         out / "reference.pt")


def _fsdp2_extras_job(rank: int, world_size: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    _fsdp2_job(rank, world_size, out)
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(SEED + 1)
    placed = {
        "replicated": distribute_tensor(torch.randn(3, 2, generator=g), mesh, [Replicate()]),
        "columns": distribute_tensor(torch.randn(3, 5, generator=g), mesh, [Shard(1)]),
        "rows_bf16": distribute_tensor(torch.randn(7, 2, generator=g).to(torch.bfloat16),
                                       mesh, [Shard(0)]),
        "plain": torch.arange(4, dtype=torch.int32),
    }
    _save_with_reference(rank, world_size, placed, out / "placements",
                         out / "placements_reference.pt")

    partial = DTensor.from_local(torch.randn(3, 2, generator=g), mesh, [Partial()])
    (out / "partial").mkdir(exist_ok=True)
    torch.save({"summed": partial}, out / "partial" / rank_file(world_size, rank))

    _fsdp1_local(rank, world_size, out)


def _fsdp1_local(rank: int, world_size: int, out: Path) -> None:
    """FSDP1 runs on CPU with gloo when told so: with ``device_id=None`` it refuses ("FSDP
    needs a non-CPU accelerator device"), with ``device_id=torch.device("cpu")`` it wraps."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    torch.manual_seed(SEED)
    model = FSDP(Small(), device_id=torch.device("cpu"), use_orig_params=False)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = model.state_dict()
    for name, file in (("fsdp1_local", rank_file(world_size, rank)),
                       ("fsdp1_accelerate", f"pytorch_model_fsdp_rank{rank}.bin")):
        (out / name).mkdir(exist_ok=True)
        torch.save(state, out / name / file)


@on_disk()
def write_kind(out: Path, kind: str, world_size: int | None = None) -> Path:
    """The training checkpoint ``out`` of :func:`examples.fsdp2_checkpoint.write_checkpoint`
    for ``kind`` (the session fixtures of tests/conftest.py, the fuzz seeds); returns ``out``.
    Its ranks come from one forkserver with what every kind needs preloaded."""
    rank_server()
    write_checkpoint(kind, out, world_size=world_size)
    return out


@on_disk()
def write_fsdp2(out: Path, world_size: int, *, extras: bool = False) -> Path:
    """The verl layout on ``world_size`` ranks (see the module docstring); returns ``out``."""
    _run(_fsdp2_extras_job if extras else _fsdp2_job, world_size, out)
    return out


# --------------------------------------------------------------------------------------------
# accelerate's save_fsdp_model / save_fsdp_optimizer with use_dcp=False


ACCELERATE_DIR = "checkpoint-500"  # save_fsdp_* write their rank files straight into it


def accelerate_file(rank: int, what: str = "pytorch_model_fsdp") -> str:
    """accelerate's per-rank names (``use_dcp=False``, first model / optimizer)."""
    return f"{what}_0_rank{rank}.bin"


def _accelerate_job(rank: int, world_size: int, out: Path, fsdp_version: int) -> None:
    """accelerate's own save functions on a hand-sharded :class:`Small`. On CPU accelerate
    runs MULTI_CPU, not its FSDP mode (that wants an accelerator device), so the model is
    sharded here and the plugin handed over directly, as tests/core/test_reshard.py does;
    of the Accelerator the savers use ``num_processes`` and ``process_index``."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp_version,
                                            state_dict_type="SHARDED_STATE_DICT")
    torch.manual_seed(SEED)
    model: nn.Module = Small()
    if fsdp_version == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model.up, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model.up = FSDP(model.up, device_id=torch.device("cpu"))  # nested: two flat params
        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(SEED + 3)
    x = torch.randn(6, 4, generator=g)
    model(x).square().sum().backward()
    optim.step()

    ckpt = out / ACCELERATE_DIR
    save_fsdp_model(plugin, accelerator, model, str(ckpt), use_dcp=False)
    save_fsdp_optimizer(plugin, accelerator, optim, model, str(ckpt), use_dcp=False)
    if rank == 0:  # beside them, as Accelerator.save_state leaves them: not model files
        torch.save({"last_epoch": 1, "_step_count": 2}, ckpt / "scheduler.bin")
        torch.save({"step": 1, "torch_manual_seed": torch.get_rng_state()},
                   ckpt / "random_states_0.pkl")
    # The reference: the full state dict, gathered by the writer itself.
    if fsdp_version == 2:
        full = _full(model.state_dict())
    else:
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # offload_to_cpu on a CPU model frees the very storage it gathers into: left off.
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, out / "reference.pt")


def _accelerate_fsdp2_job(rank: int, world_size: int, out: Path) -> None:
    _accelerate_job(rank, world_size, out, 2)


def _accelerate_fsdp1_job(rank: int, world_size: int, out: Path) -> None:
    _accelerate_job(rank, world_size, out, 1)


@on_disk()
def write_accelerate(out: Path, world_size: int, *, fsdp_version: int) -> Path:
    """accelerate's ``save_fsdp_model`` and ``save_fsdp_optimizer`` with ``use_dcp=False``
    and ``SHARDED_STATE_DICT`` (FSDP2: DTensors; FSDP1: ShardedTensors) after one AdamW step:
    ``out/"checkpoint-500"`` holds ``pytorch_model_fsdp_0_rank<R>.bin``,
    ``optimizer_0_rank<R>.bin``, ``scheduler.bin`` and ``random_states_0.pkl``; the full
    state dict the ranks gathered is ``out/"reference.pt"``. Returns ``out``."""
    _run(_accelerate_fsdp2_job if fsdp_version == 2 else _accelerate_fsdp1_job, world_size, out)
    return out


# --------------------------------------------------------------------------------------------
# 2 x 2 mesh


def _mesh_2d_job(rank: int, world_size: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # full_tensor() of (Shard(0), Shard(0)) logs a hint about flattening the mesh, per rank.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(SEED)
    model = Small()
    fully_shard(model, mesh=mesh)  # HSDP: replicate over "dp", shard over "tp"
    state = dict(model.state_dict())
    g = torch.Generator().manual_seed(SEED + 2)
    state["grid"] = distribute_tensor(torch.randn(5, 7, generator=g), mesh, [Shard(0), Shard(1)])
    state["twice"] = distribute_tensor(torch.randn(7, 3, generator=g), mesh,
                                       [Shard(0), Shard(0)])
    state["mixed"] = distribute_tensor(torch.randn(3, 6, generator=g), mesh,
                                       [Shard(1), Replicate()])
    state["on_dp"] = distribute_tensor(torch.randn(5, 2, generator=g), mesh["dp"], [Shard(0)])
    state["on_tp"] = distribute_tensor(torch.randn(3, 4, generator=g), mesh["tp"], [Shard(0)])
    _save_with_reference(rank, world_size, state, out / CKPT_DIR, out / "reference.pt")


@on_disk()
def write_mesh_2d(out: Path) -> Path:
    """4 ranks on a 2 x 2 mesh (see the module docstring); returns ``out``."""
    _run(_mesh_2d_job, 4, out)
    return out


# --------------------------------------------------------------------------------------------
# In this process


@on_disk()
def write_single(out: Path) -> Path:
    """A world of one: plain ``torch.save(model.state_dict())``, no FSDP; returns ``out``."""
    torch.manual_seed(SEED)
    state = Small().state_dict()
    (out / CKPT_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(state, out / CKPT_DIR / rank_file(1, 0))
    torch.save(state, out / "reference.pt")
    return out


def touch(path: str) -> None:
    """What a malicious pickle would run; the test checks it never does."""
    Path(path).touch()


class _Trap:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (touch, (str(self.marker),))


def write_unlisted_global(out: Path, marker: Path) -> Path:
    """A world-of-one rank file whose pickle names :func:`touch`; returns the directory."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"up.weight": torch.zeros(2, 2), "trap": _Trap(marker)}, out / rank_file(1, 0))
    return out


# --------------------------------------------------------------------------------------------
# HuggingFaceStorageWriter (DCP as per-rank safetensors shards)

HF_WORLD = 2


def hf_full_state() -> dict[str, torch.Tensor]:
    """What :func:`write_hf_storage` saves, as full tensors: the reference."""
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(5, 3, generator=g),
        "cols": torch.randn(2, 6, generator=g),  # Shard(1)
        "b": torch.randn(3, generator=g).to(torch.bfloat16),  # Replicate
        "ids": torch.arange(7, dtype=torch.int64),  # uneven over 2 ranks
        "mask": torch.tensor([True, False, True, True]),
        "small": torch.randint(0, 255, (1, 4), generator=g).to(torch.uint8),  # rank 1 empty
    }


def _hf_storage_job(rank: int, world_size: int, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    placements = {"cols": Shard(1), "b": Replicate()}
    sd = {k: distribute_tensor(v, mesh, [placements.get(k, Shard(0))])
          for k, v in hf_full_state().items()}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(out), save_distributed=True))


@on_disk()
def write_hf_storage(out: Path) -> Path:
    """HuggingFaceStorageWriter shards of :func:`hf_full_state` in ``out``; returns ``out``."""
    _run(_hf_storage_job, HF_WORLD, out)
    return out


# --------------------------------------------------------------------------------------------
# FileSystemWriter's options (torch.distributed.checkpoint.save)

OPTIONS_WORLD = 2
OPTION_DIRS = ("safetensors", "rank_local", "zstd")


def _options_state(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 :class:`Small` (uneven ``Shard(0)``, an int64 buffer stored whole) plus DTensors
    placed ``Replicate()`` (bf16), ``Shard(1)`` and ``Shard(0)`` (empty on rank 1), and a step
    counter: every rank holds the same values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(SEED)
    model = Small()
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(SEED + 3)
    state: dict[str, Any] = dict(model.state_dict())
    state["replicated"] = distribute_tensor(torch.randn(3, 4, generator=g).to(torch.bfloat16),
                                            mesh, [Replicate()])
    state["columns"] = distribute_tensor(torch.randn(2, 6, generator=g), mesh, [Shard(1)])
    state["one_row"] = distribute_tensor(torch.randn(1, 3, generator=g), mesh, [Shard(0)])
    state["step"] = 500
    return state


def _options_job(rank: int, world_size: int, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    state = _options_state(rank, world_size)
    full = _full({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    if rank == 0:
        torch.save(full, out / "reference.pt")
    dcp.save(state, storage_writer=FileSystemWriter(
        out / "safetensors", serialization_format=SerializationFormat.SAFETENSORS))
    dcp.save(state, storage_writer=FileSystemWriter(out / "rank_local"), use_collectives=False)
    dcp.save(state, storage_writer=FileSystemWriter(out / "zstd", _extensions=[ZStandard()]))
    # Compressed twice (torch applies each extension in turn and reads it back).
    dcp.save(state, storage_writer=FileSystemWriter(out / "zstd_twice",
                                                    _extensions=[ZStandard(), ZStandard()]))
    # Ranks that disagree on a tensor every rank stores whole, saved without coordination.
    differs = {"w": state["up.weight"], "counter": torch.full((4,), float(rank))}
    dcp.save(differs, storage_writer=FileSystemWriter(out / "rank_local_differs"),
             use_collectives=False)
    # Both options at once: torch records no usable offsets (its own loader fails too).
    dcp.save(state, storage_writer=FileSystemWriter(
        out / "safetensors_zstd", serialization_format=SerializationFormat.SAFETENSORS,
        _extensions=[ZStandard()]))


@on_disk()
def write_dcp_options(out: Path) -> Path:
    """On :data:`OPTIONS_WORLD` gloo ranks, ``dcp.save`` of :func:`_options_state` with each
    ``FileSystemWriter`` option: ``out/"safetensors"`` (``serialization_format=
    SerializationFormat.SAFETENSORS``), ``out/"rank_local"`` (``use_collectives=False``: one
    ``__<rank>.metadata`` per rank, replicated tensors and the step written by both),
    ``out/"zstd"`` (``_extensions=[ZStandard()]``), ``out/"zstd_twice"`` (two of them),
    ``out/"rank_local_differs"`` (a plain
    tensor ``counter`` whose value is the rank, saved whole by each rank without
    coordination) and ``out/"safetensors_zstd"`` (both options). The full tensors are
    ``out/"reference.pt"``; returns ``out``."""
    _run(_options_job, OPTIONS_WORLD, out)
    return out


# --------------------------------------------------------------------------------------------
# verl's FSDPCheckpointManager.save_checkpoint, FSDP2 (its calls, verl itself not installed:
# it pins transformers below the version this venv tests)


def _verl_job(rank: int, world_size: int, out: Path) -> None:
    """What ``FSDPCheckpointManager.save_checkpoint`` writes for an FSDP2 model after one
    optimizer step: ``model_``, ``optim_`` and ``extra_state_world_size_<W>_rank_<R>.pt`` (the
    last holds the LR scheduler and verl's ``get_rng_state()``: torch's, numpy's and Python's
    RNG states), ``fsdp_config.json`` and ``huggingface/`` (the model config) from rank 0."""
    import json
    import random

    import numpy as np
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(SEED)
    model = Small()
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    ckpt = out / "global_step_1" / CKPT_DIR
    ckpt.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    torch.save(state, ckpt / rank_file(world_size, rank))
    torch.save(optimizer.state_dict(), ckpt / f"optim_world_size_{world_size}_rank_{rank}.pt")
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(),
           "random": random.getstate()}
    torch.save({"lr_scheduler": scheduler.state_dict(), "rng": rng},
               ckpt / f"extra_state_world_size_{world_size}_rank_{rank}.pt")
    full = _full(state)
    if rank == 0:
        (ckpt / "huggingface").mkdir(exist_ok=True)
        (ckpt / "huggingface" / "config.json").write_text(json.dumps(
            {"architectures": ["SmallForTest"], "model_type": "small", "torch_dtype": "float32"}))
        (ckpt / "fsdp_config.json").write_text(
            json.dumps({"FSDP_version": 2, "world_size": world_size}, indent=4))
        torch.save(full, out / "reference.pt")


@on_disk()
def write_verl(out: Path, world_size: int) -> Path:
    """verl's FSDP2 checkpoint (see :func:`_verl_job`) on ``world_size`` ranks under
    ``out/global_step_1/actor``; reference ``out/reference.pt``. Returns ``out``."""
    _run(_verl_job, world_size, out)
    return out
