"""What each key of a checkpoint is: model weights, optimizer state, lr scheduler, dataloader,
train state, RNG state or something else. Pure functions over key paths; one rule set for
every format and every command.

Training frameworks save all of it in one checkpoint, under their own top-level keys:

* torchtitan (``CheckpointManager``): the model's keys flat at the top level
  (``tok_embeddings.weight``), beside ``optimizer`` (``state.<fqn>.exp_avg``,
  ``param_groups.<fqn>.lr``: a flat, FQN-keyed optimizer state dict), ``lr_scheduler``
  (``last_epoch``), ``dataloader`` (``dp_rank_<r>``: pickled bytes; ``world_size``) and
  ``train_state`` (``step``, ``ntokens_seen``);
* Lightning Fabric (``fabric.save``): the user's names, usually ``model`` and ``optimizer``
  (``state.<fqn>.exp_avg``, ``param_groups.<i>.lr``); the rest in ``meta.pt`` beside it;
* accelerate: ``{"model": ...}`` and ``{"optimizer": ...}`` in separate checkpoints.

Optimizer state is recognised by its shape, whatever the key is called: a key with a
``param_groups`` child, or a key named like an optimizer with a ``state`` child (or
``distributed``: Megatron-Core's distributed optimizer; its ChainedOptimizer's
``chained_<i>.optimizer``). The other
parts are recognised by the top-level key's name. Tensors that fit no rule are the model only
when nothing else can be: a checkpoint with a ``model`` key puts stray tensors in ``other``,
and so does a checkpoint with several unnamed top-level keys holding tensors. Whatever is
``other`` is listed in every report, never merged into the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ckpttool.core.runtime.report import Section, section

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"
RNG = "rng"
OTHER = "other"

#: Every part, in report order.
PARTS = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE, RNG, OTHER)
#: What ``merge --part`` writes.
MERGEABLE = (MODEL, OPTIMIZER)

# Top-level keys by name. A model's own modules are never looked up here: a flat model key
# ("tok_embeddings.weight") has no recognised first segment, and a nested one sits under a
# model key.
_MODEL_KEYS = frozenset({"model", "models", "module", "net", "network", "model_state",
                         "model_state_dict", "state_dict"})
_OPTIMIZER_KEYS = frozenset({"optimizer", "optimizers", "optim", "opt", "optimizer_state",
                             "optimizer_states", "optimizer_state_dict", "optim_state"})
_NAMED: dict[str, str] = {
    **dict.fromkeys(("lr_scheduler", "lr_schedulers", "scheduler", "schedulers",
                     "lr_scheduler_state", "scheduler_state", "opt_param_scheduler"),
                    LR_SCHEDULER),
    **dict.fromkeys(("dataloader", "dataloaders", "data_loader", "train_dataloader",
                     "dataloader_state", "sampler", "sampler_state"), DATALOADER),
    **dict.fromkeys(("train_state", "trainer_state", "training_state", "step", "steps",
                     "global_step", "epoch", "iteration", "iter_num", "ntokens_seen",
                     "tokens_seen", "consumed_samples", "consumed_tokens", "loops",
                     "progress"), TRAIN_STATE),
    **dict.fromkeys(("rng", "rng_state", "rng_states", "random_state", "random_states",
                     "torch_rng_state", "cuda_rng_state", "numpy_rng_state",
                     "python_rng_state"), RNG),
}
# Below an optimizer-named key: torch's ``state``; Megatron-Core's distributed optimizer's
# ``distributed`` (``optimizer.distributed.dp_group_idx_0.gbuf_idx_0...exp_avg``).
_OPTIMIZER_CHILDREN = frozenset({"state", "distributed"})
# Megatron-Core's ChainedOptimizer (dense and expert parameters apart): each one's state
# below ``chained_<i>.optimizer``.
_CHAINED = re.compile(r"chained_\d+")
# A bare optimizer state dict (torch.save(optim.state_dict()), ckpttool's own
# optimizer.safetensors) has these at the top level.
_BARE_OPTIMIZER = frozenset({"state", "param_groups"})


@dataclass(frozen=True)
class Label:
    """An entry's part, and the top-level key that nests it (not part of any name inside the
    part; None for a flat key at the top level)."""

    part: str
    root: str | None


def split(path: tuple[str, ...]) -> tuple[str, str, bool]:
    """(top-level key, the key below it, nested). A flat key is split at its dots:
    ``("optimizer.state.w.exp_avg",)`` -> ``("optimizer", "state", False)``."""
    if len(path) > 1:
        return path[0], path[1].split(".", 1)[0], True
    segments = path[0].split(".", 2) if path else [""]
    return segments[0], segments[1] if len(segments) > 1 else "", False


def classify(entries: Sequence[tuple[tuple[str, ...], bool]]) -> list[Label]:
    """The part of each entry.

    Args:
        entries: (nested key path, is a tensor) of every entry of one checkpoint.

    Returns:
        One :class:`Label` per entry, in order.
    """
    splits = [split(path) for path, _ in entries]
    tops = {top for top, _, _ in splits}
    bare = "param_groups" in tops or (bool(tops) and tops <= _BARE_OPTIMIZER)
    optimizer_roots = {top for top, below, _ in splits
                       if below == "param_groups"
                       or (below in _OPTIMIZER_CHILDREN and top in _OPTIMIZER_KEYS)
                       or (below in _OPTIMIZER_KEYS and _CHAINED.fullmatch(top))}
    if bare:
        optimizer_roots |= tops & _BARE_OPTIMIZER
    if any(_CHAINED.fullmatch(top) for top in optimizer_roots):
        # a ChainedOptimizer's common part: the sharding type of each, under "optimizer"
        optimizer_roots |= tops & _OPTIMIZER_KEYS
    kinds = [(top, nested, is_tensor) for (top, _, nested), (_, is_tensor)
             in zip(splits, entries, strict=True)]
    tensor_roots = {top for top, nested, is_tensor in kinds if is_tensor and nested}
    flat_tensors = any(is_tensor and not nested for _, nested, is_tensor in kinds)
    named_model = tensor_roots & _MODEL_KEYS
    unnamed = tensor_roots - _MODEL_KEYS - optimizer_roots - _NAMED.keys()
    if named_model:
        model_roots = named_model
    elif not flat_tensors and len(unnamed) == 1:
        model_roots = unnamed  # {"net": ..., "opt": ...}: the one state dict that is left
    else:
        model_roots = set()
    labels = []
    for top, nested, is_tensor in kinds:
        root = top if nested else None
        if top in optimizer_roots:
            labels.append(Label(OPTIMIZER, None if top in _BARE_OPTIMIZER else root))
        elif top in _NAMED and (nested or not is_tensor):
            # A flat tensor keeps its place in the model whatever its name (a "steps" buffer).
            labels.append(Label(_NAMED[top], root))
        elif nested and top in model_roots:
            labels.append(Label(MODEL, root))
        elif not nested and is_tensor and (top in _MODEL_KEYS or not named_model):
            # A flat state dict: the model's own names ("model.embed_tokens.weight" too).
            labels.append(Label(MODEL, None))
        else:
            labels.append(Label(OTHER, root))
    return labels


@section(frozen=True)
class Content(Section):
    """One part of a checkpoint, for reports: what it holds and under which keys."""

    KEYS: ClassVar[dict[str, str]] = {"num_tensors": "tensors", "num_non_tensor": "non_tensor"}

    part: str
    keys: tuple[str, ...]  # top-level keys (first name segments) it is stored under
    num_tensors: int
    bytes: int
    num_non_tensor: int
    file: str | None = None  # a side file holding it (Lightning's meta.pt); None: the checkpoint


def contents(entries: Iterable[tuple[str, tuple[str, ...], int | None]], *,
             file: str | None = None, max_keys: int = 8) -> list[Content]:
    """Each part present, in :data:`PARTS` order.

    Args:
        entries: (part, key path, byte size or None for a non-tensor entry).
        file: the side file these entries come from, if not the checkpoint itself.
        max_keys: keys listed per part (the first ones, sorted).
    """
    keys: dict[str, set[str]] = {}
    tensors: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    objects: dict[str, int] = {}
    for part, path, size in entries:
        keys.setdefault(part, set()).add(split(path)[0])
        if size is None:
            objects[part] = objects.get(part, 0) + 1
        else:
            tensors[part] = tensors.get(part, 0) + 1
            nbytes[part] = nbytes.get(part, 0) + size
    return [Content(p, tuple(sorted(keys[p]))[:max_keys], tensors.get(p, 0), nbytes.get(p, 0),
                    objects.get(p, 0), file) for p in PARTS if p in keys]


def describe(c: Content) -> str:
    """``optimizer (48 tensors, 1.2 MB; 180 non-tensor entries; keys: optimizer)``, for people;
    sizes in bytes (the CLI formats them)."""
    held = []
    if c.num_tensors:
        held.append(f"{c.num_tensors} tensor{'s' if c.num_tensors != 1 else ''}")
    if c.num_non_tensor:
        held.append(f"{c.num_non_tensor} non-tensor entr{'ies' if c.num_non_tensor != 1 else 'y'}")
    where = f" in {c.file}" if c.file else ""
    return f"{c.part} ({', '.join(held)}{where}; keys: {', '.join(c.keys)})"
