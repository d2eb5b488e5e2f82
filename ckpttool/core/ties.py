"""Tied word embeddings: which pair to look at, and whether its two copies are bit-identical."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ckpttool.core.tensors import read_range
from ckpttool.formats import dcp

OUTPUT_EMBEDDING = "lm_head.weight"
# Input-embedding names of common architectures, most common first.
INPUT_EMBEDDINGS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "transformer.wte.weight",
    "model.decoder.embed_tokens.weight",
    "gpt_neox.embed_in.weight",
    "transformer.word_embeddings.weight",
    "embed_tokens.weight",
    "tok_embeddings.weight",
)
_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


class _Shaped(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...


def find_pair(tensors: Mapping[str, _Shaped]) -> tuple[str, str] | None:
    """(output embedding, input embedding) canonical names when both exist with one shape."""
    head = tensors.get(OUTPUT_EMBEDDING)
    if head is None:
        return None
    candidates = [n for n in INPUT_EMBEDDINGS if n in tensors]
    candidates += sorted(n for n in tensors if n.endswith(_SUFFIXES) and n not in candidates)
    for name in candidates:
        if tensors[name].shape == head.shape:
            return OUTPUT_EMBEDDING, name
    return None


# Elements compared per step: memory stays flat whatever the embedding size.
COMPARE_BLOCK = 4 << 20


def identical(reader: dcp.Reader, a: dcp.TensorEntry, b: dcp.TensorEntry) -> bool:
    """True if ``a`` and ``b`` hold the same bytes (same dtype and shape required); compared
    in fixed-size blocks, stopping at the first difference."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    block = max(1, COMPARE_BLOCK // a.dtype.itemsize)
    for start in range(0, a.numel, block):
        stop = min(start + block, a.numel)
        if read_range(reader, a, start, stop) != read_range(reader, b, start, stop):
            return False
    return True
