"""Tied word embeddings: which pair to look at, and what a checkpoint's pair means against its
config (whether the two copies are bit-identical is
:func:`ckpttool.core.checkpoint.tensors.identical`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from ckpttool.core.checkpoint import hf
from ckpttool.formats.base import Problem, error, info

if TYPE_CHECKING:
    from ckpttool.core.checkpoint.discover import Checkpoint


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

# Bytes compared per step when checking a pair: memory stays flat whatever the embedding size.
COMPARE_BLOCK = 16 << 20


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


def check_ties(ckpt: Checkpoint, identical: bool | None) -> list[Problem]:
    """Tied embeddings against config.json.

    Args:
        identical: whether the output and input embeddings hold the same bytes (None: unknown,
            e.g. unreadable).
    """
    if ckpt.kind != "model":
        return []
    config_ties = hf.ties_word_embeddings(ckpt.hf.config)
    config = ckpt.hf.config_path.name if ckpt.hf.config_path else "config.json"
    names = ckpt.by_name()
    pair = find_pair(names)
    head = OUTPUT_EMBEDDING
    if pair is None:
        embed = next((n for n in INPUT_EMBEDDINGS if n in names), None)
        if head in names or embed is None or config_ties is None:
            return []
        if config_ties:
            return [info("tie-ok", f"'{head}' is absent and {config} ties it to '{embed}': "
                          "stored once, as transformers saves it", tensor=embed)]
        return [error("tie-missing", f"{config} sets tie_word_embeddings false but the "
                       f"checkpoint has no '{head}' (only '{embed}'); the trained output "
                       "embedding is lost. Export it again, or set tie_word_embeddings to true if "
                       "the model is tied", tensor=head)]
    head, embed = pair
    state = {True: "identical", False: "different", None: "not comparable"}[identical]
    if config_ties is None:
        return [info("tie-candidate", f"'{head}' and '{embed}' have one shape and are {state}; "
                      "no config.json says whether they are tied (pass --config to check)",
                      tensor=head)]
    if not config_ties:
        return []
    if identical:
        return [info("tie-ok", f"'{head}' is identical to '{embed}', as {config} ties them",
                      tensor=head)]
    if identical is False:
        return [error("tie-broken", f"{config} ties word embeddings but '{head}' differs from "
                       f"'{embed}'; transformers will tie them on load and drop the trained "
                       f"'{head}'. Set tie_word_embeddings to false in {config} to keep it",
                       tensor=head)]
    return []
