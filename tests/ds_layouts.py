"""Real DeepSpeed ZeRO checkpoints, written by ``DeepSpeedEngine.save_checkpoint`` on CPU.

:func:`write_zero` ``(out, stage, world_size)`` runs ``deepspeed.initialize`` on
``world_size`` gloo processes (``DS_ACCELERATOR=cpu``; ``torch.optim.AdamW`` passed in, so no
compiled optimizer op is needed), takes one bf16 training step of :class:`TinyLM` and calls
``engine.save_checkpoint(out)``: ``out/latest`` names ``global_step1/``, which holds
``*_model_states.pt`` and ``*_optim_states.pt`` per rank. A ``config.json`` that ties the
embeddings is written beside. Rank 0 then consolidates the checkpoint with DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` (the writer's reference) and saves the result as
``out.parent / "reference.pt"``.

:class:`TinyLM` covers what the layout has to get right: an embedding tied to the output
head (DeepSpeed stores it once, ``shared_params`` names the other), parameters of 1, 2 and 3
dimensions whose sizes divide by no world size (ZeRO-2 alignment padding, ZeRO-3 per-rank
padding, pieces that start and end inside rows), a frozen parameter (``frozen_param_*``) and
float and int64 buffers.

Importing this module does not import DeepSpeed; :data:`DEEPSPEED` says whether it can be.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from tests.fixture_cache import on_disk
from tests.fsdp2_ranks import rank_server
from tests.layouts import _free_port

DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
VOCAB, DIM, HIDDEN = 11, 6, 7


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)  # frozen
        self.mix = nn.Parameter(torch.randn(3, 5, HIDDEN) * 0.1)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN))
        self.register_buffer("positions", torch.arange(5, dtype=torch.int64) * 3 - 4)
        for p in self.norm.parameters():
            p.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.up(self.embed_tokens(ids))
        h = self.norm(h * self.scale.to(h.dtype))
        h = h + self.mix.to(h.dtype).sum(dim=(0, 1))
        return self.lm_head(self.down(h))


def llama_config() -> Any:
    """A tiny transformers Llama (tied embeddings): the real model class a config names, for
    the output contract (``write_zero(..., model="llama")``)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=24,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       tie_word_embeddings=True, architectures=["LlamaForCausalLM"])


def _rank(rank: int, world_size: int, port: int, stage: int, out: str,
          model_kind: str = "tiny") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import importlib

    import deepspeed
    from deepspeed.utils import logger
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    logger.setLevel("ERROR")
    # DeepSpeed compiles a shared-memory all-reduce kernel (g++, about a minute) when its
    # communication backend starts; only inference_all_reduce uses it, never training or
    # saving, so the checkpoint is the same without it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model: nn.Module = TinyLM()
    if model_kind == "llama":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(llama_config())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.tensor([[1 + rank, 4], [7, 10 - rank]])
    loss = (engine(input_ids=ids, labels=ids).loss if model_kind == "llama"
            else engine(ids).float().pow(2).mean())
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out)
    deepspeed.comm.barrier()
    if rank == 0:
        reference = get_fp32_state_dict_from_zero_checkpoint(out)
        torch.save(reference, Path(out).parent / "reference.pt")
    deepspeed.comm.barrier()


@on_disk()
def write_zero(out: Path, stage: int, world_size: int, model: str = "tiny") -> Path:
    """Write a ZeRO-``stage`` checkpoint of :class:`TinyLM` (``model="llama"``: of a tiny
    transformers Llama, :func:`llama_config`, its config.json beside) from ``world_size``
    ranks into ``out``, with a ``config.json`` (bf16, tied embeddings) beside ``out/latest``;
    the reference is ``out.parent / "reference.pt"``."""
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(world_size, _free_port(), stage, str(out), model),
                       nprocs=world_size, join=True, start_method=rank_server())
    if model == "llama":
        llama_config().save_pretrained(out)
        return out
    (out / "config.json").write_text(json.dumps({
        "architectures": ["TinyLM"], "model_type": "tiny", "torch_dtype": "bfloat16",
        "tie_word_embeddings": True}))
    return out
