"""Canonical tensor names: the one place wrapper segments are removed."""

from __future__ import annotations

from collections.abc import Iterable

from ckpttool.errors import InputError

# Segments that wrappers insert into parameter names and that a served model never has.
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

# accelerate saves {"model": state_dict}: a nesting level, not part of any parameter name.
TOP_LEVEL_WRAPPER = "model"


def canonical_fqn(path: tuple[str, ...], top_level: str = TOP_LEVEL_WRAPPER) -> str:
    """The canonical name of a state-dict entry given its nested key path.

    ``("model", "_orig_mod.layers.0._checkpoint_wrapped_module.w")`` -> ``"layers.0.w"``;
    a flat key ``("model.embed_tokens.weight",)`` keeps its ``model.`` prefix. An optimizer
    checkpoint nests under ``"optimizer"`` instead (``top_level="optimizer"``).
    """
    if len(path) > 1 and path[0] == top_level:
        path = path[1:]
    return strip_wrappers(".".join(path))


def strip_wrappers(dotted: str) -> str:
    """Remove wrapper segments from a dotted parameter name."""
    if not _may_wrap(dotted):  # most names: no segment to look at (15,000 in a MoE model)
        return dotted
    return ".".join(seg for seg in dotted.split(".") if seg not in WRAPPER_SEGMENTS)


def _may_wrap(dotted: str) -> bool:
    """Whether a wrapper segment may be in ``dotted``: each holds one of these."""
    return "_orig_mod" in dotted or "_wrapped_module" in dotted


def unique_names(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """(stored key, canonical name) pairs as a map, checked one to one.

    Raises:
        InputError: two source keys collapse to one canonical name.
    """
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for fqn, name in pairs:
        if name in seen:
            raise InputError(
                f"tensors '{seen[name]}' and '{fqn}' both become '{name}' once wrapper segments "
                "are removed; the checkpoint holds the same parameter twice under wrapped and "
                "unwrapped names"
            )
        seen[name] = fqn
        out[fqn] = name
    return out


def detected_wrappers(paths: Iterable[tuple[str, ...]],
                      top_level: str = TOP_LEVEL_WRAPPER) -> list[str]:
    """Which wrappers show in these key paths (for reports)."""
    found: set[str] = set()
    for path in paths:
        if len(path) > 1 and path[0] == top_level:
            found.add(top_level)
        dotted = ".".join(path)
        if _may_wrap(dotted):
            found.update(WRAPPER_SEGMENTS.intersection(dotted.split(".")))
    return sorted(found)
