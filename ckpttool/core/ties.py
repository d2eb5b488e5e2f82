"""Tied word embeddings: which pair to look at, and whether its two copies are bit-identical."""

from __future__ import annotations

from collections.abc import Mapping

from ckpttool.core.chunks import runs
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


def find_pair(tensors: Mapping[str, dcp.TensorEntry]) -> tuple[str, str] | None:
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


def identical(reader: dcp.Reader, a: dcp.TensorEntry, b: dcp.TensorEntry) -> bool:
    """True if ``a`` and ``b`` hold the same bytes (same dtype and shape required)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    layout_a = [(c.offsets, c.sizes) for c in a.chunks]
    layout_b = [(c.offsets, c.sizes) for c in b.chunks]
    if sorted(layout_a) == sorted(layout_b):
        by_box = {(c.offsets, c.sizes): c for c in b.chunks}
        return all(
            reader.read_chunk(a, c) == reader.read_chunk(b, by_box[(c.offsets, c.sizes)])
            for c in a.chunks
        )
    return _full(reader, a) == _full(reader, b)


def _full(reader: dcp.Reader, t: dcp.TensorEntry) -> bytes:
    item = t.dtype.itemsize
    out = bytearray(t.nbytes)
    for c in t.chunks:
        data = memoryview(reader.read_chunk(t, c))
        for src, dst, n in runs(t.shape, c.offsets, c.sizes):
            out[dst * item : (dst + n) * item] = data[src * item : (src + n) * item]
    return bytes(out)
