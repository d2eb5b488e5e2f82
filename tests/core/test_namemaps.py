"""core/namemaps.py: the tables against torchtitan's own models at full size (built on the
meta device: shapes without memory) and Hugging Face's published configs, and the value
transforms against torchtitan's own code (its adapter's RoPE permutation, its fused-QKV
state-dict hook). End-to-end merges are in tests/cli/test_merge_names.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.core.transforms import namemaps
from ckpttool.core.transforms.derive import Derived
from ckpttool.errors import InputError
from ckpttool.formats.base import Tensor
from ckpttool.formats.codecs import dtypes

# The published config.json of each model (the fields the maps read).
LLAMA_3_1_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False}
QWEN3_0_6B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}


def titan_tensors(family: str, flavor: str) -> list[tuple[str, Tensor]]:
    """torchtitan's registered model ``flavor``, as checkpoint metadata (no data)."""
    from torchtitan.models import llama3, qwen3

    configs = llama3.llama3_configs if family == "llama3" else qwen3.qwen3_configs
    with torch.device("meta"):
        model = configs[flavor]("flex").build()
    f32 = dtypes.get("F32")
    return [(name, Tensor(name, (name,), f32, tuple(t.shape), ()))
            for name, t in model.state_dict().items()]


@pytest.mark.parametrize(("family", "flavor", "config", "name_map", "counts"), [
    ("llama3", "8B", LLAMA_3_1_8B, "torchtitan-llama3",
     {"renamed": 3 + 32 * 7, "rope-permuted": 32 * 2}),
    ("qwen3", "0.6B", QWEN3_0_6B, "torchtitan-qwen3", {"renamed": 3 + 28 * 11}),
    ("qwen3", "30B-A3B", QWEN3_30B_A3B, "torchtitan-qwen3",
     {"renamed": 3 + 48 * 9, "expert-split": 48 * 3 * 128}),
])
def test_full_size_models_map_completely(family: str, flavor: str, config: dict[str, Any],
                                         name_map: str, counts: dict[str, int]) -> None:
    mapped = namemaps.apply(name_map, titan_tensors(family, flavor), config)
    assert mapped.counts() == counts
    names = [n for n, _ in mapped.tensors]
    assert len(names) == len(set(names))
    last = config["num_hidden_layers"] - 1
    assert f"model.layers.{last}.self_attn.k_proj.weight" in names
    if flavor == "30B-A3B":
        assert len(mapped.dropped) == 48
        source = dict(mapped.tensors)["model.layers.47.mlp.experts.127.down_proj.weight"]
        assert isinstance(source, Derived)
        assert source.shape == (2048, 768) and source.select == (127,)
    if flavor == "8B":
        source = dict(mapped.tensors)["model.layers.0.self_attn.k_proj.weight"]
        assert isinstance(source, Derived) and source.shape == (1024, 4096)
        # A rename is the stored tensor itself: merge copies its bytes file to file.
        assert isinstance(dict(mapped.tensors)["model.layers.0.mlp.up_proj.weight"], Tensor)


def test_a_map_is_for_one_family() -> None:
    tensors = titan_tensors("qwen3", "0.6B")
    with pytest.raises(InputError, match="model_type 'qwen3' is not Llama 3"):
        namemaps.apply("torchtitan-llama3", tensors, QWEN3_0_6B)
    with pytest.raises(InputError, match="no name map 'hf-gpt2'; choose one of "
                                         + ", ".join(namemaps.NAMES)):
        namemaps.apply("hf-gpt2", tensors, QWEN3_0_6B)


def test_one_weight_in_two_forms_is_refused() -> None:
    tensors = titan_tensors("llama3", "8B")
    f32 = dtypes.get("F32")
    fused = "layers.3.attention.qkv_linear.wqkv.weight"
    tensors.append((fused, Tensor(fused, (fused,), f32, (6144, 4096), ())))
    with pytest.raises(InputError, match=r"'model.layers.3.self_attn.q_proj.weight' would be "
                                         r"written twice \(from 'layers.3.attention"):
        namemaps.apply("torchtitan-llama3", tensors, LLAMA_3_1_8B)


# --------------------------------------------------------------------------------------------
# Values, against torchtitan's own code


@settings(max_examples=25, deadline=None)
@given(kv_heads=st.integers(1, 4), group=st.integers(1, 4), half=st.integers(1, 4),
       cols=st.integers(1, 5))
def test_rope_permutation_is_torchtitans(kv_heads: int, group: int, half: int,
                                         cols: int) -> None:
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    heads = kv_heads * group
    w = torch.randn(heads * 2 * half, cols)
    # _permute reads nothing of the adapter but its arguments.
    permute = Llama3StateDictAdapter._permute
    assert torch.equal(namemaps._rope_permute(w, heads), permute(None, w, heads))


@settings(max_examples=25, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 3), half=st.integers(1, 3),
       dim=st.integers(1, 6))
def test_fused_wqkv_split_is_torchtitans(kv_heads: int, group: int, half: int,
                                         dim: int) -> None:
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.common.linear import Linear

    heads, head_dim = kv_heads * group, 2 * half
    module = FusedQKVLinear.Config(
        head_dim=head_dim, n_heads=heads, n_kv_heads=kv_heads,
        wqkv=Linear.Config(in_features=dim, out_features=(heads + 2 * kv_heads) * head_dim,
                           bias=False)).build()
    with torch.no_grad():
        module.wqkv.weight.copy_(torch.randn(module.wqkv.weight.shape))
    split = module.state_dict()  # torchtitan's own hook splits wqkv on save
    fused = [module.wqkv.weight.detach()]
    for op, name in ((namemaps.WQKV_Q, "wq"), (namemaps.WQKV_K, "wk"), (namemaps.WQKV_V, "wv")):
        part = namemaps._wqkv_part(fused, op=op, kv_heads=kv_heads, head_dim=head_dim,
                                   rope_heads=0)
        assert torch.equal(part, split[f"{name}.weight"]), name
