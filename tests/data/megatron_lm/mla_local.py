"""The CPU stand-in for multi-latent attention's core attention, shared by the two committed
Megatron generators: ``generate.py`` beside this file (Megatron-LM's training code) and
``tests/data/megatron/generate.py`` (megatron-core alone, which puts this folder on its
path). Both build MLA with megatron-core's local spec, whose core attention cannot take
what MLA passes it; neither changes a byte that Megatron writes."""

from __future__ import annotations

from typing import Any


def local_core_attention() -> type:
    """Megatron's local ``DotProductAttention``, taking the ``k_channels``/``v_channels`` that
    ``MLASelfAttention`` passes to its core attention (megatron-core 0.16.1: only Transformer
    Engine's ``TEDotProductAttention`` takes them; the local class raises TypeError). They
    must be the head size the local class computes from ``kv_channels`` (hence
    ``--v-head-dim`` = ``--qk-head-dim`` + ``--qk-pos-emb-head-dim`` = ``--kv-channels``):
    the computation is the local class's own. (``Attention`` builds a core attention without
    them first, which MLA's ``__init__`` replaces.)"""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLALocalDotProductAttention(DotProductAttention):  # type: ignore[misc]
        def __init__(self, *args: Any, k_channels: int | None = None,
                     v_channels: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            head = self.hidden_size_per_attention_head
            assert k_channels in (None, head) and v_channels in (None, head), (
                k_channels, v_channels, head)

    return MLALocalDotProductAttention
