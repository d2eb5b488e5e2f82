"""Writes the Megatron-Core runs in this folder, which cannot be written at test time.

* ``deepseek_v3-tp2/``, ``deepseek_v3-ep2/``: DeepSeek-V3-shaped ``GPTModel`` s (multi-latent
  attention, a first dense layer, sigmoid routing with an expert bias, shared experts),
  saved by megatron-core 0.16.1. Its MLA builds its ``RotaryEmbedding`` (and the router its
  expert bias) on ``torch.cuda.current_device()``, so the model needs a CUDA device; its
  reference forward pass runs on it.
* ``deepseek_v3-mtp/``: the same at TP 2 with two layers (dense, then MoE) and one
  multi-token prediction layer (``mtp_num_layers=1``: megatron-core's own
  ``get_gpt_mtp_block_spec`` for the local backend, whose layer is the decoder's last).
  ``GPTModel.forward`` with MTP needs labels and returns the loss, so the reference keeps the
  MTP block's output (the main and the MTP hidden states, concatenated on the sequence axis)
  with a forward hook and writes both logits (``logits``, ``mtp_logits.0``).
* ``deepseek_v3-mtp2/`` (EP 2, two MTP layers, each fed the one before), ``deepseek_v3-pp2/``
  (pipeline parallel 2: the dense layer on stage 0, the MoE layer and one MTP layer on stage 1,
  which keeps a copy of the embedding tied to stage 0's) and ``deepseek_v3-yarn/`` (TP 2, YaRN
  as MLA's default: ``rope_type`` unset in args, each YaRN parameter off its default), written
  on 2026-11-27 on one NVIDIA H100 (``versions-more.json``), megatron-core 0.16.1.
* ``llama-common_state/``: a Llama saved by megatron-core 0.19.2 (Python 3.12 and later), which
  stores the common state (``args``, ``iteration``...) as the DCP bytes entry
  ``common_state/shard_0_1`` instead of ``common.pt``, and (``verify_integrity=True``) writes
  ``integrity.json``. (0.17 and 0.18 still write ``common.pt``.)

Written on 2026-11-26 on one NVIDIA H200 (see ``versions.json``): Python 3.12.3, torch 2.11.0+cu130,
megatron-core 0.16.1 and 0.19.2 (each from its wheel, no Transformer Engine, no apex):

    PYTHONPATH=/tmp/mc16 python3 generate.py save deepseek OUT
    PYTHONPATH=/tmp/mc16 python3 generate.py reference deepseek OUT
    PYTHONPATH=/tmp/mc16 python3 generate.py save mtp OUT
    PYTHONPATH=/tmp/mc16 python3 generate.py reference mtp OUT
    PYTHONPATH=/tmp/mc16 python3 generate.py save more OUT
    PYTHONPATH=/tmp/mc16 python3 generate.py reference more OUT
    PYTHONPATH=/tmp/mc19 python3 generate.py save common OUT
    PYTHONPATH=/tmp/mc19 python3 generate.py reference common OUT

``save``: 2 gloo processes on the CPU build the model (``transformer_impl="local"``,
``use_cpu_initialization``) at the variant's TP/EP and call ``dist_checkpointing.save`` with
the state dict Megatron-LM's ``generate_state_dict`` builds (``model``, ``rng_state``,
``args``, ``iteration``...), into ``RUN/iter_0000002/``, then write the tracker. The two CUDA
calls of its save path (``torch.cuda.synchronize()`` after copying CPU tensors to the CPU, and
``torch.cuda.current_device()`` for the device of a one-int all-reduce over gloo) are replaced
for the save alone; every byte written is megatron-core's own.

``reference``: one process on the GPU builds a TP=1, EP=1 model, loads the run with
``dist_checkpointing.load`` and writes ``RUN/reference.safetensors`` (its own full state dict,
Megatron's names) and ``RUN/logits.safetensors`` (``tokens``, and the fp32 ``logits`` of its
forward pass on them, TF32 off). ``RUN/config.json`` is the Hugging Face config of the model.

The local ``DotProductAttention`` does not take the ``k_channels``/``v_channels`` MLA passes
(Transformer Engine's does): the ModuleSpec names the core-attention class, so a subclass that
accepts them, and asserts they are the head size the local class computes from ``kv_channels``
(hence ``v_head_dim == qk_head_dim + qk_pos_emb_head_dim == kv_channels`` here), is plugged in
there. Nothing else of megatron-core is changed, except two names that its code without
Transformer Engine gets wrong, each set to what is true there: ``multi_latent_attention.HAVE_TE``
(True because a MagicMock stands in for TE) and the router's ``te_general_gemm`` (undefined;
``None`` selects its plain torch path).

``--dry-run`` (any machine, megatron-core on Python 3.11 and no GPU): ``torch.cuda`` calls
answer for the CPU throughout, so the same code runs there before a GPU is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import sys
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

WORLD_SIZE = 2
ITERATION = 2
VOCAB = 50  # padded to 64 by make_vocab_size_divisible_by 16 (x TP)
TOKENS = [[3, 17, 49, 0, 22, 8, 31, 5]]
DRY = False


@dataclass(frozen=True)
class Variant:
    name: str
    family: str
    tp: int = 1
    ep: int = 1
    layers: int = 3
    hidden: int = 64
    heads: int = 4
    ffn: int = 64
    # deepseek_v3
    q_lora: int | None = 32  # None: a plain q projection
    kv_lora: int = 32
    qk_head_dim: int = 16
    rope_dim: int = 8
    v_head_dim: int = 24  # = qk_head_dim + rope_dim: the local core attention's head size
    experts: int = 4
    moe_ffn: int = 16
    shared_ffn: int = 32  # 2 shared experts of moe_ffn
    first_dense: int = 1  # moe_layer_freq [0] * first_dense + [1] * rest
    groups: int = 2  # llama: query groups
    mtp: int = 0  # deepseek_v3: multi-token prediction layers (mtp_num_layers)
    pp: int = 1  # pipeline stages (the layers split evenly; MTP on the last stage)
    # deepseek_v3: YaRN, as Megatron-LM's args hold it (MLATransformerConfig's field names);
    # ``rope_type`` is left unset in args, as DeepSeek-V3's Megatron-LM recipes leave it, so
    # MLATransformerConfig's default (yarn) applies
    yarn: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


DEEPSEEK = [
    # per-layer keys (a dense first layer), TP 2 (experts TP-sharded too), q_lora_rank
    Variant("deepseek_v3-tp2", "deepseek_v3", tp=2),
    # every layer MoE (stacked keys), experts split over EP 2, a plain q projection
    Variant("deepseek_v3-ep2", "deepseek_v3", ep=2, layers=2, q_lora=None, first_dense=0),
]
# multi-token prediction: one MTP layer (a MoE layer, as the last decoder layer) after a dense
# and a MoE layer, TP 2 (eh_proj column-parallel)
MTP = [Variant("deepseek_v3-mtp", "deepseek_v3", tp=2, layers=2, mtp=1)]
COMMON = [Variant("llama-common_state", "llama", tp=2, layers=2, hidden=32, ffn=48)]
MORE = [
    # two MTP layers (each after the one before), experts split over EP 2
    Variant("deepseek_v3-mtp2", "deepseek_v3", ep=2, layers=2, mtp=2),
    # pipeline parallel 2: layer 0 (dense) on stage 0, layer 1 (MoE) and the MTP layer on
    # stage 1, which keeps its own copy of the embedding for MTP (tied to stage 0's)
    Variant("deepseek_v3-pp2", "deepseek_v3", pp=2, layers=2, mtp=1),
    # YaRN RoPE (Megatron's MLA default), every parameter off its default so a swap shows:
    # mscale and mscale_all_dim both set, as in DeepSeek-V3's own config
    Variant("deepseek_v3-yarn", "deepseek_v3", tp=2, layers=2, yarn=dict(
        rotary_scaling_factor=4.0, original_max_position_embeddings=2048, beta_fast=64.0,
        beta_slow=2.0, mscale=0.9, mscale_all_dim=0.8)),  # the ramp spans 3 of 4 frequencies
]
SETS = {"deepseek": DEEPSEEK, "mtp": MTP, "common": COMMON, "more": MORE}


def _max_positions(v: Variant) -> int:
    if v.yarn:  # the extended context
        return int(v.yarn["rotary_scaling_factor"] * v.yarn["original_max_position_embeddings"])
    return 64


def padded_vocab(tp: int) -> int:
    multiple = 16 * tp
    return -(-VOCAB // multiple) * multiple


def _args(v: Variant) -> argparse.Namespace:
    """What Megatron-LM's ``args`` hold of the model (the fields converters read)."""
    from megatron.core.transformer.enums import AttnBackend

    ds = v.family == "deepseek_v3"
    freq: Any = [0] * v.first_dense + [1] * (v.layers - v.first_dense) if ds else 1
    return argparse.Namespace(
        num_layers=v.layers, hidden_size=v.hidden, ffn_hidden_size=v.ffn,
        num_attention_heads=v.heads, num_query_groups=v.heads if ds else v.groups,
        group_query_attention=not ds, kv_channels=v.v_head_dim if ds else v.hidden // v.heads,
        max_position_embeddings=_max_positions(v), seq_length=16,
        padded_vocab_size=padded_vocab(v.tp),
        make_vocab_size_divisible_by=16, vocab_size=VOCAB,
        tensor_model_parallel_size=v.tp, pipeline_model_parallel_size=v.pp,
        expert_model_parallel_size=v.ep, num_experts=v.experts if ds else None,
        moe_ffn_hidden_size=v.moe_ffn if ds else None, moe_router_topk=2,
        moe_router_pre_softmax=False,
        moe_shared_expert_intermediate_size=v.shared_ffn if ds else None,
        moe_layer_freq=freq, moe_router_score_function="sigmoid" if ds else "softmax",
        moe_router_enable_expert_bias=ds, moe_router_topk_scaling_factor=2.5 if ds else None,
        multi_latent_attention=ds, q_lora_rank=v.q_lora if ds else None,
        kv_lora_rank=v.kv_lora if ds else None, qk_head_dim=v.qk_head_dim if ds else None,
        qk_pos_emb_head_dim=v.rope_dim if ds else None, v_head_dim=v.v_head_dim if ds else None,
        qk_layernorm=ds, rope_type=None if v.yarn else "rope", rotary_percent=1.0,
        use_rope_scaling=False, **(v.yarn or {}),
        swiglu=True, normalization="RMSNorm", norm_epsilon=1e-6,
        untie_embeddings_and_output_weights=True, add_qkv_bias=False, add_bias_linear=False,
        position_embedding_type="rope", rotary_base=10000, ckpt_format="torch_dist",
        params_dtype=torch.float32, bf16=False, fp16=False, iteration=ITERATION,
        transformer_impl="local", attention_backend=AttnBackend.auto,
        tokenizer_type="NullTokenizer", world_size=WORLD_SIZE,
        data_parallel_size=WORLD_SIZE // (v.tp * v.pp), consumed_train_samples=8,
        use_distributed_optimizer=False, mtp_num_layers=v.mtp or None)


def _core_attention() -> type:
    """MLA's core attention in the local spec (a ModuleSpec choice, not a patch): the stand-in
    shared with Megatron-LM's generator (``tests/data/megatron_lm/mla_local.py``)."""
    sys.path.append(str(Path(__file__).resolve().parent.parent / "megatron_lm"))
    from mla_local import local_core_attention

    return local_core_attention()


def _have_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _model(v: Variant, tp: int, ep: int, pp: int = 1) -> Any:
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    common: dict[str, Any] = dict(
        num_layers=v.layers, hidden_size=v.hidden, ffn_hidden_size=v.ffn,
        num_attention_heads=v.heads, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=1e-6,
        add_bias_linear=False, params_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_dtype=torch.float32, pipeline_model_parallel_size=pp,
        transformer_impl="local", persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0)
    if v.family == "deepseek_v3":
        config = MLATransformerConfig(
            **common, kv_channels=v.v_head_dim, q_lora_rank=v.q_lora, kv_lora_rank=v.kv_lora,
            qk_head_dim=v.qk_head_dim, qk_pos_emb_head_dim=v.rope_dim, v_head_dim=v.v_head_dim,
            **({"rope_type": "yarn", **v.yarn} if v.yarn else {"rope_type": "rope"}),
            rotary_base=10000, rotary_percent=1.0, qk_layernorm=True,
            num_moe_experts=v.experts, moe_ffn_hidden_size=v.moe_ffn,
            moe_shared_expert_intermediate_size=v.shared_ffn, moe_router_topk=2,
            moe_layer_freq=[0] * v.first_dense + [1] * (v.layers - v.first_dense)
            if v.first_dense else 1,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
            expert_model_parallel_size=ep, moe_router_dtype="fp32",
            mtp_num_layers=v.mtp or None)
        # Without Transformer Engine, megatron-core 0.16's multi_latent_attention imports
        # megatron.core.extensions.transformer_engine, which then stands a MagicMock in for
        # TE, so its HAVE_TE reads True and ``isinstance(linear_proj, TELinear)`` fails: the
        # flag is set to what is true here (no TE), which is all its TE-only branch asks.
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = _have_te()
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization="RMSNorm")
        attention = _core_attention()
        for layer in {id(s): s for s in spec.layer_specs}.values():
            layer.submodules.self_attention.submodules.core_attention = attention
    else:
        config = TransformerConfig(**common, num_query_groups=v.groups)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp_spec = None
    if v.mtp:  # megatron-core's own MTP block spec (local backend): its layer is the last one's
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded_vocab(v.tp),
                    max_sequence_length=64, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False, mtp_block_spec=mtp_spec,
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage())


def _vary(model: Any) -> None:
    """Norms start at 1, the expert bias at 0: a map that swapped two of them would still give
    the same logits. Each gets values of its own, drawn whole from a generator seeded by its
    name and sliced to this TP rank's part, so any TP writes the same model."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        named = list(model.named_parameters()) + [
            (n, b) for n, b in model.named_buffers() if n.endswith("expert_bias")]
        for name, p in named:
            if "norm" not in name and not name.endswith("bias"):
                continue
            g = torch.Generator().manual_seed(zlib.crc32(_global_name(model, name).encode()))
            if getattr(p, "tensor_model_parallel", False):
                d = p.partition_dim
                shape = list(p.shape)
                shape[d] *= tp
                value = torch.randn(shape, generator=g).narrow(d, rank * p.shape[d], p.shape[d])
            else:
                value = torch.randn(tuple(p.shape), generator=g)
            p.copy_(value * 0.1 + (1.0 if "norm" in name else 0.0))


def _global_name(model: Any, name: str) -> str:
    """``decoder.layers.{i}`` of a pipeline stage as the model's layer number (the same name
    at PP 1)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if not name.startswith("decoder.layers."):
        return name
    i, rest = name[len("decoder.layers."):].split(".", 1)
    return f"decoder.layers.{int(i) + get_transformer_layer_offset(model.config)}.{rest}"


def _rng_state() -> Any:
    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
             "rng_tracker_states": {}}
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", [state], (pp, tp),
                         (ps.get_pipeline_model_parallel_rank(),
                          ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _save(v: Variant, run: Path) -> None:
    import inspect

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    ps.initialize_model_parallel(tensor_model_parallel_size=v.tp,
                                 pipeline_model_parallel_size=v.pp,
                                 expert_model_parallel_size=v.ep)
    # use_cpu_initialization: every rank draws the full weights from torch's own generator
    # and keeps its slice, so the same seed gives the same model at any TP; each pipeline
    # stage draws from a seed of its own (else its layers would repeat the first stage's).
    torch.manual_seed(1234 + len(v.name) + 1000 * ps.get_pipeline_model_parallel_rank())
    model = _model(v, v.tp, v.ep, v.pp).cpu()  # MLA's rotary, the expert bias start on the GPU
    _vary(model)
    # What Megatron-LM passes: the data-parallel group (a last stage holding MTP but not the
    # embedding ties its copy of the embedding to the first stage's with it).
    metadata = ensure_metadata_has_dp_cp_group(None)
    state = {"args": _args(v), "checkpoint_version": 3.0, "iteration": ITERATION,
             "num_floating_point_operations_so_far": 1.5e9,
             "model": model.sharded_state_dict(metadata=metadata), "rng_state": _rng_state()}
    iter_dir = run / f"iter_{ITERATION:07d}"
    if torch.distributed.get_rank() == 0:
        iter_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    extra = {"verify_integrity": True} if "verify_integrity" in inspect.signature(
        dist_checkpointing.save).parameters else {}
    with _save_path_shims():
        dist_checkpointing.save(state, str(iter_dir), **extra)
    if torch.distributed.get_rank() == 0:  # Megatron-LM writes the tracker after the save
        (run / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    torch.distributed.barrier()
    ps.destroy_model_parallel()


class _save_path_shims:  # noqa: N801 - a context manager
    """The save path's two CUDA calls, for CPU tensors saved over gloo (see the docstring)."""

    def __enter__(self) -> None:
        self.saved = torch.cuda.synchronize, torch.cuda.current_device
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        if not DRY:
            torch.cuda.synchronize, torch.cuda.current_device = self.saved


def _save_rank(rank: int, world_size: int, port: int, out: str, which: str,
               dry: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    _setup(dry)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    for v in SETS[which]:
        _save(v, Path(out) / v.name)
    torch.distributed.destroy_process_group()


def _setup(dry: bool) -> None:
    global DRY
    DRY = dry
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    if dry:  # the dry run only: no GPU here
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def _reference(v: Variant, run: Path, device: str) -> None:
    """Megatron's own loader into a TP=1, EP=1 model, and its forward pass on the GPU."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.moe import moe_utils
    from safetensors.torch import save_file

    # Without Transformer Engine the router asks ``te_general_gemm is not None`` of a name
    # it defines only when TE imports; None is what it means there (its torch.mm path).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    ps.initialize_model_parallel()
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(99)
    # Loaded on the CPU (over gloo, as it was saved), then moved to the GPU for the forward.
    model = _model(v, 1, 1).cpu()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                     str(run / f"iter_{ITERATION:07d}"))
    model.load_state_dict(loaded["model"])
    model.to(device).eval()
    tokens = torch.tensor(TOKENS)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    n = tokens.shape[1]  # Megatron's mask: True where attention is not allowed
    causal = torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool()
    extra: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if not v.mtp:
            logits = model(tokens.to(device), positions.to(device), causal.to(device))
        else:
            # With MTP, GPTModel.forward needs labels and returns the loss; its MTP block returns
            # the main and the MTP hidden states (after their final norms) concatenated on the
            # sequence axis: a hook keeps them, and the output layer gives both logits.
            seen: list[torch.Tensor] = []
            hook = model.mtp.register_forward_hook(lambda m, a, out: seen.append(out))
            model(tokens.to(device), positions.to(device), causal.to(device),
                  labels=tokens.to(device))
            hook.remove()
            main, *mtp = torch.chunk(seen[0], 1 + v.mtp, dim=0)
            logits = model.output_layer(main)[0].transpose(0, 1)
            for k, h in enumerate(mtp):  # position i predicts token i + 2 + k
                extra[f"mtp_logits.{k}"] = model.output_layer(h)[0].transpose(0, 1).float().cpu()
    full = {k: t.detach().cpu().contiguous() for k, t in model.state_dict().items()
            if isinstance(t, torch.Tensor) and not k.endswith("._extra_state")}
    save_file(full, str(run / "reference.safetensors"))
    save_file({"tokens": tokens, "logits": logits.float().cpu().contiguous(),
               **{k: t.contiguous() for k, t in extra.items()}},
              str(run / "logits.safetensors"))
    (run / "config.json").write_text(json.dumps(hf_config(v), indent=2) + "\n")
    ps.destroy_model_parallel()


def hf_config(v: Variant) -> dict[str, Any]:
    """The Hugging Face config.json of the model (transformers fills in the rest)."""
    base: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": v.hidden, "intermediate_size": v.ffn,
        "num_hidden_layers": v.layers, "num_attention_heads": v.heads,
        "max_position_embeddings": _max_positions(v), "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "torch_dtype": "float32"}
    if v.family == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **base,
                "num_key_value_heads": v.groups, "head_dim": v.hidden // v.heads,
                "mlp_bias": False}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **base,
            "num_key_value_heads": v.heads, "q_lora_rank": v.q_lora,
            "kv_lora_rank": v.kv_lora, "qk_nope_head_dim": v.qk_head_dim,
            "qk_rope_head_dim": v.rope_dim, "v_head_dim": v.v_head_dim,
            "head_dim": v.rope_dim, "n_routed_experts": v.experts,
            "n_shared_experts": v.shared_ffn // v.moe_ffn,
            "moe_intermediate_size": v.moe_ffn, "num_experts_per_tok": 2,
            "first_k_dense_replace": v.first_dense, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True,
            **({"num_nextn_predict_layers": v.mtp} if v.mtp else {}),
            **({"rope_parameters": _hf_yarn(v.yarn)} if v.yarn else {})}


def _hf_yarn(yarn: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for Megatron's YaRN fields."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": yarn["rotary_scaling_factor"],
            **{k: yarn[k] for k in ("original_max_position_embeddings", "beta_fast",
                                    "beta_slow", "mscale", "mscale_all_dim")}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=["save", "reference"])
    parser.add_argument("which", choices=list(SETS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.step == "save":
        mp.spawn(_save_rank, args=(WORLD_SIZE, _free_port(), str(ns.out), ns.which, ns.dry_run),
                 nprocs=WORLD_SIZE, join=True)
        return
    _setup(ns.dry_run)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    device = "cpu" if ns.dry_run else "cuda"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
                                         rank=0, world_size=1)
    for v in SETS[ns.which]:
        _reference(v, ns.out / v.name, device)
    torch.distributed.destroy_process_group()
    import megatron.core

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "megatron-core": megatron.core.__version__,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"}
    (ns.out / f"versions-{ns.which}.json").write_text(json.dumps(versions, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
