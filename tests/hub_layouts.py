"""Tiny transformers 5 mixture-of-experts and vision-language models, trained state saved the
way accelerate saves it under FSDP2, and ``save_pretrained`` of the same model beside it.

    ckpt = write(tmp / "mixtral", "mixtral")   # <out>/checkpoint-1 (config.json + DCP)
    # <out>/save_pretrained: what transformers writes for the same weights

Each family's model is built from a small config by transformers' own classes with a fixed
seed (every parameter perturbed, so that no norm is all ones), ``fully_shard``-ed on 2 gloo
ranks and saved with ``dcp.save({"model": model.state_dict()})`` into
``checkpoint-1/pytorch_model_fsdp_0`` beside ``config.json``, as the HF Trainer with the
accelerate FSDP plugin lays it out. The parent builds the same seeded model and calls
``save_pretrained``: the reference a merge must equal, key for key and byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.fixture_cache import on_disk
from tests.fsdp2_ranks import run_on_ranks

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen2_vl", "llava")
CHECKPOINT = "checkpoint-1"
MODEL_DIR = "pytorch_model_fsdp_0"
REFERENCE = "save_pretrained"
SEED = 4321

_TEXT = dict(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def config(family: str) -> Any:
    """The tiny model's transformers config."""
    import transformers as tf

    if family == "mixtral":
        return tf.MixtralConfig(**_TEXT, num_local_experts=3, num_experts_per_tok=2,
                                tie_word_embeddings=False)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**_TEXT, num_experts=3, num_experts_per_tok=2,
                                 moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                 tie_word_embeddings=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_TEXT, num_experts=4, num_experts_per_tok=2, head_dim=8,
                                 moe_intermediate_size=12, tie_word_embeddings=False)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **_TEXT, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
            first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=8, q_lora_rank=8,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, tie_word_embeddings=False)
    if family == "qwen2_vl":
        return tf.Qwen2VLConfig(
            text_config=dict(**_TEXT, model_type="qwen2_vl_text", tie_word_embeddings=True,
                             rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
            vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2,
                               patch_size=2, spatial_merge_size=1, temporal_patch_size=1),
            tie_word_embeddings=True)
    if family == "llava":
        return tf.LlavaConfig(
            text_config=dict(**_TEXT, model_type="llama"),
            vision_config=dict(model_type="clip_vision_model", hidden_size=16,
                               intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, image_size=8, patch_size=4),
            image_token_index=3, tie_word_embeddings=True)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def build(family: str) -> torch.nn.Module:
    """The seeded model, every parameter perturbed (the same on every rank)."""
    import transformers as tf

    cfg = config(family)
    auto = (tf.AutoModelForImageTextToText if family in ("qwen2_vl", "llava")
            else tf.AutoModelForCausalLM)
    torch.manual_seed(SEED)
    model = auto.from_config(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def _save_job(rank: int, world_size: int, family: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(family)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    ckpt = Path(out) / CHECKPOINT
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / MODEL_DIR))
    if rank == 0:
        model.config.save_pretrained(ckpt)


@on_disk()
def write(out: Path, family: str) -> Path:
    """Save ``family``'s model on 2 ranks into ``out``; the checkpoint directory. The
    reference ``save_pretrained`` output goes to ``out / REFERENCE``."""
    out.mkdir(parents=True, exist_ok=True)
    run_on_ranks(_save_job, 2, family, str(out))
    build(family).save_pretrained(out / REFERENCE)
    return out / CHECKPOINT
