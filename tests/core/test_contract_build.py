"""How the contract builds its consumer (:func:`ckpttool.core.contract._build`): the model
class on the meta device inside transformers' own no-init context, which skips the weight
initialisation that costs most of a large model's build and computes nothing on meta.

Shortcuts are allowed only where they give exactly what the plain build gives: each family
the contract tests use (dense, per-layer kinds, mixtures of experts, a vision-language model,
tied heads) is built both ways here and the two expectations compared whole."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import pytest

from ckpttool.core import contract

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 96}

# model_type -> (architecture, what makes its layers differ from one another)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"num_hidden_layers": 2}),
    "qwen2": ("Qwen2ForCausalLM", {"num_hidden_layers": 2, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3ForCausalLM", {"num_hidden_layers": 2, "head_dim": 8}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    "mixtral": ("MixtralForCausalLM", {"num_hidden_layers": 2, "num_local_experts": 4,
                                       "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3ForCausalLM", {
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "n_group": 1, "topk_group": 1, "kv_lora_rank": 8, "q_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
        "num_key_value_heads": 4}),
    "gpt_oss": ("GptOssForCausalLM", {
        "num_hidden_layers": 2, "head_dim": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma": ("GemmaForCausalLM", {"num_hidden_layers": 2, "head_dim": 8}),
    "gemma2": ("Gemma2ForCausalLM", {"num_hidden_layers": 2, "head_dim": 8}),
}


def _config(model_type: str) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    arch, extra = FAMILIES[model_type]
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **{**_SMALL, **extra})
    except (KeyError, ValueError):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    return {**cfg.to_dict(), "architectures": [arch]}


def _llava() -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    text = transformers.LlamaConfig(num_hidden_layers=1, **_SMALL)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=16, patch_size=8, projection_dim=16)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                   image_token_index=95)
    return {**cfg.to_dict(), "architectures": ["LlavaForConditionalGeneration"]}


@pytest.mark.parametrize("family", [*FAMILIES, "llava"])
def test_the_no_init_build_gives_what_the_plain_build_gives(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _llava() if family == "llava" else _config(family)
    fast = contract._transformers_expected(config)
    assert fast.tensors
    monkeypatch.setattr(contract, "_no_init", lambda transformers: contextlib.nullcontext())
    plain = contract._transformers_expected(config)
    assert fast == plain


def test_the_no_init_context_is_where_the_build_takes_it() -> None:
    """transformers' no-init context (5.x: ``initialization``; 4.x: ``modeling_utils``): an
    upgrade that moves it fails here, loudly, instead of the check slowing down unseen."""
    transformers = pytest.importorskip("transformers")
    where = "initialization" if int(transformers.__version__.split(".")[0]) >= 5 else \
        "modeling_utils"
    module = importlib.import_module(f"transformers.{where}")
    assert callable(module.no_init_weights)
    import torch

    with contract._no_init(transformers):
        layer = torch.nn.Linear(4, 4)  # initialised by torch's kaiming_uniform_: skipped
        assert torch.nn.init.kaiming_uniform_ is not _KAIMING
    assert torch.nn.init.kaiming_uniform_ is _KAIMING  # given back
    assert layer.weight.shape == (4, 4)


_KAIMING = importlib.import_module("torch.nn.init").kaiming_uniform_
