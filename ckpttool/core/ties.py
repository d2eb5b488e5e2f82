"""Tied word embeddings: which pair to look at, and what a checkpoint's pair means against its
config (whether the two copies are bit-identical is
:func:`ckpttool.core.checkpoint.tensors.identical`)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ckpttool.core.checkpoint import hf, tensors
from ckpttool.core.checkpoint.discover import open_reader
from ckpttool.core.runtime.report import Section, section
from ckpttool.core.transforms.derive import Derived
from ckpttool.errors import InputError
from ckpttool.formats.base import Problem, Reader, Tensor, error, info

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


@section
class TiePair(Section):
    """The tied pair a checkpoint holds (``inspect``'s ``tie``): the output embedding, the
    input one, and whether the config ties them (None: no config says)."""

    output: str
    input: str
    config_ties: bool | None


@section
class Tie(TiePair):
    """``merge``'s ``tie``: the pair, whether the two are bit-identical (None: not compared,
    a LoRA fold changed one) and what was done (``"deduplicated"``, ``"both written"``...)."""

    identical: bool | None = None
    action: str = "both written"


@dataclass
class TieDecision:
    """What a merge does with the tied pair: names to drop, the report's ``tie`` section (None
    without a pair) and warnings."""

    drop: frozenset[str] = frozenset()
    tie: Tie | None = None
    warnings: list[str] = field(default_factory=list)


def decide(
    reader: Reader,
    sources: Sequence[tuple[str, Tensor | Derived]],
    config: dict[str, Any] | None,
    keep_tied: bool,
) -> TieDecision:
    """Whether a merge writes the output embedding (``lm_head.weight``) or drops it as a tied
    copy of the input one, as ``save_pretrained`` does: the one place that decides ties.

    A copy is dropped only when the config ties word embeddings and the two are bit-identical
    (read here, in bounded blocks), or when a LoRA fold changed the input embedding alone;
    every other case writes both and says why where it matters.
    """
    by_name = dict(sources)
    decision = TieDecision()
    pair = find_pair(by_name)
    if pair is None:
        return decision
    head, embed = pair
    tied = hf.ties_word_embeddings(config)
    a, b = by_name[head], by_name[embed]
    if isinstance(a, Derived) or isinstance(b, Derived):
        # A LoRA fold changed one of them. Tied in the config: transformers ties the output
        # embedding to the (fused) input one on load, as PEFT's merge did to the shared
        # weight, so one copy is written.
        if tied and not keep_tied and isinstance(b, Derived) and not isinstance(a, Derived):
            decision.tie = Tie(head, embed, True, None, "deduplicated (input embedding fused)")
            decision.drop = frozenset({head})
            return decision
        decision.tie = Tie(head, embed, tied, None, "both written")
        if tied:
            decision.warnings.append(
                f"config ties word embeddings but the LoRA fold changed '{head}' and not "
                f"'{embed}' alike; both were written, but transformers will tie them on load "
                f"and drop the folded '{head}'. Set tie_word_embeddings to false in "
                "config.json to keep it")
        return decision
    same = tensors.identical(reader, a, reader, b, block_bytes=COMPARE_BLOCK)
    decision.tie = Tie(head, embed, tied, same)
    if tied and same and not keep_tied:
        decision.tie.action = "deduplicated"
        decision.drop = frozenset({head})
        return decision
    if tied and not same:
        decision.warnings.append(
            f"tie broken: config ties word embeddings but '{head}' differs from '{embed}'; both "
            "were written, but transformers will tie them on load and drop the trained "
            f"'{head}'. Set tie_word_embeddings to false in config.json to keep it"
        )
    elif tied is None and same:
        decision.warnings.append(
            f"'{head}' and '{embed}' are identical and look tied, but no config.json says so; "
            "both were written (pass --config to deduplicate)"
        )
    return decision



def pair_identical(ckpt: Checkpoint, model: Checkpoint, pair: tuple[str, str],
                   complete: Collection[str], digests: Mapping[str, str], *,
                   follow_links: bool, block_bytes: int) -> bool | None:
    """Whether verify's tied pair holds the same bytes: from digests where the data pass made
    them, else compared directly; None when either could not be read whole."""
    head, embed = pair
    if head not in complete or embed not in complete:
        return None
    if head in digests and embed in digests:
        return digests[head] == digests[embed]
    # Compared directly (no SHA-256 of both, at 1.4 GB/s): embeddings that differ differ in
    # their first block.
    views = model.by_name()
    with (open_reader(ckpt, follow_links=follow_links) as reader,
          contextlib.suppress(InputError)):  # read once already: damage is reported
        return tensors.identical(reader, views[head].tensor, reader, views[embed].tensor,
                                 block_bytes=block_bytes)
    return None
