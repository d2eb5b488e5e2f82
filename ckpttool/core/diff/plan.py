"""Which tensors of A and B are compared, and what a tensor on one side only means. Pure.

Tensors are matched by canonical name. A tied output embedding stored once on one side
(``lm_head.weight`` left out, its config tying it to the input embedding) stands for its
partner there: it is compared with the other side's copy, so a tie written once on one side
and twice on the other is no change.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from ckpttool.core import ties
from ckpttool.core.checkpoint import hf
from ckpttool.core.checkpoint.discover import Checkpoint
from ckpttool.core.transforms.derive import Derived
from ckpttool.formats.base import Tensor
from ckpttool.formats.codecs.dtypes import DType

IDENTICAL = "identical"
CHANGED = "changed"
ADDED = "added"
REMOVED = "removed"
RESHAPED = "reshaped"
DTYPE_CHANGED = "dtype-changed"
STATUSES = (IDENTICAL, CHANGED, ADDED, REMOVED, RESHAPED, DTYPE_CHANGED)


@dataclass(frozen=True)
class View:
    """A tensor of one side under its Hugging Face name: a stored tensor, or (a Megatron-Core
    run, through its family's name map, as merge writes it) a slice or a computed tensor."""

    name: str
    source: Tensor | Derived
    stored_name: str

    @property
    def dtype(self) -> DType:
        return self.source.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def numel(self) -> int:
        return self.source.numel

    @property
    def nbytes(self) -> int:
        return self.source.nbytes

    @property
    def files(self) -> tuple[str, ...]:
        src = self.source
        return src.files if isinstance(src, Tensor) else src.inputs[0].files


@dataclass(frozen=True)
class Named:
    """One side of a diff: the checkpoint and its tensors under the names compared."""

    ckpt: Checkpoint
    views: dict[str, View]
    map: str | None = None  # the name map applied (a Megatron-Core run's family map)

    @property
    def root(self) -> Path:
        return self.ckpt.root

    @property
    def hf(self) -> hf.HfFiles:
        return self.ckpt.hf

    def by_name(self) -> dict[str, View]:
        return self.views


def named(ckpt: Checkpoint) -> Named:
    """The tensors of ``ckpt`` (its model, of a training checkpoint) under the names merge
    writes: canonical names, or for a Megatron-Core run its family's name map (config.json
    beside the run, or ``--config`` of merge: layers unstacked, QKV and gate/up split) applied
    without reading any data.

    Raises:
        InputError: a Megatron-Core run without a config.json.
    """
    from ckpttool.core.transforms import namemaps

    part = model(ckpt)
    pairs = [(t.name, t.tensor) for t in part.tensors]
    if namemaps.is_megatron(pairs):
        where = str(part.hf.config_path) if part.hf.config_path else None
        chosen = namemaps.implied(pairs, part.hf.config, config_path=where)
        if chosen is not None:
            mapped = namemaps.apply(chosen, pairs, part.hf.config, config_path=where)
            stored = {id(t): n for n, t in pairs}
            return Named(part, {n: View(n, src, _stored(src, stored, n))
                                for n, src in mapped.tensors}, chosen)
    return Named(part, {t.name: View(t.name, t.tensor, t.stored_name) for t in part.tensors})


def _stored(src: Tensor | Derived, stored: dict[int, str], name: str) -> str:
    t = src if isinstance(src, Tensor) else src.inputs[0] if src.inputs else None
    return stored.get(id(t), name) if t is not None else name


@dataclass(frozen=True)
class Entry:
    """One canonical name: its tensor in A and in B (None: not there), and, for a tied copy
    stored once, the partner that stands for it on that side."""

    name: str
    a: View | None
    b: View | None
    a_tied: bool = False  # ``a`` is the partner of ``name`` in A (stored once there)
    b_tied: bool = False

    @property
    def status(self) -> str | None:
        """The status known before any byte is read; None: compare the bytes."""
        if self.a is None:
            return ADDED
        if self.b is None:
            return REMOVED
        if self.a.shape != self.b.shape:
            return RESHAPED
        if self.a.dtype != self.b.dtype:
            return DTYPE_CHANGED
        return None


@dataclass(frozen=True)
class DiffPlan:
    entries: tuple[Entry, ...]  # sorted by name

    def names(self, side: str) -> list[str]:
        """The names stored in ``side`` (``"a"`` or ``"b"``) that the plan covers."""
        if side == "a":
            return [e.name for e in self.entries if e.a is not None and not e.a_tied]
        return [e.name for e in self.entries if e.b is not None and not e.b_tied]


def model(ckpt: Checkpoint) -> Checkpoint:
    """The part a diff compares: the model of a training checkpoint (its optimizer state is
    not what a delta carries), else all of it."""
    from ckpttool.core.checkpoint.discover import select

    return select(ckpt, ckpt.kind) if ckpt.has_part(ckpt.kind) else ckpt


def matches(name: str, stored: str, pattern: str | None) -> bool:
    """``--filter``: a glob on the canonical or the stored name, as ``inspect`` takes it."""
    return pattern is None or fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(
        stored, pattern)


def plan_diff(a: Named, b: Named, *, pattern: str | None = None) -> DiffPlan:
    """Pair the tensors of ``a`` and ``b`` by canonical name (``pattern``: only the names
    that match on either side)."""
    names_a, names_b = a.by_name(), b.by_name()
    entries = []
    for name in sorted(names_a.keys() | names_b.keys()):
        ta, tb = names_a.get(name), names_b.get(name)
        a_tied = b_tied = False
        if ta is None and tb is not None:
            ta = _stand_in(a, b, name)
            a_tied = ta is not None
        elif tb is None and ta is not None:
            tb = _stand_in(b, a, name)
            b_tied = tb is not None
        shown = [t.stored_name for t in (ta, tb) if t is not None]
        if not any(matches(name, s, pattern) for s in shown):
            continue
        entries.append(Entry(name, ta, tb, a_tied, b_tied))
    return DiffPlan(tuple(entries))


def _stand_in(side: Named, other: Named, name: str) -> View | None:
    """The tensor of ``side`` that stands for ``name``, which ``side`` lacks: its tie partner,
    where ``other`` holds the pair, ``side`` holds the partner with the same shape,
    and ``side``'s config does not untie them (a dtype that differs is reported as such)."""
    pair = ties.find_pair(other.by_name())
    if pair is None or pair[0] != name or hf.ties_word_embeddings(side.hf.config) is False:
        return None
    partner = side.by_name().get(pair[1])
    if partner is None or partner.shape != other.by_name()[name].shape:
        return None
    return partner
