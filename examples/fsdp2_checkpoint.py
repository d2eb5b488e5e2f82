"""Write small but *real* PyTorch Distributed Checkpoints (DCP) for ckpttool.

Every checkpoint here is produced by the real writer, ``torch.distributed.checkpoint.save``,
called from 2-4 CPU processes (``torch.multiprocessing.start_processes``, forked by a
forkserver that has torch preloaded, or spawned where there is none; gloo backend) that hold
models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) or DTensors built with
``torch.distributed.tensor.distribute_tensor``.  Nothing in the ``.metadata`` files is made
up by hand.

Each call writes an accelerate-style *training checkpoint directory* ``out/`` (the kind of
folder that ``Accelerator.save_state`` leaves, e.g. ``checkpoint-500/``) whose model DCP
directory is ``out/pytorch_model_fsdp_0``.

Used as a module::

    from examples.fsdp2_checkpoint import KINDS, write_checkpoint
    dcp_dir = write_checkpoint("llama", Path("checkpoint-500"))

and as a script (the README demo)::

    python examples/fsdp2_checkpoint.py OUT [--kind llama] [--ranks N]

which prints the path of the model DCP directory.

Kinds (see the ``_write_<kind>`` docstrings for details):

``llama``       tiny tied-embedding ``LlamaForCausalLM`` (bf16 weights kept as fp32) under
                FSDP2, saved as accelerate does, with optimizer, config and reference logits.
``uneven``      FSDP2 parameters whose dim 0 does not divide by the world size, including
                ones for which a rank holds an empty shard.
``wrappers``    names carrying ``_orig_mod.`` (torch.compile) and
                ``_checkpoint_wrapped_module.`` (activation checkpointing) segments.
``mixed``       one save holding 12 dtypes (bf16 ... float8, ints, bool), 0-dim and plain
                tensors and non-tensor entries (an int, a nested dict, a custom object).
``placements``  a flat (torchtitan-style) state dict of DTensors with Shard(0), Shard(1) and
                Replicate() placements on a 4-rank mesh, several ``.distcp`` files per rank.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import random
import socket
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn

__all__ = [
    "DEFAULT_WORLD_SIZE",
    "KINDS",
    "MODEL_DIR",
    "OpaqueThing",
    "main",
    "start_rank_server",
    "write_checkpoint",
]

KINDS: tuple[str, ...] = ("llama", "uneven", "wrappers", "mixed", "placements")

DEFAULT_WORLD_SIZE: dict[str, int] = {
    "llama": 2,
    "uneven": 3,
    "wrappers": 2,
    "mixed": 2,
    "placements": 4,
}

#: Name of the model DCP directory inside the training checkpoint (accelerate's name).
MODEL_DIR = "pytorch_model_fsdp_0"
#: Name of the optimizer DCP directory inside the training checkpoint (``llama`` only).
OPTIMIZER_DIR = "optimizer_0"

SEED = 1234


class OpaqueThing:
    """A custom object stored in the ``mixed`` checkpoint as a pickled non-tensor entry.

    Reading it back needs arbitrary unpickling (``torch.load(weights_only=False)`` and this
    module importable): a safe tool must report it, never execute it.
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpaqueThing) and other.n == self.n

    def __repr__(self) -> str:
        return f"OpaqueThing({self.n})"


# --------------------------------------------------------------------------------------
# process plumbing
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, kind: str, out: str,
            llama_size: dict[str, int] | None = None) -> None:
    """Entry point of every spawned rank (must stay importable at module top level)."""
    _LLAMA_SIZE.clear()
    _LLAMA_SIZE.update(llama_size or {})
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _WRITERS[kind](rank, world_size, Path(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


#: Modules the forkserver imports once, so that each rank starts in a fraction of a second
#: instead of importing torch again (~2 s per rank on a small machine).
_PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "examples.fsdp2_checkpoint",
)
#: Also preloaded where these kinds are to be written.
_PRELOAD_EXTRA: dict[str, tuple[str, ...]] = {
    "llama": ("transformers", "transformers.models.llama.modeling_llama"),
}


def start_rank_server(kinds: Iterable[str] = KINDS, also: Iterable[str] = ()) -> str:
    """Start the process server that forks the ranks; return the start method to use.

    Where the platform has one this is a ``forkserver``, started once per parent process
    with torch (and whatever ``kinds`` need, e.g. transformers for ``llama``) imported;
    it then forks every rank of every job, so a pytest session that writes several
    checkpoints pays for the imports once instead of ~2 s per rank.  The ranks are still
    clean processes (forked from the server, never from the caller).  Starting it returns
    at once: the server imports in the background.  Later calls change nothing (the
    preload list only counts when the server starts).  Elsewhere: ``"spawn"``.

    :func:`write_checkpoint` calls this itself; call it first to preload for several kinds
    (and ``also``: other modules your own ranks import; one that is not installed is skipped).
    """
    import multiprocessing
    from multiprocessing import forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    preload = list(_PRELOAD)
    for kind in kinds:
        preload += [m for m in _PRELOAD_EXTRA.get(kind, ()) if m not in preload]
    preload += [m for m in also if m not in preload]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    forkserver.ensure_running()
    return "forkserver"


def _start_ranks(world_size: int, kind: str, out: Path, method: str) -> None:
    """Run :func:`_worker` on ``world_size`` fresh processes and wait for all of them."""
    mp.start_processes(
        _worker,
        args=(world_size, _free_port(), kind, str(out), dict(_LLAMA_SIZE)),
        nprocs=world_size,
        join=True,
        start_method=method,
    )


def _mesh(world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


# --------------------------------------------------------------------------------------
# llama
# --------------------------------------------------------------------------------------


#: The llama kind's sizes where they are not the tiny defaults (``--hidden-size``...: a
#: realistic checkpoint to try ckpttool on); the parent sets it, every rank gets a copy.
_LLAMA_SIZE: dict[str, int] = {}


def _llama_config() -> Any:
    from transformers import LlamaConfig

    size = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, **_LLAMA_SIZE}
    return LlamaConfig(
        **size,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _round_to_bf16_(model: nn.Module) -> None:
    """Make every parameter an fp32 tensor holding a bf16-representable value.

    Done in place on the local data: under FSDP2 a parameter is a DTensor whose local
    tensor is a view of FSDP's own sharded storage, and rebinding ``p.data`` there would
    leave the state dict (and the saved checkpoint) with the unrounded values.
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p.data
            local.copy_(local.to(torch.bfloat16).to(torch.float32))


def _build_llama() -> Any:
    """The unsharded fp32 model every rank (and the reference) starts from."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(_llama_config()).to(torch.float32)
    _round_to_bf16_(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _llama_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(training batch, reference input ids); the same on every rank."""
    g = torch.Generator().manual_seed(SEED + 1)
    train = torch.randint(3, 128, (2, 8), generator=g)
    ref = torch.randint(3, 128, (2, 8), generator=g)
    return train, ref


def _llama_step(model: nn.Module) -> torch.optim.Optimizer:
    """One real AdamW step, then re-round the weights to bf16-representable fp32."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    train, _ = _llama_batch()
    loss = model(input_ids=train, labels=train).loss
    loss.backward()
    optim.step()
    _round_to_bf16_(model)
    return optim


def _write_llama(rank: int, world_size: int, out: Path) -> None:
    """Tiny ``LlamaForCausalLM`` under FSDP2, saved exactly as accelerate does.

    * vocab 128, hidden 32, 2 layers, 4 heads, 2 kv heads, intermediate 64,
      ``tie_word_embeddings=True`` (so both ``lm_head.weight`` and
      ``model.embed_tokens.weight`` are in the state dict), ``dtype=bfloat16`` recorded in
      ``config.json`` whose ``architectures`` is ``["FSDPLlamaForCausalLM"]`` (the FSDP
      class name leaks into real accelerate checkpoints);
    * weights are fp32 upcasts of bf16 values (what mixed-precision FSDP keeps), also after
      one AdamW step, so casting back to bf16 is exact;
    * ``fully_shard`` on every decoder layer and on the root;
    * ``out/pytorch_model_fsdp_0``: ``dcp.save({"model": model.state_dict()})``;
    * ``out/optimizer_0``: ``dcp.save({"optimizer": get_optimizer_state_dict(model, optim)})``;
    * rank 0 writes ``config.json``, ``generation_config.json``, ``tokenizer_config.json``,
      ``special_tokens_map.json`` and ``random_states_0.pkl``; the parent process writes
      ``reference.pt`` (see :func:`_write_llama_reference`).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _build_llama()
    mesh = _mesh(world_size)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = _llama_step(model)

    state = model.state_dict()
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    dcp.save({"model": state}, checkpoint_id=out / MODEL_DIR)
    dcp.save(
        {"optimizer": get_optimizer_state_dict(model, optim)},
        checkpoint_id=out / OPTIMIZER_DIR,
    )

    if rank == 0:
        md = dcp.FileSystemReader(out / MODEL_DIR).read_metadata()
        for key in ("model.lm_head.weight", "model.model.embed_tokens.weight"):
            assert key in md.state_dict_metadata, key
        _write_llama_side_files(out)


def _write_llama_side_files(out: Path) -> None:
    from transformers import GenerationConfig

    config = _llama_config()
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["FSDPLlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig.from_model_config(config).save_pretrained(out)

    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 64,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")

    # accelerate's ``random_states_<process>.pkl`` (a plain pickle of a dict here).
    states = {
        "step": 500,
        "random_state": random.getstate(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    with open(out / "random_states_0.pkl", "wb") as f:
        pickle.dump(states, f)


def _llama_reference_model() -> nn.Module:
    """The unsharded reference: same seed, same bf16 rounding, same AdamW step as the ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded too: same reduction order
    try:
        model = _build_llama()
        _llama_step(model)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def _write_llama_reference(out: Path, model: nn.Module) -> None:
    """Parent side: check the unsharded reference against the save, write ``reference.pt``.

    The reference model's full state dict must equal, bit for bit, what ``dcp.save``
    wrote (read back with ``dcp.load``); every value must be bf16-representable.
    ``reference.pt`` holds ``{"input_ids": LongTensor [2, 8], "logits": fp32 logits}`` of
    that model.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming ... a single process": intended.
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            {"model": saved},
            checkpoint_id=out / MODEL_DIR,
            planner=DefaultLoadPlanner(),
            no_dist=True,
        )
    for k, v in expected.items():
        if not torch.equal(saved[k], v):
            raise AssertionError(f"saved {k} differs from the unsharded reference model")
        if not torch.equal(v.to(torch.bfloat16).to(torch.float32), v):
            raise AssertionError(f"{k} is not bf16-representable")

    _, input_ids = _llama_batch()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits.to(torch.float32)
    finally:
        torch.set_num_threads(threads)
    torch.save({"input_ids": input_ids, "logits": logits}, out / "reference.pt")


# --------------------------------------------------------------------------------------
# uneven
# --------------------------------------------------------------------------------------


class _Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(10, 7))  # 10 rows over 3 ranks: 4, 4, 2
        self.b = nn.Parameter(torch.randn(7))  # 3, 3, 1
        self.c = nn.Parameter(torch.randn(4, 3))  # 2, 2, 0: rank 2 empty
        self.d = nn.Parameter(torch.randn(2, 5))  # 1, 1, 0: rank 2 empty
        self.e = nn.Parameter(torch.randn(1))  # 1, 0, 0: ranks 1 and 2 empty
        self.inner = nn.Linear(5, 3)  # weight (3, 5): 1 row each; bias (3,)


def _write_uneven(rank: int, world_size: int, out: Path) -> None:
    """Parameters whose dim 0 does not divide by the world size (default 3).

    Shapes (10, 7), (7,), (4, 3), (2, 5), (1,) and a ``Linear(5, 3)``, ``fully_shard`` on
    the root; FSDP2 chunks dim 0 like ``torch.chunk`` so on 3 ranks ``c``, ``d`` and ``e``
    leave some rank with an empty local shard.  Saved as ``{"model": state_dict}``.
    """
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = _Uneven()
    fully_shard(model.inner, mesh=_mesh(world_size))
    fully_shard(model, mesh=_mesh(world_size))
    dcp.save({"model": model.state_dict()}, checkpoint_id=out / MODEL_DIR)


def build_uneven(world_size: int) -> nn.Module:
    """The ``uneven`` model sharded with ``fully_shard`` on ``world_size`` ranks as its writer
    shards it, freshly initialised (to load a checkpoint into). Call on every rank."""
    from torch.distributed.fsdp import fully_shard

    model = _Uneven()
    mesh = _mesh(world_size)
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# --------------------------------------------------------------------------------------
# wrappers
# --------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x)) * self.scale


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _wrappers_state_dict(compiled: nn.Module) -> dict[str, torch.Tensor]:
    """What users really save: names as ``named_parameters``/``named_buffers`` spell them."""
    state: dict[str, torch.Tensor] = dict(compiled.named_parameters())
    state.update(dict(compiled.named_buffers()))
    return state


def _write_wrappers(rank: int, world_size: int, out: Path) -> None:
    """Names with wrapper segments, produced by the real wrappers.

    Each block is wrapped in ``checkpoint_wrapper`` (activation checkpointing), each
    wrapped block and the root get ``fully_shard``, and the whole model goes through
    ``torch.compile`` (never run: only the names matter).  ``compiled.state_dict()`` keeps
    ``_orig_mod.`` but the checkpoint wrapper's state-dict hook strips
    ``_checkpoint_wrapped_module.``, so the saved dict is built from ``named_parameters``
    plus ``named_buffers``: keys like
    ``model._orig_mod.blocks.0._checkpoint_wrapped_module.proj.weight``.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = _Wrapped()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    mesh = _mesh(world_size)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model)

    state = _wrappers_state_dict(compiled)
    assert any("_orig_mod." in k for k in state)
    assert any("_checkpoint_wrapped_module" in k for k in state)
    dcp.save({"model": state}, checkpoint_id=out / MODEL_DIR)

    if rank == 0:
        keys = dcp.FileSystemReader(out / MODEL_DIR).read_metadata().state_dict_metadata
        assert any(k.startswith("model._orig_mod.") for k in keys), sorted(keys)
        assert any("._checkpoint_wrapped_module." in k for k in keys), sorted(keys)


# --------------------------------------------------------------------------------------
# mixed
# --------------------------------------------------------------------------------------

#: Every dtype in the ``mixed`` checkpoint (as DTensors sharded Shard(0)).
MIXED_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Non-trivial values: random bit patterns for floats (with NaN/inf sprinkled in)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).to(torch.bool)
    if dtype.is_floating_point:
        nbytes = torch.empty((), dtype=dtype).element_size()
        if nbytes == 1:
            # float8: random bytes viewed as float8 (includes NaN / max patterns).
            t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype).clone()
        else:
            t = (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
            flat = t.view(-1)
            flat[0] = float("nan")
            flat[1] = float("inf")
            flat[2] = float("-inf")
            flat[3] = -0.0
        return t
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=g, dtype=dtype)


def _write_mixed(rank: int, world_size: int, out: Path) -> None:
    """One save holding every dtype DCP writes, plus scalars, plain tensors and non-tensors.

    ``{"model": {...}, "step": 500, "meta": {"run": "demo", "lr": 0.001},
    "opaque": OpaqueThing(3)}`` where ``model`` holds, for every dtype in
    :data:`MIXED_DTYPES`, a ``(6, 3)`` DTensor sharded ``Shard(0)`` named
    ``model.<dtype>`` (e.g. ``model.float8_e4m3fn``), an int64 ``position_ids`` buffer
    (plain tensor, as FSDP2 leaves buffers), 0-dim ``scalar`` (3.5) and ``int_scalar`` (7)
    and a plain fp32 tensor ``plain``.  DCP flattens the nested dict, so the metadata keys
    are ``model.<name>``, ``step``, ``meta.run``, ``meta.lr`` and ``opaque``.

    ``dcp.save`` (torch 2.13) refused none of these dtypes.  It also accepts uint16/32/64,
    complex and the fnuz / e8m0 / float4 variants; those are left out on purpose (no
    safetensors dtype for most of them), so this checkpoint stays fully mergeable.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world_size)
    g = torch.Generator().manual_seed(SEED)
    model: dict[str, Any] = {}
    for dtype in MIXED_DTYPES:
        full = _random_tensor(dtype, (6, 3), g)
        # src_data_rank=None: every rank holds the same full tensor (same seed), so no
        # scatter is needed (gloo cannot scatter every dtype).
        model[_dtype_name(dtype)] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    model["position_ids"] = torch.arange(16, dtype=torch.int64).unsqueeze(0)
    model["scalar"] = torch.tensor(3.5)
    model["int_scalar"] = torch.tensor(7, dtype=torch.int64)
    model["plain"] = torch.randn(4, 5, generator=g)
    state = {
        "model": model,
        "step": 500,
        "meta": {"run": "demo", "lr": 0.001},
        "opaque": OpaqueThing(3),
    }
    dcp.save(state, checkpoint_id=out / MODEL_DIR)


# --------------------------------------------------------------------------------------
# placements
# --------------------------------------------------------------------------------------


def _write_placements(rank: int, world_size: int, out: Path) -> None:
    """A flat, torchtitan-style state dict of DTensors on a 1-D mesh (default 4 ranks).

    No ``"model"`` wrapper: keys such as ``model.layers.0.weight`` sit at the top level
    (``planner_data`` paths are 1-tuples).  Every key starts with ``model.`` on purpose, so
    the names alone look exactly like accelerate's ``{"model": ...}`` wrapper: only the
    metadata tells that this ``model.`` is part of the names and must be kept.
    ``Shard(0)``, ``Shard(1)`` (dim 1 of size 10: 3, 3, 3, 1 over 4 ranks), ``Replicate()``
    (one chunk, written by one rank), and ``Shard(0)`` of a (3, 8) tensor and ``Shard(1)``
    of an (8, 6) one (rank 3 empty: a zero-size chunk).  Written with
    ``FileSystemWriter(thread_count=2)`` so every rank writes ``__<r>_0.distcp`` and
    ``__<r>_1.distcp``.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(world_size)
    g = torch.Generator().manual_seed(SEED)
    specs: list[tuple[str, tuple[int, ...], Any]] = [
        ("model.embed_tokens.weight", (16, 8), Shard(0)),
        ("model.layers.0.weight", (8, 10), Shard(1)),
        ("model.layers.0.bias", (8,), Replicate()),
        ("model.layers.1.weight", (12, 8), Shard(0)),
        ("model.layers.1.bias", (3, 8), Shard(0)),
        ("model.norm.weight", (8,), Replicate()),
        ("model.lm_head.weight", (8, 6), Shard(1)),  # 2, 2, 2, 0: rank 3 empty
    ]
    state = {
        name: distribute_tensor(torch.randn(shape, generator=g), mesh, [placement],
                                src_data_rank=None)
        for name, shape, placement in specs
    }
    writer = dcp.FileSystemWriter(out / MODEL_DIR, thread_count=2)
    dcp.save(state, storage_writer=writer)


_WRITERS: dict[str, Callable[[int, int, Path], None]] = {
    "llama": _write_llama,
    "uneven": _write_uneven,
    "wrappers": _write_wrappers,
    "mixed": _write_mixed,
    "placements": _write_placements,
}


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------


def write_checkpoint(kind: str, out: Path, *, world_size: int | None = None,
                     llama_size: dict[str, int] | None = None) -> Path:
    """Write training checkpoint ``out/`` of the given kind; return its model DCP directory.

    ``kind`` is one of :data:`KINDS`; ``world_size`` defaults to
    ``DEFAULT_WORLD_SIZE[kind]``.  Spawns ``world_size`` gloo processes on a free local
    TCP port and returns ``out / "pytorch_model_fsdp_0"``.  ``llama_size`` overrides the
    llama kind's ``LlamaConfig`` sizes (``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``vocab_size``).
    """
    _LLAMA_SIZE.clear()
    _LLAMA_SIZE.update(llama_size or {})
    if kind not in _WRITERS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    n = DEFAULT_WORLD_SIZE[kind] if world_size is None else int(world_size)
    if n < 1:
        raise ValueError("world_size must be at least 1")
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    method = start_rank_server((kind,))
    # The parent's share of ``llama`` runs while the forkserver imports.
    reference = _llama_reference_model() if kind == "llama" else None
    _start_ranks(n, kind, out, method)
    if reference is not None:
        _write_llama_reference(out, reference)
    return out / MODEL_DIR


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # blocked (sys.modules[module] = None) or broken
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="A realistic llama to try ckpttool on: --hidden-size 2048 --layers 16 "
        "--vocab-size 32000 writes about 2.7 GB of fp32 weights (and twice that of optimizer "
        "state); each rank and the parent hold the whole model while writing it.")
    parser.add_argument("out", type=Path, help="training checkpoint directory to write")
    parser.add_argument("--kind", choices=KINDS, default="llama")
    parser.add_argument("--ranks", type=int, default=None, help="world size (processes)")
    sizes = parser.add_argument_group("llama sizes (default: a tiny model of 23k parameters)")
    sizes.add_argument("--hidden-size", type=int, help="hidden size, a multiple of 4")
    sizes.add_argument("--intermediate-size", type=int, help="MLP size (default 2 x hidden)")
    sizes.add_argument("--layers", type=int, help="decoder layers")
    sizes.add_argument("--vocab-size", type=int, help="vocabulary size, at least 128")
    args = parser.parse_args(argv)
    llama_size = {key: value for key, value in (
        ("hidden_size", args.hidden_size), ("num_hidden_layers", args.layers),
        ("vocab_size", args.vocab_size),
        ("intermediate_size", args.intermediate_size or (args.hidden_size or 0) * 2 or None))
        if value is not None}
    if llama_size and args.kind != "llama":
        parser.error("--hidden-size, --intermediate-size, --layers and --vocab-size apply to "
                     "--kind llama")
    if llama_size.get("hidden_size", 4) % 4 or llama_size.get("vocab_size", 128) < 128 or any(
            v < 1 for v in llama_size.values()):
        parser.error("--hidden-size must be a positive multiple of 4 (4 attention heads) and "
                     "--vocab-size at least 128")
    # Say what is missing now, not after the ranks have started (a traceback, 30 s later).
    missing = [m for m in _PRELOAD_EXTRA.get(args.kind, ()) if "." not in m
               and not _installed(m)]
    if missing:
        parser.error(f"--kind {args.kind} needs {', '.join(missing)}, which is not installed: "
                     f"pip install {' '.join(missing)} (make demo installs it in .venv)")
    print(write_checkpoint(args.kind, args.out, world_size=args.ranks, llama_size=llama_size))
    return 0


if __name__ == "__main__":
    # Re-enter through the package name so that spawned ranks import the worker (and pickle
    # OpaqueThing) as ``examples.fsdp2_checkpoint``, not as ``__mp_main__``.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from examples.fsdp2_checkpoint import main as _main

    raise SystemExit(_main())
