"""Real Megatron-Core ``torch_dist`` checkpoints, written by ``dist_checkpointing.save`` on CPU.

:func:`write_runs` ``(out)`` starts 2 gloo processes that build tiny ``GPTModel`` s
(``transformer_impl="local"``: no Transformer Engine, no apex) and save each as Megatron-LM's
``save_checkpoint`` lays a run out: ``out/<variant>/latest_checkpointed_iteration.txt`` naming
``iter_0000002/``, which ``dist_checkpointing.save`` fills with ``.metadata``, ``__R_N.distcp``,
``common.pt`` (the state that is not sharded: ``args`` as an ``argparse.Namespace``, the
iteration, the checkpoint version) and ``metadata.json`` (written last). The state dict is the
one Megatron-LM's ``generate_state_dict`` builds: ``model`` (the model's sharded state dict),
``rng_state`` (a ``ShardedObject`` per TP/PP rank), ``args``, ``iteration``,
``checkpoint_version``, ``num_floating_point_operations_so_far``. (``megatron.training``,
where that function lives, is not in the megatron-core wheel; the dict is rebuilt here.)

Each variant's reference is written beside it as ``<variant>/reference.pt``: the checkpoint
loaded back by Megatron's own ``dist_checkpointing.load`` into a fresh TP=1 model
(``state_dict``: its own full tensors) and that model's forward pass on fixed ``tokens``
(``logits``, fp32). A Hugging Face ``config.json`` of the family is written beside the run.

:data:`VARIANTS` covers GQA, TP=1 and TP=2, PP=2, tied and untied output layers, a padded
vocabulary (50 tokens padded to 64), QKV bias (``qwen2``), q/k norms with a head size
other than hidden/heads (``qwen3``), MoE at EP=2 (``qwen3_moe``, ``mixtral``) and gpt-oss
(biases in every linear layer, learnable attention sinks, the clamped quick-GELU GLU).

Importing this module does not import megatron; :data:`MEGATRON` says whether it can be.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.fixture_cache import on_disk
from tests.fsdp2_ranks import rank_server
from tests.layouts import _free_port


def _has_megatron() -> bool:
    """Whether megatron-core imports here (``find_spec`` of a submodule imports its parent
    and raises where there is no ``megatron`` at all)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


MEGATRON = _has_megatron()
WORLD_SIZE = 2
ITERATION = 2
VOCAB = 50  # padded to 64 by make_vocab_size_divisible_by 16 (x TP)

TOKENS = [[3, 17, 49, 0, 22, 8, 31, 5]]


@dataclass(frozen=True)
class Variant:
    name: str
    family: str  # the Hugging Face model_type
    tp: int = 1
    pp: int = 1
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    kv_channels: int | None = None  # head size when not hidden / heads
    heads: int = 4
    groups: int = 2
    layers: int = 2
    hidden: int = 32
    ffn: int = 48
    vocab: int = VOCAB
    dtype: str = "float32"
    reference: bool = True  # also write reference.pt (benchmarks do without)
    experts: int = 0  # a mixture of experts in every layer (SequentialMLP), top-2 routing
    moe_ffn: int = 24
    ep: int = 1
    optimizer: bool = False  # also Adam's state after one step (optimizer.*; reference_optim.pt)
    # gpt-oss's: biases in every linear layer (router and experts too), learnable attention
    # sinks (softmax_type "learnable"), the clamped quick-GELU GLU with its +1 offset
    gpt_oss: bool = False


VARIANTS = {v.name: v for v in (
    Variant("llama", "llama"),
    Variant("llama-tp2", "llama", tp=2),
    Variant("llama-pp2", "llama", pp=2, layers=4),
    Variant("llama-tied", "llama", tied=True, groups=4),
    Variant("qwen2-tp2", "qwen2", tp=2, qkv_bias=True),
    Variant("qwen3", "qwen3", qk_norm=True, kv_channels=16, tied=True),
    Variant("qwen3_moe-ep2", "qwen3_moe", qk_norm=True, experts=4, ep=2),
    Variant("mixtral-ep2", "mixtral", experts=4, ep=2, moe_ffn=48),
    Variant("llama-optim", "llama", optimizer=True),
    Variant("gpt_oss-ep2", "gpt_oss", experts=4, ep=2, moe_ffn=48, gpt_oss=True, qkv_bias=True,
            kv_channels=16),
)}


def padded_vocab(tp: int, divisible_by: int = 16, vocab: int = VOCAB) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _args(v: Variant) -> argparse.Namespace:
    """What Megatron-LM's ``args`` hold of this model (the fields converters read), with one
    enum value as real runs have (``attention_backend``)."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=v.layers, hidden_size=v.hidden, ffn_hidden_size=v.ffn,
        num_attention_heads=v.heads, num_query_groups=v.groups, group_query_attention=True,
        kv_channels=v.kv_channels or v.hidden // v.heads, max_position_embeddings=64,
        seq_length=16, padded_vocab_size=padded_vocab(v.tp, vocab=v.vocab),
        make_vocab_size_divisible_by=16,
        tensor_model_parallel_size=v.tp, pipeline_model_parallel_size=v.pp,
        expert_model_parallel_size=v.ep, num_experts=v.experts or None,
        moe_ffn_hidden_size=v.moe_ffn if v.experts else None, moe_router_topk=2,
        moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
        moe_layer_freq=1, multi_latent_attention=False, rotary_percent=1.0,
        use_rope_scaling=False, swiglu=not v.gpt_oss, normalization="RMSNorm",
        layernorm_epsilon=1e-6, untie_embeddings_and_output_weights=not v.tied,
        # --vocab-size is the size before EOD: the NullTokenizer's own size is one more
        vocab_size=v.vocab - 1,
        add_qkv_bias=v.qkv_bias, add_bias_linear=v.gpt_oss, qk_layernorm=v.qk_norm,
        softmax_type="learnable" if v.gpt_oss else "vanilla",
        quick_geglu=v.gpt_oss, activation_func_clamp_value=7.0 if v.gpt_oss else None,
        glu_linear_offset=1.0 if v.gpt_oss else 0.0,
        position_embedding_type="rope", rotary_base=10000, ckpt_format="torch_dist",
        params_dtype=getattr(torch, v.dtype), bf16=v.dtype == "bfloat16", fp16=False,
        iteration=ITERATION,
        transformer_impl="local", attention_backend=AttnBackend.auto,
        tokenizer_type="NullTokenizer", world_size=WORLD_SIZE, data_parallel_size=WORLD_SIZE
        // (v.tp * v.pp), consumed_train_samples=8, use_distributed_optimizer=False)


def _model(v: Variant, tp: int, pp: int, ep: int = 1) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=v.layers, hidden_size=v.hidden, ffn_hidden_size=v.ffn,
        num_attention_heads=v.heads, num_query_groups=v.groups, kv_channels=v.kv_channels,
        use_cpu_initialization=True, gated_linear_unit=True,
        normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=v.gpt_oss,
        add_qkv_bias=v.qkv_bias, qk_layernorm=v.qk_norm, params_dtype=getattr(torch, v.dtype),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=getattr(torch, v.dtype), bf16=v.dtype == "bfloat16",
        transformer_impl="local", persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, attention_dropout=0.0,
        hidden_dropout=0.0, **_moe_config(v, ep), **_gpt_oss_config(v))
    spec = get_gpt_layer_local_spec(num_experts=v.experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=v.qk_norm, normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=padded_vocab(v.tp, vocab=v.vocab),
                     max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=v.tied,
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    return model


def _gpt_oss_config(v: Variant) -> dict[str, Any]:
    """gpt-oss's attention sinks and expert activation (Megatron-Bridge's GPT-OSS settings):
    ``quick_gelu(min(gate, 7)) * (clamp(up, -7, 7) + 1)``, as transformers' GptOssExperts."""
    if not v.gpt_oss:
        import torch.nn.functional as F

        return dict(activation_func=F.silu)
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return dict(softmax_type="learnable", activation_func=quick_gelu,
                activation_func_clamp_value=7.0, glu_linear_offset=1.0,
                bias_activation_fusion=False)


def _moe_config(v: Variant, ep: int) -> dict[str, Any]:
    """Top-2 softmax routing renormalised over the chosen experts (Qwen3-MoE's and Mixtral's),
    the allgather dispatcher (the alltoall one asks for a CUDA stream), no aux loss."""
    if not v.experts:
        return {}
    return dict(num_moe_experts=v.experts, moe_ffn_hidden_size=v.moe_ffn, moe_router_topk=2,
                expert_model_parallel_size=ep, moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False, moe_router_load_balancing_type="none",
                moe_router_score_function="softmax", moe_router_pre_softmax=False)


def _vary_norms_and_biases(model: Any) -> None:
    """Norm weights start at 1 and biases at 0: a map that swapped two norms, or split a bias
    wrongly, would still give the same logits. Each gets values of its own, drawn whole from a
    generator seeded by its name and sliced to this TP rank's part, so any TP writes the same
    model."""
    import zlib

    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and not name.endswith(("bias", "softmax_offset")):
                continue
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            if getattr(p, "tensor_model_parallel", False):
                d = p.partition_dim
                shape = list(p.shape)
                shape[d] *= tp
                value = torch.randn(shape, generator=g).narrow(d, rank * p.shape[d], p.shape[d])
            else:
                value = torch.randn(tuple(p.shape), generator=g)
            p.copy_(value * 0.1 + (1.0 if "norm" in name else 0.0))


def _rng_state() -> Any:
    """Megatron-LM's ``get_rng_state`` (no CUDA generator here), one per TP/PP rank."""
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


def _optimizer_state(model: Any, model_state: dict[str, Any], run: Path) -> dict[str, Any]:
    """Adam's state after one step, as Megatron's non-distributed ``FP32Optimizer`` saves it
    (its ``sharded_state_dict``: megatron-core's own ``get_param_id_to_sharded_param_map`` and
    ``optim_state_to_sharding_state``, each state tensor sharded as its parameter, under
    ``optimizer.state.<exp_avg|exp_avg_sq>.<parameter key>``). ``FP32Optimizer`` itself cannot
    be built on CPU (its ``__init__`` makes a ``device='cuda'`` tensor), nor can the
    distributed optimizer (CUDA buffers). Rank 0 writes each parameter's state by its name
    (``reference_optim.pt``: ``{"exp_avg": {name: tensor}, "exp_avg_sq": ...}``; TP=1, so
    every rank holds all of it)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    adam.step()
    state = adam.state_dict()
    if torch.distributed.get_rank() == 0:
        run.mkdir(parents=True, exist_ok=True)
        names = [n for n, _ in model.named_parameters()]
        torch.save({kind: {n: state["state"][i][kind].clone() for i, n in enumerate(names)}
                    for kind in ("exp_avg", "exp_avg_sq")}, run / "reference_optim.pt")
    for per_param in state["state"].values():
        per_param.pop("step", None)  # FP32Optimizer saves one common step apart
    params = [p for group in adam.param_groups for p in group["params"]]
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_state, params),
                                  exclude_keys="step")
    return state


def _save(v: Variant, run: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=v.tp,
                                 pipeline_model_parallel_size=v.pp,
                                 expert_model_parallel_size=v.ep)
    # use_cpu_initialization: every rank draws the full weights from torch's own generator
    # and keeps its slice, so the same seed gives the same model at any TP.
    torch.manual_seed(1234 + len(v.name))
    model = _model(v, v.tp, v.pp, v.ep)
    _vary_norms_and_biases(model)
    state = {"args": _args(v), "checkpoint_version": 3.0, "iteration": ITERATION,
             "num_floating_point_operations_so_far": 1.5e9,
             "model": model.sharded_state_dict(), "rng_state": _rng_state()}
    if v.optimizer:
        state["optimizer"] = _optimizer_state(model, state["model"], run)
    iter_dir = run / f"iter_{ITERATION:07d}"
    if torch.distributed.get_rank() == 0:
        iter_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, str(iter_dir))
    if torch.distributed.get_rank() == 0:  # Megatron-LM writes the tracker after the save
        (run / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    torch.distributed.barrier()
    ps.destroy_model_parallel()


def _reference(v: Variant, run: Path) -> None:
    """Megatron's own loader into a TP=1, PP=1 model, and its forward pass."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if v.experts:
        # megatron-core 0.16 without Transformer Engine: the router's gating asks
        # ``te_general_gemm is not None`` of a name it only defines when TE imports
        # (NameError); None is what it means there, and selects its plain torch.mm path.
        from megatron.core.transformer.moe import moe_utils

        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    ps.initialize_model_parallel()
    # Megatron's own inference RNG tracker: the forward pass forks no CUDA generator.
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(99)
    model = _model(v, 1, 1)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                     str(run / f"iter_{ITERATION:07d}"))
    model.load_state_dict(loaded["model"])
    model.eval()
    if torch.distributed.get_rank() == 0:
        tokens = torch.tensor(TOKENS)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        n = tokens.shape[1]  # Megatron's mask: True where attention is not allowed
        causal = torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool()
        with torch.no_grad():
            logits = model(tokens, positions, causal)
        full = {k: t.detach().clone() for k, t in model.state_dict().items()
                if isinstance(t, torch.Tensor)}
        torch.save({"state_dict": full, "tokens": tokens, "logits": logits.float()},
                   run / "reference.pt")
    torch.distributed.barrier()
    ps.destroy_model_parallel()


def _rank(rank: int, world_size: int, port: int, out: str, variants: list[Variant]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    # megatron-core's save path (0.16) makes two CUDA calls that are no-ops for CPU tensors:
    # FileSystemWriterAsync.preload_tensors ends in torch.cuda.synchronize() (after copying
    # the tensors to CPU, which they are already), and the async caller's finalisation asks
    # torch.cuda.current_device() for the device of a one-int all-reduce. These two are the
    # only things replaced; every byte written is megatron-core's own.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # Two things about processes, not bytes: the queue that megatron-core's writer hands its
    # results back through is served by a Manager it starts with "spawn" (a fresh interpreter
    # per rank, about 2.7 s here); one started by fork serves it alike. And its fused
    # activations are torch.compile'd (megatron.core.jit), which on a CPU means an inductor
    # build (4.5 s for gpt_oss's reference forward pass); run eagerly they do the same
    # arithmetic, and the logits are compared to transformers' within LOGITS_ATOL anyway.
    import torch._dynamo as dynamo
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
    dynamo.config.disable = True
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    for v in variants:
        run = Path(out) / v.name
        _save(v, run)
        if v.reference:
            _reference(v, run)
    # No destroy_process_group(): it waits about 3 s for gloo here, and the rank ends next
    # (a forked rank leaves by os._exit, after every write has passed the barrier above).


def hf_config(v: Variant) -> dict[str, Any]:
    """The Hugging Face config.json of the variant's model, as its family's config class
    writes it."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
           "mixtral": transformers.MixtralConfig, "gpt_oss": transformers.GptOssConfig
           }[v.family]
    kwargs: dict[str, Any] = dict(
        vocab_size=v.vocab, hidden_size=v.hidden, intermediate_size=v.ffn,
        num_hidden_layers=v.layers, num_attention_heads=v.heads, num_key_value_heads=v.groups,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=v.tied,
        torch_dtype=v.dtype,
        # Megatron's rotary_base (10000); Mixtral's config defaults to 1e6.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if v.family == "llama":
        kwargs.update(attention_bias=False, mlp_bias=False, head_dim=v.hidden // v.heads)
    if v.family in ("qwen3", "qwen3_moe"):
        kwargs.update(head_dim=v.kv_channels or v.hidden // v.heads, attention_bias=False)
    if v.family == "qwen3_moe":
        kwargs.update(num_experts=v.experts, num_experts_per_tok=2, norm_topk_prob=True,
                      moe_intermediate_size=v.moe_ffn, decoder_sparse_step=1,
                      mlp_only_layers=[], router_aux_loss_coef=0.0)
    if v.family == "mixtral":  # experts as wide as intermediate_size
        kwargs.update(num_local_experts=v.experts, num_experts_per_tok=2,
                      intermediate_size=v.moe_ffn, head_dim=v.hidden // v.heads)
    if v.family == "gpt_oss":  # every layer full attention: 8 tokens fit any window
        kwargs.update(num_local_experts=v.experts, num_experts_per_tok=2,
                      intermediate_size=v.moe_ffn, head_dim=v.kv_channels or v.hidden // v.heads,
                      attention_bias=True, swiglu_limit=7.0, router_aux_loss_coef=0.0,
                      layer_types=["full_attention"] * v.layers)
    config = cls(**kwargs)
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                             "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                             "mixtral": "MixtralForCausalLM",
                             "gpt_oss": "GptOssForCausalLM"}[v.family]]
    return dict(config.to_dict())


@on_disk()
def write_runs(out: Path, names: list[str] | None = None, *,
               variants: list[Variant] | None = None) -> Path:
    """Write the runs of ``names`` (default: every variant; or ``variants`` themselves) into
    ``out/<name>/``, each with its ``reference.pt`` and ``config.json`` beside
    ``latest_checkpointed_iteration.txt``."""
    chosen = variants if variants is not None else [VARIANTS[n] for n in names or VARIANTS]
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(WORLD_SIZE, _free_port(), str(out), chosen),
                       nprocs=WORLD_SIZE, join=True, start_method=rank_server())
    for v in chosen:
        (out / v.name / "config.json").write_text(json.dumps(hf_config(v), indent=2))
    return out


if __name__ == "__main__":  # python -m tests.megatron_layouts OUT [VARIANT...]
    import sys

    write_runs(Path(sys.argv[1]), sys.argv[2:] or None)


def hf_reference(run: Path, sd: dict[str, torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
    """What a merge of ``run`` must write, bit for bit: Megatron's own loaded state dict
    (``reference.pt``, a TP=1 model; or ``sd``) rearranged into Hugging Face's names with plain
    torch indexing, written out here apart from ckpttool's tables: q/k/v rows taken per query
    group, ``linear_fc1`` halved into gate and up, the vocabulary padding cut."""
    config = json.loads((run / "config.json").read_text())
    if sd is None:
        sd = torch.load(run / "reference.pt", weights_only=True)["state_dict"]
    if config["model_type"] == "deepseek_v3":
        return deepseek_v3_reference(config, sd)
    vocab, groups = config["vocab_size"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = sd["output_layer.weight"][:vocab]
    for layer in range(config["num_hidden_layers"]):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        for suffix in ("weight", "bias"):
            qkv = sd.get(f"{m}self_attention.linear_qkv.{suffix}")
            if qkv is None:
                continue
            grouped = qkv.reshape(groups, -1, head_dim, *qkv.shape[1:])
            rest = qkv.shape[1:]
            out[f"{h}self_attn.q_proj.{suffix}"] = grouped[:, :-2].reshape(-1, *rest)
            out[f"{h}self_attn.k_proj.{suffix}"] = grouped[:, -2].reshape(-1, *rest)
            out[f"{h}self_attn.v_proj.{suffix}"] = grouped[:, -1].reshape(-1, *rest)
        out.update({
            f"{h}input_layernorm.weight": sd[f"{m}input_layernorm.weight"],
            f"{h}self_attn.o_proj.weight": sd[f"{m}self_attention.linear_proj.weight"],
            f"{h}post_attention_layernorm.weight": sd[f"{m}pre_mlp_layernorm.weight"]})
        experts = config.get("num_experts") or config.get("num_local_experts")
        if config["model_type"] == "gpt_oss":
            out.update(_gpt_oss_layer(sd, m, h, experts))
        elif not experts:
            gate, up = sd[f"{m}mlp.linear_fc1.weight"].chunk(2)
            out.update({f"{h}mlp.gate_proj.weight": gate, f"{h}mlp.up_proj.weight": up,
                        f"{h}mlp.down_proj.weight": sd[f"{m}mlp.linear_fc2.weight"]})
        else:
            mixtral = config["model_type"] == "mixtral"
            block = "block_sparse_moe" if mixtral else "mlp"
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            out[f"{h}{block}.gate.weight"] = sd[f"{m}mlp.router.weight"]
            for e in range(experts):
                x = f"{m}mlp.experts.local_experts.{e}."
                gate, up = sd[f"{x}linear_fc1.weight"].chunk(2)
                out.update({f"{h}{block}.experts.{e}.{names[0]}.weight": gate,
                            f"{h}{block}.experts.{e}.{names[1]}.weight": up,
                            f"{h}{block}.experts.{e}.{names[2]}.weight":
                                sd[f"{x}linear_fc2.weight"]})
        for norm in ("q", "k"):
            value = sd.get(f"{m}self_attention.{norm}_layernorm.weight")
            if value is not None:
                out[f"{h}self_attn.{norm}_norm.weight"] = value
    return {k: v.contiguous() for k, v in out.items()}


def deepseek_v3_reference(config: dict[str, Any], sd: dict[str, torch.Tensor]
                          ) -> dict[str, torch.Tensor]:
    """What a merge of a DeepSeek-V3 run must write, bit for bit: Megatron's own loaded
    state dict ``sd`` rearranged into transformers' DeepseekV3 names for ``config`` with plain
    torch, apart from ckpttool's tables: MLA's projections and norms renamed, dense and
    shared-expert ``linear_fc1`` halved into gate and up, each expert's likewise, the expert
    bias as the gate's ``e_score_correction_bias`` (where ``sd`` has it: an optimizer holds no
    state for a buffer), the vocabulary padding cut. Each multi-token prediction layer ``k``
    as DeepSeek-V3's checkpoints hold it: ``model.layers.{num_hidden_layers + k}``, its
    ``enorm``/``hnorm``/``eh_proj``, ``final_layernorm`` as ``shared_head.norm``, its
    ``transformer_layer`` as a decoder layer, and copies of the model's embedding and output
    layer as its ``embed_tokens`` and ``shared_head.head``."""
    vocab = config["vocab_size"]
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": sd["decoder.final_layernorm.weight"],
           "lm_head.weight": sd["output_layer.weight"][:vocab]}

    def gate_up(prefix: str, fc1: torch.Tensor) -> None:
        gate, up = fc1.chunk(2)
        out[f"{prefix}gate_proj.weight"], out[f"{prefix}up_proj.weight"] = gate, up

    num_layers = config["num_hidden_layers"]
    mtp = config.get("num_nextn_predict_layers", 0)
    for layer in range(num_layers + mtp):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        if layer >= num_layers:
            k = layer - num_layers
            # megatron-core 0.19's module is mtp_model_layer (its checkpoint keeps the name
            # transformer_layer); 0.16's transformer_layer
            p = f"mtp.layers.{k}."
            m = next(f"{p}{n}." for n in ("mtp_model_layer", "transformer_layer")
                     if f"{p}{n}.input_layernorm.weight" in sd or n == "transformer_layer")
            for name in ("enorm", "hnorm", "eh_proj"):
                out[f"{h}{name}.weight"] = sd[f"{p}{name}.weight"]
            out[f"{h}shared_head.norm.weight"] = sd[f"{p}final_layernorm.weight"]
            out[f"{h}embed_tokens.weight"] = out["model.embed_tokens.weight"]
            out[f"{h}shared_head.head.weight"] = out["lm_head.weight"]
        a, s = f"{m}self_attention.", f"{h}self_attn."
        out[f"{h}input_layernorm.weight"] = sd[f"{m}input_layernorm.weight"]
        out[f"{h}post_attention_layernorm.weight"] = sd[f"{m}pre_mlp_layernorm.weight"]
        if config["q_lora_rank"] is None:
            out[f"{s}q_proj.weight"] = sd[f"{a}linear_q_proj.weight"]
        else:
            out[f"{s}q_a_proj.weight"] = sd[f"{a}linear_q_down_proj.weight"]
            out[f"{s}q_a_layernorm.weight"] = sd[f"{a}q_layernorm.weight"]
            out[f"{s}q_b_proj.weight"] = sd[f"{a}linear_q_up_proj.weight"]
        out[f"{s}kv_a_proj_with_mqa.weight"] = sd[f"{a}linear_kv_down_proj.weight"]
        out[f"{s}kv_a_layernorm.weight"] = sd[f"{a}kv_layernorm.weight"]
        out[f"{s}kv_b_proj.weight"] = sd[f"{a}linear_kv_up_proj.weight"]
        out[f"{s}o_proj.weight"] = sd[f"{a}linear_proj.weight"]
        if layer < config["first_k_dense_replace"]:
            gate_up(f"{h}mlp.", sd[f"{m}mlp.linear_fc1.weight"])
            out[f"{h}mlp.down_proj.weight"] = sd[f"{m}mlp.linear_fc2.weight"]
            continue
        out[f"{h}mlp.gate.weight"] = sd[f"{m}mlp.router.weight"]
        if f"{m}mlp.router.expert_bias" in sd:
            out[f"{h}mlp.gate.e_score_correction_bias"] = sd[f"{m}mlp.router.expert_bias"]
        for e in range(config["n_routed_experts"]):
            x = f"{m}mlp.experts.local_experts.{e}."
            gate_up(f"{h}mlp.experts.{e}.", sd[f"{x}linear_fc1.weight"])
            out[f"{h}mlp.experts.{e}.down_proj.weight"] = sd[f"{x}linear_fc2.weight"]
        gate_up(f"{h}mlp.shared_experts.", sd[f"{m}mlp.shared_experts.linear_fc1.weight"])
        out[f"{h}mlp.shared_experts.down_proj.weight"] = sd[
            f"{m}mlp.shared_experts.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def mtp_logits(out: Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The logits of each DeepSeek-V3 multi-token prediction layer of the merged model in
    ``out``, computed by hand from its tensors under their Hugging Face names (transformers'
    own decoder layer and RMSNorm; transformers runs no MTP layer itself). Layer ``k`` is
    ``eh_proj([enorm(embed(tokens shifted k + 1)); hnorm(h)])``, then its decoder layer,
    then ``shared_head``, where ``h`` is the main model's last hidden state (after its final
    norm) for ``k = 0`` and layer ``k - 1``'s output after its ``shared_head.norm`` after
    that, as Megatron chains them; Megatron's shifted input ends in token 0, as here."""
    import transformers
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    config = model.config
    n = config.num_hidden_layers
    merged: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        merged.update(load_file(f))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    mask = torch.full((tokens.shape[1],) * 2, float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        hidden = model.model(tokens).last_hidden_state  # after the final norm, as Megatron's
    shifted = tokens
    found: list[torch.Tensor] = []
    for k in range(config.num_nextn_predict_layers):
        prefix = f"model.layers.{n + k}."
        weights = {key[len(prefix):]: v for key, v in merged.items() if key.startswith(prefix)}
        layer = ds.DeepseekV3DecoderLayer(config, layer_idx=n + k).eval()
        experts = range(config.n_routed_experts)  # transformers 5 holds them grouped
        expert = "mlp.experts.{}.{}_proj.weight".format
        grouped = {"mlp.experts.gate_up_proj": torch.stack([torch.cat(
                       [weights[expert(e, "gate")], weights[expert(e, "up")]])
                       for e in experts]),
                   "mlp.experts.down_proj": torch.stack([weights[expert(e, "down")]
                                                         for e in experts])}
        layer.load_state_dict({**grouped, **{
            key: v for key, v in weights.items() if key.split(".")[0] in (
                "self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
            and not key.startswith("mlp.experts.")}})

        def norm(name: str, weights: dict[str, torch.Tensor] = weights) -> Any:
            module = ds.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            module.weight.data.copy_(weights[f"{name}.weight"])
            return module

        shifted = torch.cat([shifted[:, 1:], torch.zeros_like(shifted[:, :1])], dim=1)
        with torch.no_grad():
            embedded = torch.nn.functional.embedding(shifted, weights["embed_tokens.weight"])
            x = torch.cat([norm("enorm")(embedded), norm("hnorm")(hidden)], dim=-1)
            x = x @ weights["eh_proj.weight"].T
            x = layer(x, attention_mask=mask, position_ids=positions,
                      position_embeddings=model.model.rotary_emb(x, positions))
            x = x[0] if isinstance(x, tuple) else x
            hidden = norm("shared_head.norm")(x)
            found.append(hidden @ weights["shared_head.head.weight"].T)
    return found


def _gpt_oss_layer(sd: dict[str, torch.Tensor], m: str, h: str, experts: int
                   ) -> dict[str, torch.Tensor]:
    """transformers' GptOss tensors of one layer: the sinks, o_proj's bias, the biased router,
    and the experts stacked as its grouped tensors, fc1's gate and up rows interleaved (its
    forward reads ``[..., ::2]`` as gate, ``[..., 1::2]`` as up), weights transposed."""
    x = [f"{m}mlp.experts.local_experts.{e}." for e in range(experts)]
    fc1 = torch.stack([sd[f"{p}linear_fc1.weight"] for p in x])  # [E, 2F, H]: [gate; up]
    b1 = torch.stack([sd[f"{p}linear_fc1.bias"] for p in x])
    gate, up = fc1.chunk(2, dim=1)
    b_gate, b_up = b1.chunk(2, dim=1)
    return {
        f"{h}self_attn.sinks": sd[f"{m}self_attention.core_attention.softmax_offset"],
        f"{h}self_attn.o_proj.bias": sd[f"{m}self_attention.linear_proj.bias"],
        f"{h}mlp.router.weight": sd[f"{m}mlp.router.weight"],
        f"{h}mlp.router.bias": sd[f"{m}mlp.router.bias"],
        f"{h}mlp.experts.gate_up_proj":
            torch.stack([gate, up], dim=2).reshape(fc1.shape).transpose(1, 2),
        f"{h}mlp.experts.gate_up_proj_bias": torch.stack([b_gate, b_up], dim=2).reshape(b1.shape),
        f"{h}mlp.experts.down_proj":
            torch.stack([sd[f"{p}linear_fc2.weight"] for p in x]).transpose(1, 2),
        f"{h}mlp.experts.down_proj_bias": torch.stack([sd[f"{p}linear_fc2.bias"] for p in x]),
    }


def native_reference(run: Path, sd: dict[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
    """The global tensors a torch_dist checkpoint of ``run`` holds, under Megatron's stored
    names (what a merge with ``--names none`` writes): Megatron's own loaded state dict
    (``reference.pt``; or ``sd``, tensors by parameter name) with each layer's tensors
    stacked on a new first axis, the norms under the names the local spec saves them as
    (Transformer Engine's fused ones)."""
    if sd is None:
        sd = torch.load(run / "reference.pt", weights_only=True)["state_dict"]
    saved_as = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, list[torch.Tensor]] = {}
    experts: dict[str, list[torch.Tensor]] = {}
    for name, value in sd.items():
        if not name.startswith("decoder.layers."):
            out[name] = value
            continue
        rest = name.split(".", 3)[3]
        if rest.startswith("mlp.experts.local_experts."):  # [L, E, ...]: experts stacked too
            key = "mlp.experts.experts." + rest.split(".", 4)[4]
            experts.setdefault(f"{name.split('.')[2]}.{key}", []).append(value)
            continue
        layers.setdefault(f"decoder.layers.{saved_as.get(rest, rest)}", []).append(value)
    for key, values in experts.items():
        layers.setdefault(f"decoder.layers.{key.split('.', 1)[1]}", []).append(
            torch.stack(values))
    out.update({k: torch.stack(v) for k, v in layers.items()})
    return out
