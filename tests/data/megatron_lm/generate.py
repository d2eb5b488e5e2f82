"""Writes the runs in this folder with Megatron-LM's own training code, on the CPU.

Each run is what a user of Megatron-LM gets: ``megatron.training``'s ``initialize_megatron``
(``parse_args`` + ``validate_args`` on a real command line), ``setup_model_and_optimizer``
with ``pretrain_gpt.py``'s ``model_provider`` (``gpt_builders.gpt_builder``), one optimizer
step, then ``checkpointing.save_checkpoint`` (``--ckpt-format torch_dist``, the fully parallel
save wrapper on as by default). Megatron-LM is not a wheel: point ``--mlm`` at a checkout of
the tag matching the installed megatron-core (``core_v0.16.1`` for megatron-core 0.16.1:
``git archive core_v0.16.1 megatron/training megatron/legacy pretrain_gpt.py gpt_builders.py
model_provider.py``).

CPU stand-ins, in this script only (and the MoE runs use the allgather token dispatcher:
the alltoall one asks for a CUDA stream): every ``device='cuda'`` a tensor is made with is the CPU
(a ``TorchFunctionMode``), ``Module.cuda``/``Tensor.cuda`` keep the CPU, and the
``torch.cuda`` calls of the path (streams, ``synchronize``, ``current_device``,
``device_count``, ``set_device``, the RNG state) answer for the CPU. No byte Megatron writes
is changed. The optimizer step takes gradients drawn from a generator seeded by each
parameter's name, written into DDP's ``main_grad`` on every data-parallel rank alike (so the
gradient reduction, which gloo cannot do as NCCL's reduce-scatter, changes nothing), then
``optimizer.step()``.

The oracle beside each run (``reference``): one process loads the run with Megatron-LM's own
``load_checkpoint`` at TP=PP=EP=1 (``--no-load-optim --no-load-rng``) and writes
``reference.safetensors`` (that model's full state dict, Megatron's names) and
``logits.safetensors`` (``tokens``, which include the EOD id, and the fp32 logits of the
model's forward pass on them).

    python tests/data/megatron_lm/generate.py --mlm /work/megatron-lm-0.16 OUT [RUN...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import types
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

VOCAB = 500  # NullTokenizer: 501 tokens with EOD (id 500), padded to 512
TOKENS = [[3, 17, 499, 500, 22, 8, 31, 500, 5, 250]]

COMMON = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
          "--group-query-attention --num-query-groups 2 --seq-length 16 "
          "--max-position-embeddings 64 --micro-batch-size 1 "
          f"--tokenizer-type NullTokenizer --vocab-size {VOCAB} "
          "--position-embedding-type rope --rotary-base 10000 --normalization RMSNorm "
          "--norm-epsilon 1e-6 --swiglu --disable-bias-linear --attention-dropout 0 "
          "--hidden-dropout 0 --init-method-std 0.02 --transformer-impl local "
          "--no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
          "--no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion "
          "--lr 1e-3 --clip-grad 0 --train-iters 10 --ckpt-format torch_dist "
          "--distributed-backend gloo "
          "--use-cpu-initialization --seed 1234 --log-interval 1")
UNTIED = "--untie-embeddings-and-output-weights"
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
       "--moe-token-dispatcher-type allgather --moe-router-load-balancing-type none "
       "--moe-aux-loss-coeff 0")
DISTOPT = "--use-distributed-optimizer"
FULL = "--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable"
RELEASE = "--no-save-optim --no-save-rng"
# gpt-oss's: biases in every linear layer (the router's too), learnable attention sinks, the
# clamped quick-GELU GLU with its +1 offset, top-2 softmax routing over 4 experts. (Its
# alternate sliding-window layers are left out: 10 tokens fit any window.)
GPT_OSS = ("--add-qkv-bias --softmax-type learnable --quick-geglu "
           "--activation-func-clamp-value 7.0 --glu-linear-offset 1.0 --no-bias-gelu-fusion "
           "--kv-channels 16 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
           "--moe-token-dispatcher-type allgather --moe-router-load-balancing-type none "
           "--moe-aux-loss-coeff 0")
# DeepSeek-V3's: multi-latent attention with q and kv LoRA ranks and its q/kv latent norms, a
# dense first layer then experts with a shared expert, sigmoid routing over groups with the
# expert bias, YaRN as DeepSeek-V3's config has it (its original 4096 positions and betas 32/1
# are MLATransformerConfig's defaults: no flag sets them), one multi-token prediction layer.
MLA = ("--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
       "--qk-pos-emb-head-dim 8 --v-head-dim 24 --kv-channels 24 --qk-layernorm --rope-type yarn "
       "--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 "
       "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
       "--moe-shared-expert-intermediate-size 32 --moe-layer-freq [0,1] "
       "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
       "--moe-router-num-groups 2 --moe-router-group-topk 1 "
       "--moe-router-topk-scaling-factor 2.5 --moe-token-dispatcher-type allgather "
       "--moe-router-load-balancing-type none --moe-aux-loss-coeff 0 --mtp-num-layers 1")

# name: (family, world size, extra flags)
RUNS: dict[str, tuple[str, int, str]] = {
    "llama-dp2-dist": ("llama", 2, f"{UNTIED} {DISTOPT}"),
    "llama-dp2-full": ("llama", 2, f"{UNTIED} {FULL}"),
    "llama-tp2": ("llama", 2, f"{UNTIED} --tensor-model-parallel-size 2 {DISTOPT}"),
    "llama-pp2": ("llama", 2, f"{UNTIED} --pipeline-model-parallel-size 2 {RELEASE}"),
    "llama-release": ("llama", 1, f"{UNTIED} {RELEASE}"),
    "qwen2-tp2": ("qwen2", 2, f"{UNTIED} --add-qkv-bias --tensor-model-parallel-size 2 "
                              f"{RELEASE}"),
    "qwen3-dp2-full": ("qwen3", 2, f"--qk-layernorm --kv-channels 32 {FULL}"),
    "qwen3_moe-ep2": ("qwen3_moe", 2, f"{UNTIED} --qk-layernorm {MOE} "
                                      f"--expert-model-parallel-size 2 {DISTOPT}"),
    "mixtral-ep2": ("mixtral", 2, f"{UNTIED} {MOE} --expert-model-parallel-size 2 {RELEASE}"),
    "llama-tp2pp2": ("llama", 4, f"{UNTIED} --tensor-model-parallel-size 2 "
                                 f"--pipeline-model-parallel-size 2 {DISTOPT}"),
    "llama-vpp": ("llama", 2, f"{UNTIED} --num-layers 4 --pipeline-model-parallel-size 2 "
                              f"--num-layers-per-virtual-pipeline-stage 1 {DISTOPT}"),
    "llama-buckets": ("llama", 2, f"{UNTIED} {DISTOPT} --overlap-grad-reduce "
                                  "--ddp-bucket-size 20000"),
    "qwen3-pp2-tied": ("qwen3", 2, f"--qk-layernorm --kv-channels 32 "
                                   f"--pipeline-model-parallel-size 2 {DISTOPT}"),
    # expert TP without dense TP (dense TP with MoE needs --sequence-parallel, which the
    # local spec's torch norms refuse)
    "qwen3_moe-etp2": ("qwen3_moe", 2, f"{UNTIED} --qk-layernorm {MOE} "
                                       f"--expert-tensor-parallel-size 2 {DISTOPT}"),
    "deepseek_v3-ep2": ("deepseek_v3", 2, f"{UNTIED} {MLA} --expert-model-parallel-size 2 "
                                          f"{FULL}"),
    "gpt_oss-ep2": ("gpt_oss", 2, f"{UNTIED} {GPT_OSS} --expert-model-parallel-size 2 "
                                  f"{DISTOPT}"),
}
# The flags of COMMON a family does without: multi-latent attention has no query groups
# (validate_args refuses both); gpt-oss has biases and no SwiGLU.
WITHOUT = {"deepseek_v3": ("--group-query-attention", "--num-query-groups"),
           "gpt_oss": ("--swiglu", "--disable-bias-linear", "--no-bias-swiglu-fusion")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _CpuForCuda(torch.overrides.TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # the optimizers check for 'torch.cuda.FloatTensor' (etc.)
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to,):
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _Stream:
    def wait_stream(self, *_: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *_: Any) -> None:
        return None


def _stand_ins() -> None:
    cuda = torch.cuda
    cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    cuda.device_count = lambda: 1  # type: ignore[assignment]
    cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    cuda.Stream = lambda *a, **k: _Stream()  # type: ignore[assignment,misc]
    cuda.current_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.empty_cache = lambda: None  # type: ignore[assignment]
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    cuda.set_rng_state = lambda *a, **k: None  # type: ignore[assignment]
    cuda.manual_seed = lambda *a, **k: None  # type: ignore[assignment]
    cuda.memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.max_memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    # validate_args asks the device architecture at TP > 1 (a Hopper's, 9, as a GPU run's)
    cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(  # type: ignore
        major=9, minor=0, name="cpu", total_memory=0, multi_processor_count=1)
    cuda.get_device_capability = lambda *a, **k: (9, 0)  # type: ignore[assignment]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.overrides.TorchFunctionMode.__enter__(_CpuForCuda())


def _grads(model: list[Any]) -> None:
    """A gradient for every parameter, drawn whole by its global name and shape and cut to
    this rank's part (any TP, the same model gradient)."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for chunk in model:
        for name, p in chunk.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            shape = list(p.shape)
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                d = p.partition_dim
                shape[d] *= tp
                value = torch.randn(shape, generator=g).narrow(d, rank * p.shape[d], p.shape[d])
            else:
                value = torch.randn(shape, generator=g)
            p.main_grad.copy_(value.to(p.main_grad.dtype))


def _vary_norms(model: list[Any]) -> None:
    """Norm weights start at 1 and biases at 0: a map that swapped two norms would give the
    same logits. Each gets values of its own, the same at any TP."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in model:
            for name, p in chunk.named_parameters():
                if "norm" not in name and not name.endswith(("bias", "softmax_offset")):
                    continue
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1)
                shape = list(p.shape)
                if getattr(p, "tensor_model_parallel", False) and tp > 1:
                    d = p.partition_dim
                    shape[d] *= tp
                    value = torch.randn(shape, generator=g).narrow(
                        d, rank * p.shape[d], p.shape[d])
                else:
                    value = torch.randn(shape, generator=g)
                p.copy_(value * 0.1 + (1.0 if "norm" in name else 0.0))
            # the router's expert bias (a buffer, zero at the start; the update from token
            # counts is not run here): one of its own, which moves the top-k choice
            for name, b in chunk.named_buffers():
                if name.endswith("router.expert_bias"):
                    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1)
                    b.copy_(torch.randn(tuple(b.shape), generator=g) * 0.1)


def _argv(name: str, run: Path, *, reference: bool) -> list[str]:
    family, world, extra = RUNS[name]
    flags = f"{COMMON} {extra}".split()
    drop = WITHOUT.get(family, ())
    flags = [f for i, f in enumerate(flags) if f not in drop and not (
        i and flags[i - 1] in drop and not f.startswith("--"))]  # a dropped flag's value too
    if reference:  # TP=PP=EP=1, the model only
        drop = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                "--expert-model-parallel-size", "--expert-tensor-parallel-size",
                "--num-layers-per-virtual-pipeline-stage"}
        kept: list[str] = []
        skip = False
        for f in flags:
            if skip:
                skip = False
                continue
            if f in drop:
                skip = True
                continue
            if f != "--sequence-parallel":
                kept.append(f)
        flags = kept + ["--load", str(run), "--no-load-optim", "--no-load-rng",
                        "--skip-train", "--exit-on-missing-checkpoint"]
    else:
        flags += ["--save", str(run), "--save-interval", "1"]
    mbs_dp = world if not reference else 1
    return ["pretrain_gpt.py", *flags, "--global-batch-size", str(mbs_dp)]


def _rank(rank: int, world: int, port: int, name: str, out: str, mlm: str,
          reference: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      CUDA_DEVICE_MAX_CONNECTIONS="1")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    sys.path.insert(0, mlm)
    _stand_ins()
    run = Path(out) / name
    sys.argv = _argv(name, run, reference=reference)
    import megatron.training.initialize as init
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import (
        preprocess_common_state_dict,
        setup_model_and_optimizer,
    )

    if "--multi-latent-attention" in sys.argv:
        _mla_core_attention()
    # The dataset index helpers (a C++ build) and fused kernels: no data is read here.
    init._compile_dependencies = lambda: None
    initialize_megatron(allow_no_cuda=True)
    from megatron.core.transformer.moe import moe_utils, router

    # megatron-core 0.16 without Transformer Engine: the router's gating asks
    # ``te_general_gemm is not None`` of a name defined only where TE imports; None selects
    # its torch path.
    for module in (router, moe_utils):
        if not hasattr(module, "te_general_gemm"):
            module.te_general_gemm = None
    args = get_args()
    model, optimizer, scheduler = setup_model_and_optimizer(_provider(),
                                                            ModelType.encoder_or_decoder)
    if reference:
        _oracle(model, run)
        return
    _vary_norms(model)
    for chunk in model:
        chunk.zero_grad_buffer()
    _grads(model)
    optimizer.step()
    scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples = args.global_batch_size
    save_checkpoint(1, model, optimizer, scheduler, 1.5e9,
                    preprocess_common_state_dict_fn=preprocess_common_state_dict)
    torch.distributed.barrier()


def _mla_core_attention() -> None:
    """megatron-core 0.16.1's local spec cannot build multi-latent attention: its core
    attention is therefore the stand-in of :mod:`mla_local` (beside this file), which takes
    what ``MLASelfAttention`` passes it and computes as the local class does."""
    from megatron.core.models.backends import LocalSpecProvider
    from mla_local import local_core_attention

    attention = local_core_attention()
    LocalSpecProvider.core_attention = lambda self: attention  # type: ignore
    # Without Transformer Engine, megatron-core 0.16.1's extension module still imports (its
    # TE classes None), so multi_latent_attention.HAVE_TE is True and isinstance(x, None)
    # raises: set it to what is true here.
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def _provider() -> Any:
    """What ``pretrain_gpt.py`` passes to ``pretrain``."""
    from functools import partial

    from gpt_builders import gpt_builder
    from model_provider import model_provider

    return partial(model_provider, gpt_builder)


def _oracle(model: list[Any], run: Path) -> None:
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from safetensors.torch import save_file

    # The forward pass forks no CUDA generator (dropout is 0): Megatron's inference tracker.
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Megatron's jit_fuser is torch.compile (gpt-oss's quick_gelu): inductor asks the CUDA
    # device's properties, which the stand-ins cannot give; run it eagerly, as transformers.
    torch._dynamo.config.disable = True
    (m,) = model
    while hasattr(m, "module"):
        m = m.module
    m.eval()
    tokens = torch.tensor(TOKENS)
    n = tokens.shape[1]
    positions = torch.arange(n).unsqueeze(0)
    causal = torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool()
    extra: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if getattr(m, "mtp_process", False):
            # With MTP, GPTModel.forward needs labels and returns the loss; its MTP block
            # returns the main and the MTP hidden states (after their final norms)
            # concatenated on the sequence axis: a hook keeps them, and the output layer
            # gives both logits (MTP layer k at position i predicts token i + 2 + k).
            seen: list[torch.Tensor] = []
            hook = m.mtp.register_forward_hook(lambda _m, _a, out: seen.append(out))
            m(tokens, positions, causal, labels=tokens)
            hook.remove()
            main, *mtp = torch.chunk(seen[0], 1 + len(m.mtp.layers), dim=0)
            logits = m.output_layer(main)[0].transpose(0, 1)
            for k, h in enumerate(mtp):
                extra[f"mtp_logits.{k}"] = m.output_layer(h)[0].transpose(0, 1).float()
        else:
            logits = m(tokens, positions, causal)
    sd = {k: t.detach().clone().contiguous() for k, t in m.state_dict().items()
          if isinstance(t, torch.Tensor) and not k.endswith("_extra_state")}
    save_file(sd, str(run / "reference.safetensors"))
    save_file({"tokens": tokens, "logits": logits.float().contiguous(),
               **{k: t.contiguous() for k, t in extra.items()}},
              str(run / "logits.safetensors"))


def hf_config(name: str) -> dict[str, Any]:
    """The Hugging Face config.json of the run's model, as its family's config class writes
    it (``hf_config.json``): the NullTokenizer's 501 tokens, EOD included."""
    import transformers

    family, _, extra = RUNS[name]
    flags = extra.split()
    if family == "deepseek_v3":
        return _deepseek_v3_config()
    if family == "gpt_oss":
        return _gpt_oss_config()
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
           "mixtral": transformers.MixtralConfig}[family]
    head_dim = 32 if "--kv-channels" in flags else 16
    layers = int(flags[flags.index("--num-layers") + 1]) if "--num-layers" in flags else 2
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=UNTIED not in flags,
        rope_theta=10000.0, torch_dtype="float32")
    if family in ("llama", "qwen3", "qwen3_moe"):
        kwargs.update(attention_bias=False)
    if family == "llama":
        kwargs.update(mlp_bias=False)
    if family == "qwen3_moe":
        kwargs.update(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                      router_aux_loss_coef=0.0)
    if family == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
    config = cls(**kwargs)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return dict(config.to_dict())


def _deepseek_v3_config() -> dict[str, Any]:
    """DeepseekV3Config for the MLA flags above (YaRN as DeepSeek-V3's own config.json has it;
    the MTP layer as DeepSeek-V3's checkpoints count it, ``num_nextn_predict_layers``)."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB + 1, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=24, qk_nope_head_dim=16, head_dim=8,
        n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0,
        rope_interleave=True, torch_dtype="float32",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    config.num_nextn_predict_layers = 1
    config.architectures = ["DeepseekV3ForCausalLM"]
    return dict(config.to_dict())


def _gpt_oss_config() -> dict[str, Any]:
    """GptOssConfig for the gpt-oss flags above: every layer full attention (10 tokens fit
    any window), RoPE over whole heads at Megatron's rotary base."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=VOCAB + 1, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=True, swiglu_limit=7.0,
        router_aux_loss_coef=0.0, layer_types=["full_attention"] * 2, torch_dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config.architectures = ["GptOssForCausalLM"]
    return dict(config.to_dict())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mlm", required=True, help="a Megatron-LM checkout of the tag")
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="*")
    parser.add_argument("--reference-only", action="store_true")
    parser.add_argument("--configs-only", action="store_true")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    for name in ns.runs or RUNS:
        world = RUNS[name][1]
        try:
            for reference in () if ns.configs_only else (False, True) \
                    if not ns.reference_only else (True,):
                n = 1 if reference else world
                mp.start_processes(_rank, args=(n, _free_port(), name, str(ns.out), ns.mlm,
                                                reference), nprocs=n, join=True,
                                   start_method="spawn")
        except mp.ProcessRaisedException as e:  # the next run is worth writing still
            print(f"{name}: failed: {e}", file=sys.stderr)
            continue
        import megatron.core

        versions = {"megatron_core": megatron.core.__version__, "torch": torch.__version__,
                    "python": sys.version.split()[0], "family": RUNS[name][0],
                    "command": " ".join(_argv(name, Path("RUN"), reference=False)[1:])}
        (ns.out / name / "hf_config.json").write_text(json.dumps(hf_config(name), indent=1)
                                                      + "\n")
        (ns.out / name / "written_by.json").write_text(json.dumps(versions, indent=1) + "\n")


if __name__ == "__main__":
    main()
