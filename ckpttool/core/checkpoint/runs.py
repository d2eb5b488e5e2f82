"""A training run directory given where one checkpoint is expected (``merge run/ out/``: the
HF Trainer user's most likely mistake): which checkpoints it holds, to name the latest and
point at ``merge --all`` instead of saying "no checkpoint here".

From names and format detection only (nothing is read), through the Stores the run is seen
through (a remote run's listing); ``core.merge.sweep`` finds the checkpoints of a run the
same way for ``--all``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ckpttool.formats import registry
from ckpttool.storage.store import LOCAL, Stores

# The names trainers give a run's checkpoints: checkpoint-500 (HF Trainer), step-1000
# (torchtitan), global_step500 (DeepSpeed), iter_0000500 (Megatron), epoch=1-step=100
# (Lightning), or a bare step number. A model part (pytorch_model_fsdp_0, optimizer_0) is not one.
_STEP_NAME = re.compile(r"(?:epoch=\d+-)?(?:checkpoint|ckpt|step|global_step|iter|iteration)?"
                        r"[-_=]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class RunCheckpoint:
    name: str  # relative to the run, "/"-separated
    step: int


def _step(name: str) -> int | None:
    m = _STEP_NAME.fullmatch(name)
    return int(m[1]) if m else None


def _entries(directory: Path, stores: Stores) -> list[Path]:
    return sorted(directory / name for name in stores.listdir(directory)
                  if not name.startswith("."))


def _claimed(path: Path, stores: Stores) -> bool:
    return not path.is_symlink() and registry.detect(path, stores) is not None


def checkpoints(run: Path, *, depth: int = 2, stores: Stores = LOCAL) -> list[RunCheckpoint]:
    """The checkpoints of the run directory ``run``, in step order: directories with a step
    number in their name that a format claims or that hold an entry a format claims
    (``checkpoint-500/pytorch_model_fsdp_0``); directories without a step are looked into,
    ``depth`` levels down (accelerate's ``checkpoints/checkpoint_0``). A local link is
    never followed."""
    found: list[RunCheckpoint] = []
    for p in _entries(run, stores):
        if p.is_symlink() or not stores.is_dir(p):
            continue
        step = _step(p.name)
        if step is not None:
            if _claimed(p, stores) or any(_claimed(q, stores) for q in _entries(p, stores)):
                found.append(RunCheckpoint(p.name, step))
        elif depth > 1:
            found += [RunCheckpoint(f"{p.name}/{c.name}", c.step)
                      for c in checkpoints(p, depth=depth - 1, stores=stores)]
    return sorted(found, key=lambda c: (c.step, c.name))


def run_message(given: Path, command: str, stores: Stores = LOCAL) -> str | None:
    """What to say of ``given`` where it is a run directory of checkpoints: the one it holds
    and the command for it; or, of two or more, how many, the latest, the command for it,
    and ``merge --all`` for every one (``stores``: where the run is). None otherwise."""
    found = checkpoints(given, stores=stores)
    if not found:
        return None
    latest = found[-1]
    out = " OUT" if command in ("merge", "reshard") else ""
    if len(found) == 1:
        return (f"{given}: a training run directory holding one checkpoint, {latest.name}, "
                f"not a checkpoint itself: ckpttool {command} {given / latest.name}{out}")
    steps = f"steps {found[0].step} to {latest.step}"
    every = (f", or every one: ckpttool merge {given} OUT_ROOT --all" if command == "merge"
             else f" (ckpttool merge {given} OUT_ROOT --all merges every one)")
    return (f"{given}: a training run directory with {len(found)} checkpoints ({steps}), not "
            f"one checkpoint; the latest is {latest.name}: ckpttool {command} "
            f"{given / latest.name}{out}{every}")
