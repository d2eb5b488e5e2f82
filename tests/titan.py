"""Tiny torchtitan models, built by torchtitan 0.3's own classes, saved as torchtitan saves
them, and the Hugging Face configs that describe them.

    step_dir = write(tmp / "llama3", "llama3")          # <out>/checkpoint/step-1 (DCP)
    reference = torch.load(tmp / "llama3" / REFERENCE)   # the full state dict, torchtitan names

``write`` runs 2 gloo ranks: each builds the same seeded model, shards it with FSDP2
(``fully_shard``) and saves it with torchtitan's ``CheckpointManager`` as its last step
with ``last_save_model_only`` (the model part only, flat torchtitan names, fused ``wqkv``
split by torchtitan's own state-dict hook). ``how="parameters"`` instead saves the model's
parameters themselves with ``dcp.save`` (the fused ``wqkv`` as one tensor), and
``expert_bias=True`` gives the MoE routers a trained-looking (non-zero) load-balancing bias.

The small configs are made with torchtitan's own per-family layer builders (private helpers
of ``torchtitan.models.llama3`` / ``qwen3``: the public registry has no model small enough).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.fixture_cache import on_disk
from tests.fsdp2_ranks import run_on_ranks

FAMILIES = ("llama3", "qwen3", "qwen3-moe")
# MoE families whose Hugging Face models torchtitan's own forward is not compared with (gpt-oss'
# attention sinks and sliding windows, DeepSeek-V3's latent attention): checked against
# torchtitan's to_hf and transformers' own names and shapes.
MORE_FAMILIES = ("deepseek-v3", "gpt-oss")
NAME_MAP = {"llama3": "torchtitan-llama3", "qwen3": "torchtitan-qwen3",
            "qwen3-moe": "torchtitan-qwen3", "deepseek-v3": "torchtitan-deepseek-v3",
            "gpt-oss": "torchtitan-gpt-oss"}
REFERENCE = "reference.pt"
STEP_DIR = "checkpoint/step-1"
SEED = 1234
VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN = 128, 64, 2, 4, 2, 96
QWEN_HEAD_DIM, EXPERTS, TOP_K, MOE_FFN = 32, 4, 2, 48
# DeepSeek-V3's latent attention: kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
KV_LORA, QK_NOPE, QK_ROPE, V_HEAD = 16, 8, 4, 8
# gpt-oss: torchtitan's attention (64 heads of 64, 8 KV heads) with a tiny expert width
GPT_OSS_HEADS, GPT_OSS_KV_HEADS, GPT_OSS_HEAD_DIM, GPT_OSS_FFN = 64, 8, 64, 24
MAX_SEQ = 64


def model_config(family: str) -> Any:
    """torchtitan's model config for the tiny model of ``family``, with SDPA (causal) as its
    inner attention: for one document the same as the flex attention torchtitan trains with,
    without compiling flex attention for the CPU (tens of seconds)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = _model_config(family)
    if family in MORE_FAMILIES:  # never run forward here: keep their own attention
        return config
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _model_config(family: str) -> Any:
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    if family == "deepseek-v3":
        from torchtitan.models import deepseek_v3 as ds

        layers = ds._build_dsv3_layers(
            n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0,
            kv_lora_rank=KV_LORA, qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=QK_ROPE,
            v_head_dim=V_HEAD, mscale=0.7, dense_hidden_dim=FFN, moe_hidden_dim=MOE_FFN,
            num_experts=EXPERTS, num_shared_experts=1, router_top_k=TOP_K,
            router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=QK_ROPE, max_seq_len=MAX_SEQ, theta=10000.0))
        return ds.DeepSeekV3Model.Config(
            vocab_size=VOCAB, dim=DIM,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                            param_init=ds._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init=ds._NORM_INIT),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                                  param_init=ds._output_linear_init(DIM)),
            layers=layers, mtp_layers=[])
    if family == "gpt-oss":
        from torchtitan.models import gpt_oss as go

        return go.GptOssModel.Config(
            vocab_size=VOCAB, dim=DIM,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                            param_init=go._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init=go._NORM_INIT),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                                  param_init=go._output_linear_init(DIM)),
            layers=go._build_gptoss_layers(
                fuse_qkv=True, dim=DIM, n_layers=LAYERS, hidden_dim=GPT_OSS_FFN,
                num_experts=EXPERTS, top_k=TOP_K, load_balance_coeff=1e-3,
                attn_backend="flex", moe_comm_backend="standard",
                rope=CosSinRoPE.Config(dim=GPT_OSS_HEAD_DIM, max_seq_len=MAX_SEQ,
                                       theta=150000.0)))

    if family == "llama3":
        from torchtitan.models import llama3

        return llama3.Llama3Model.Config(
            dim=DIM, vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                            param_init=llama3._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                                  param_init=llama3._output_linear_init(DIM)),
            layers=llama3._build_llama3_layers(
                fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                hidden_dim=FFN, attn_backend="flex",
                rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=MAX_SEQ, theta=500000,
                                        scaling="llama")))
    from torchtitan.models import qwen3

    rope = CosSinRoPE.Config(dim=QWEN_HEAD_DIM, max_seq_len=MAX_SEQ, theta=1000000.0)
    moe = family == "qwen3-moe"
    if moe:
        layers = qwen3._build_qwen3_moe_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
            head_dim=QWEN_HEAD_DIM, moe_hidden_dim=MOE_FFN, num_experts=EXPERTS, top_k=TOP_K,
            attn_backend="flex", moe_comm_backend="standard", rope=rope)
    else:
        layers = qwen3._build_qwen3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
            head_dim=QWEN_HEAD_DIM, hidden_dim=FFN, attn_backend="flex", rope=rope)
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=qwen3._qwen3_norm(DIM),
        enable_weight_tying=not moe,  # as torchtitan's dense and MoE Qwen 3 configs
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=qwen3._LINEAR_INIT),
        layers=layers)


def build(family: str, *, expert_bias: bool = False) -> torch.nn.Module:
    """The seeded tiny model (the same on every rank), with every parameter perturbed so that
    norms and biases are not all ones or zeros (a misplaced one would go unnoticed)."""
    config = model_config(family)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
        g = torch.Generator().manual_seed(SEED + 1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        if expert_bias:
            for name, b in model.named_buffers():
                if name.endswith("expert_bias_E"):
                    b.copy_(torch.randn(b.shape, generator=g) * 0.01)
    return model.eval()


def hf_config(family: str) -> dict[str, Any]:
    """config.json of the same model, as transformers writes it."""
    from transformers import (
        DeepseekV3Config,
        GptOssConfig,
        LlamaConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=131072, dtype="float32")
    config: Any
    if family == "llama3":
        config = LlamaConfig(
            **common, intermediate_size=FFN, head_dim=DIM // HEADS, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})
    elif family == "deepseek-v3":
        config = DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=FFN,
            moe_intermediate_size=MOE_FFN, n_routed_experts=EXPERTS, n_shared_experts=1,
            num_experts_per_tok=TOP_K, first_k_dense_replace=1, n_group=1, topk_group=1,
            q_lora_rank=None, kv_lora_rank=KV_LORA, qk_nope_head_dim=QK_NOPE,
            qk_rope_head_dim=QK_ROPE, v_head_dim=V_HEAD, tie_word_embeddings=False,
            rope_interleave=True, dtype="float32")
    elif family == "gpt-oss":
        config = GptOssConfig(
            vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
            num_attention_heads=GPT_OSS_HEADS, num_key_value_heads=GPT_OSS_KV_HEADS,
            head_dim=GPT_OSS_HEAD_DIM, intermediate_size=GPT_OSS_FFN,
            num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention"], dtype="float32")
    elif family == "qwen3":
        config = Qwen3Config(
            **common, intermediate_size=FFN, head_dim=QWEN_HEAD_DIM, rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    else:
        config = Qwen3MoeConfig(
            **common, head_dim=QWEN_HEAD_DIM, rms_norm_eps=1e-6, tie_word_embeddings=False,
            num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=MOE_FFN,
            intermediate_size=FFN, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    config.architectures = [{"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "qwen3-moe": "Qwen3MoeForCausalLM",
                             "deepseek-v3": "DeepseekV3ForCausalLM",
                             "gpt-oss": "GptOssForCausalLM"}[family]]
    return dict(config.to_dict())


def adapter(family: str) -> Any:
    """torchtitan's own state-dict adapter for ``family``."""
    if family == "llama3":
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

        return Llama3StateDictAdapter(model_config(family), None)
    if family == "deepseek-v3":
        from torchtitan.models.deepseek_v3.state_dict_adapter import (
            DeepSeekV3StateDictAdapter,
        )

        return DeepSeekV3StateDictAdapter(model_config(family), None)
    if family == "gpt-oss":
        from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

        return GptOssStateDictAdapter(model_config(family), None)
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(model_config(family), None)


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's own forward (causal attention over the one document)."""
    with torch.no_grad():
        return model(tokens)


def _save_job(rank: int, world_size: int, family: str, out: str, how: str,
              expert_bias: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = build(family, expert_bias=expert_bias)
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, mesh=mesh)
    step = Path(out) / STEP_DIR
    if how == "manager":
        from torchtitan.components.checkpoint import CheckpointManager

        manager = CheckpointManager(
            CheckpointManager.Config(enable=True, folder="checkpoint",
                                        last_save_model_only=True, export_dtype="float32"),
            dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None,
            states={}, sd_adapter=None, base_folder=out)
        manager.save(curr_step=1, last_step=True)
        manager.close()
    else:  # the parameters themselves: FusedQKVLinear's wqkv unsplit
        dcp.save(dict(model.named_parameters()), checkpoint_id=str(step))
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, Path(out) / REFERENCE)


@on_disk()
def write(out: Path, family: str, *, how: str = "manager", expert_bias: bool = False) -> Path:
    """Save the tiny ``family`` model on 2 gloo ranks into ``out``; the DCP step directory."""
    out.mkdir(parents=True, exist_ok=True)
    run_on_ranks(_save_job, 2, family, str(out), how, expert_bias)
    return out / STEP_DIR
