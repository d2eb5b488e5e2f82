"""Real writers of checkpoints that hold the model and the rest of the training state in one
DCP, on 2 gloo ranks on CPU (:func:`tests.fsdp2_ranks.run_on_ranks`):

* :func:`write_torchtitan` ``(out)``: torchtitan 0.3's own ``CheckpointManager`` saving a tiny
  llama3 (dim 64, 2 layers, vocab 256; built from torchtitan's llama3 config builders and
  parallelized by its ``parallelize_llama`` with ``spmd_backend="full_dtensor"``, i.e. FSDP2
  over the 2 ranks) after one real AdamW step of its ``OptimizersContainer`` and
  ``LRSchedulersContainer``, with its ``ParallelAwareDataloader`` (one batch drawn) and a
  train state. The trainer itself is not driven (it needs a tokenizer and a dataset); the
  components are the ones it builds. torchtitan picks "cuda" as its device type on a machine
  without an accelerator, so the ranks set it to "cpu" first. Checkpoint
  ``out/checkpoint/step-1``; rank 0 writes the gathered full model state dict to
  ``out/reference.pt``.
* :func:`write_lightning` ``(out)``: Lightning Fabric 2.6 ``fabric.save(out/"epoch=0.ckpt",
  state)`` with ``state = {"model", "optimizer", "lr_scheduler", "step", "blob": bytes}``.
  Fabric refuses its ``FSDPStrategy`` on CPU ("FSDP is only available on GPU"), so the model
  is sharded by ``ModelParallelStrategy`` (FSDP2 through ``fully_shard``), whose
  ``save_checkpoint`` writes the same layout: a DCP directory of the modules and optimizers,
  and ``meta.pt`` beside it with the rest. Reference: ``out/reference.pt``.
* :func:`write_unflattened` ``(out)``: ``dcp.save`` with
  ``DefaultSavePlanner(flatten_state_dict=False)``: ``out/"plain"`` saves ``{"model": full
  state dict (plain tensors), "step": 7}`` from both ranks; ``out/"dtensor"`` saves
  ``{"model": sharded state dict (DTensors), "optim": ..., "step": 7}``, which keeps one
  rank's pickled copy of each top-level value (the other rank's shards are lost);
  ``out/"flat"`` saves the sharded state dict at the top level. Reference:
  ``out/reference.pt``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.fixture_cache import on_disk
from tests.fsdp2_ranks import run_on_ranks

WORLD = 2
TORCHTITAN_STEP = "checkpoint/step-1"
LIGHTNING_CKPT = "epoch=0.ckpt"


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in state.items()}


# --------------------------------------------------------------------------------------------
# torchtitan


def _llama3_config() -> Any:
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.model import Llama3Model

    dim, heads, vocab = 64, 4, 256
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=2, dim=dim, n_heads=heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000,
                                    scaling="llama"),
            attn_backend="flex"))


def _torchtitan_job(rank: int, world_size: int, out: str) -> None:
    warnings.simplefilter("ignore")
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    # torchtitan takes "cuda" when no accelerator is found; its meshes must be on CPU here.
    parallel_dims.device_type = tt_utils.device_type = "cpu"  # type: ignore[attr-defined]
    parallelism = ParallelismConfig(spmd_backend="full_dtensor")
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    config = _llama3_config()

    class _Job:
        pass

    job = _Job()
    job.parallelism = parallelism  # type: ignore[attr-defined]
    config.update_from_config(config=job)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model = parallelize_llama(model, parallel_dims=dims,
                              training=TrainingConfig(mixed_precision_param="float32"),
                              parallelism=parallelism, compile_config=CompileConfig(),
                              ac_config=None, dump_folder=out)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                   training_steps=10)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():  # the same full gradient on every rank, sharded like p
        p.grad = distribute_tensor(torch.randn(p.shape, generator=g), p.device_mesh,
                                   p.placements)
    optimizers.step()
    schedulers.step()

    class TrainState:
        def state_dict(self) -> dict[str, Any]:
            return {"step": 1, "ntokens_seen": 32}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    dataloader = ParallelAwareDataloader([torch.tensor([i]) for i in range(8)], dp_rank=rank,
                                         dp_world_size=world_size, batch_size=2)
    next(iter(dataloader))
    manager = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1,
                                       keep_latest_k=0).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers,
        lr_schedulers=schedulers, states={"train_state": TrainState()}, sd_adapter=None,
        base_folder=out)
    manager.save(curr_step=1)
    manager.close()
    full = _full(model.state_dict())
    if rank == 0:
        torch.save(full, Path(out) / "reference.pt")


@on_disk()
def write_torchtitan(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    run_on_ranks(_torchtitan_job, WORLD, str(out))
    return out


# --------------------------------------------------------------------------------------------
# Lightning Fabric


def _shard_with_fsdp2(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _lightning_job(rank: int, world_size: int, out: str) -> None:
    warnings.simplefilter("ignore")
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize_fn=_shard_with_fsdp2,
                                     data_parallel_size=world_size, tensor_parallel_size=1,
                                     process_group_backend="gloo")
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()  # the process group exists already (LOCAL_RANK is set): nothing launched
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 4, generator=torch.Generator().manual_seed(1))).sum())
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    scheduler.step()
    state = {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler, "step": 1,
             "blob": b"\x80\x04opaque-bytes"}
    fabric.save(Path(out) / LIGHTNING_CKPT, state)
    full = _full(model.state_dict())
    if rank == 0:
        torch.save(full, Path(out) / "reference.pt")


@on_disk()
def write_lightning(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    run_on_ranks(_lightning_job, WORLD, str(out))
    return out


# --------------------------------------------------------------------------------------------
# DefaultSavePlanner(flatten_state_dict=False)


def _unflattened_job(rank: int, world_size: int, out: str) -> None:
    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4, generator=torch.Generator().manual_seed(1))).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    full = _full(model_sd)
    root = Path(out)

    def save(state: dict[str, Any], name: str) -> None:
        dcp.save(state, checkpoint_id=root / name,
                 planner=DefaultSavePlanner(flatten_state_dict=False))

    save({"model": full, "step": 7}, "plain")
    save({"model": model_sd, "optim": optim_sd, "step": 7}, "dtensor")
    save({**model_sd, "step": 7}, "flat")
    if rank == 0:
        torch.save(full, root / "reference.pt")


@on_disk()
def write_unflattened(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    run_on_ranks(_unflattened_job, WORLD, str(out))
    return out
