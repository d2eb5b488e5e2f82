"""``verify --against``: which tensors of two checkpoints to compare and how (pure), the
streaming comparison fed by the data pass, and what a tensor on one side only means (a tied
copy stored once is not missing).

A merge's output is held to its source through the maps the merge used: save_pretrained's
hub layout (fused experts split, vision-language prefixes moved), and, where the source's
names are no model's, the LoRA fold (PEFT's ``.default`` names) or the name map (Megatron's
implied one, or ``names``). The output names and sources come from the same public planning
functions merge calls; a renamed stored tensor is compared as it streams by, a computed one
(a folded weight, a split or permuted part) is made as merge makes it and compared whole
after the pass (:func:`compare_computed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.core import quantization, ties
from ckpttool.core.checkpoint import hf, tensors
from ckpttool.core.checkpoint.discover import Checkpoint, TensorView, select
from ckpttool.core.dtype_policy import DTypePolicy
from ckpttool.core.runtime.report import Progress
from ckpttool.core.transforms import derive, hub_layout, maps, namemaps
from ckpttool.core.transforms.derive import Derived
from ckpttool.core.transforms.lora.layout import parse as parse_adapter
from ckpttool.core.transforms.lora.plan import plan_for_merge
from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats.base import Problem, Reader, Tensor, error, info
from ckpttool.formats.codecs.dtypes import DType


@dataclass(frozen=True)
class Pair:
    a: TensorView
    b: TensorView
    cast: str | None  # None: bytes must match; "a" or "b": that side is cast to the other's dtype
    # B's tensors that make A's in C order, each at its first element of A (merge's hub
    # layout: a fused expert tensor written per expert and part); empty: ``b`` alone
    parts: tuple[tuple[TensorView, int], ...] = ()

    @property
    def views_b(self) -> tuple[TensorView, ...]:
        return tuple(v for v, _ in self.parts) or (self.b,)


@dataclass(frozen=True)
class Computed:
    """An output tensor merge makes from A's tensors (a LoRA fold, a part a name map splits
    or permutes, a stored tensor a second time), compared whole with B's after the pass."""

    name: str  # the output's name (B's)
    source: Tensor | Derived  # of A
    b: TensorView  # B's tensor it must equal: the output's own, or its tie partner
    dtype: DType  # made in this dtype (B's, the cast merge applies)
    tie: str | None = None  # B lacks ``name``: its tie partner ``b`` must hold its bytes
    # ``verify OUT --against SRC``: ``source`` is OTHER's (made with its reader) and ``b``
    # PATH's output tensor
    reverse: bool = False


@dataclass(frozen=True)
class AgainstPlan:
    pairs: tuple[Pair, ...]
    problems: tuple[Problem, ...]
    # Names present on one side only but with their tie partner on both: decided after the
    # data pass (a deduplicated tie is not an error).
    tied_missing: tuple[tuple[str, str], ...]  # (missing from B, its partner), A's names
    tied_extra: tuple[tuple[str, str], ...]  # (missing from A, its partner), B's names
    computed: tuple[Computed, ...] = ()  # made from A as merge makes them, after the pass


@dataclass(frozen=True)
class Through:
    """The tensors merge writes of a source whose names are no model's: (output name,
    source) as merge plans them, and what made them (for messages)."""

    what: str  # "the LoRA fold (scale 2.0)", "the name map megatron-qwen3"
    sources: tuple[tuple[str, Tensor | Derived], ...]


def plan_against(a: Checkpoint, b: Checkpoint, *, policy: DTypePolicy | None,
                 names: str | None = None, adapter_config: Path | None = None,
                 lora_alpha: float | None = None) -> AgainstPlan:
    """Match tensors of ``a`` and ``b`` by canonical name, or through the map merge applies to
    ``a`` (:func:`through`: a LoRA fold, a name map). ``policy`` (``--allow-cast``): the dtype
    conversion that ``merge --dtype`` would apply; without it dtypes must be equal.

    Args:
        names, adapter_config, lora_alpha: as given to the merge that made ``b``.
    """
    # B under A's own names (merged with --names none, or the same format twice): by name
    same = names is None and set(b.by_name()) <= set(a.by_name())
    try:
        mapped = (None if same else through(a, b, names=names, adapter_config=adapter_config,
                                            lora_alpha=lora_alpha))
    except (InputError, UnsupportedError) as e:
        return AgainstPlan((), (error("against-unmapped", f"{a.root}: its tensors cannot be "
                                      f"made as merge makes them, to compare with {b.root}: "
                                      f"{e}"),), (), ())
    if mapped is not None:
        return _plan_through(a, b, mapped, policy)
    try:  # verify OUT --against SRC: the same, the other way round
        back = (through(b, a, adapter_config=adapter_config, lora_alpha=lora_alpha)
                if names is None and not set(a.by_name()) <= set(b.by_name()) else None)
    except (InputError, UnsupportedError):
        back = None
    if back is not None:
        return _plan_through(b, a, back, policy, reverse=True)
    names_a, names_b = a.by_name(), b.by_name()
    problems: list[Problem] = []
    tied_missing: list[tuple[str, str]] = []
    tied_extra: list[tuple[str, str]] = []
    pairs: list[Pair] = []
    # The scales of quantized weights: compared as stored, a cast of one is an error.
    scales = (quantization.kept_names(((n, t.dtype) for n, t in names_a.items()), a.hf.config)
              | quantization.kept_names(((n, t.dtype) for n, t in names_b.items()),
                                        b.hf.config))

    def partner(ckpt: Checkpoint, name: str) -> str | None:
        pair = ties.find_pair(ckpt.by_name())
        if pair is None or name not in pair:
            return None
        return pair[1] if name == pair[0] else pair[0]

    layout = _hub_parts(names_a, names_b, a.hf.config or b.hf.config)
    taken: set[str] = set()
    for name, ta in names_a.items():
        tb = names_b.get(name)
        parts = layout.get(name) if tb is None else None
        if parts is not None:  # written in save_pretrained's layout, as merge writes it
            pair = _parts_pair(ta, parts, policy, a, b, problems)
            taken.update(v.name for v, _ in parts)
            if pair is not None:
                pairs.append(pair)
            continue
        if tb is None:
            other = partner(a, name)
            if other is not None and other in names_b:
                tied_missing.append((name, other))
            else:
                problems.append(error("missing-tensor", f"tensor '{name}' ({ta.dtype.name} "
                                       f"{list(ta.shape)}) is in {a.root} but not in {b.root}",
                                       tensor=name))
            continue
        if ta.shape != tb.shape:
            problems.append(error("shape-differs", f"tensor '{name}' is {list(ta.shape)} in "
                                   f"{a.root} but {list(tb.shape)} in {b.root}", tensor=name))
            continue
        cast_scale = quantization.check_casts([(name, ta.dtype, tb.dtype)], scales)
        if cast_scale:
            problems += cast_scale
            continue
        cast = _cast_side(ta.dtype, tb.dtype, policy)
        if ta.dtype != tb.dtype and cast is None:
            hint = (" (pass --allow-cast, with --dtype, to compare after the cast merge applies)"
                    if ta.dtype.is_float and tb.dtype.is_float else "")
            problems.append(error("dtype-differs", f"tensor '{name}' is {ta.dtype.name} in "
                                   f"{a.root} but {tb.dtype.name} in {b.root}{hint}", tensor=name))
            continue
        pairs.append(Pair(ta, tb, cast))
    for name, tb in names_b.items():
        if name in names_a or name in taken:
            continue
        other = partner(b, name)
        if other is not None and other in names_a:
            tied_extra.append((name, other))
        else:
            problems.append(error("extra-tensor", f"tensor '{name}' ({tb.dtype.name} "
                                   f"{list(tb.shape)}) is in {b.root} but not in {a.root}",
                                   tensor=name))
    return AgainstPlan(tuple(pairs), tuple(problems), tuple(tied_missing), tuple(tied_extra))


def through(a: Checkpoint, b: Checkpoint, *, names: str | None = None,
            adapter_config: Path | None = None, lora_alpha: float | None = None
            ) -> Through | None:
    """What merge writes of ``a``'s model where its names are not the output's: the LoRA
    fold (or the adapter alone, where ``b`` holds one), else the name map (``names``, or the
    one a Megatron-Core model implies); None where merge keeps the stored names (the hub
    layout is matched apart, :func:`_hub_parts`). The config is ``a``'s, else ``b``'s (the
    one a merge derived and wrote).

    Raises:
        InputError, UnsupportedError: as merge with the same options would.
    """
    if a.kind != "model" or names == maps.KEEP:
        return None
    if a.has_part(a.kind):  # the model of a training checkpoint (its optimizer apart)
        a = select(a, a.kind)
    named = [(t.name, t.tensor) for t in a.tensors]
    mode = "adapter" if parse_adapter([(t.name, t.tensor) for t in b.tensors]) else None
    adapted = (plan_for_merge(a, named, mode, None, adapter_config,
                                       lora_alpha=lora_alpha)
               if names is None and parse_adapter(named) is not None else None)
    if adapted is not None:
        summary = adapted.report.summary
        what = ("the LoRA adapter as merge --lora adapter writes it" if adapted.mode == "adapter"
                else f"the LoRA fold (alpha {summary.alpha:g}, rank {summary.rank})"
                if summary.alpha is not None else "the LoRA fold")
        return Through(what, tuple(adapted.sources))
    config = a.hf.config or b.hf.config
    path = a.hf.config_path or b.hf.config_path
    config_path = str(path) if path is not None else None
    chosen = names or namemaps.implied(named, config, config_path=config_path)
    if chosen is None:
        return None
    mapped = namemaps.apply(chosen, named, config, config_path=config_path,
                            asked=names is not None)
    return Through(f"the name map {chosen}", tuple(mapped.tensors))


def _plan_through(a: Checkpoint, b: Checkpoint, mapped: Through,
                  policy: DTypePolicy | None, *, reverse: bool = False) -> AgainstPlan:
    """``b`` held to the tensors merge makes of ``a`` (``mapped``): a stored tensor under its
    output name is compared as it streams by (a :class:`Pair`), anything computed after the
    pass (a :class:`Computed`); a tied copy merge left out must equal its partner in ``b``.
    ``reverse``: ``a`` is verify's OTHER and ``b`` its PATH (every comparison after the pass,
    ``missing`` and ``extra`` as seen from PATH)."""
    missing, extra = ("extra-tensor", "missing-tensor") if reverse else ("missing-tensor",
                                                                           "extra-tensor")
    names_b = b.by_name()
    views = {id(t.tensor): t for t in a.tensors}
    outputs = dict(mapped.sources)
    problems = [info("against-mapped", f"{a.root} compared with {b.root} as merge writes it: "
                     f"through {mapped.what}")]
    pairs: list[Pair] = []
    computed: list[Computed] = []
    streamed: set[str] = set()
    pair = ties.find_pair({n: _Shape(s.shape) for n, s in outputs.items()})
    for name, source in outputs.items():
        tb = names_b.get(name)
        tie = None
        if tb is None and pair is not None and name in pair:
            tie = pair[1] if name == pair[0] else pair[0]
            tb = names_b.get(tie)
            if tb is None or hf.ties_word_embeddings(a.hf.config or b.hf.config) is False:
                tb, tie = None, None
        if tb is None:
            made = "" if isinstance(source, Tensor) else f", made by {mapped.what}"
            problems.append(error(missing, f"tensor '{name}' ({source.dtype.name} "
                                   f"{list(source.shape)}{made}) is what merge writes of "
                                   f"{a.root} but not in {b.root}", tensor=name))
            continue
        if tuple(source.shape) != tuple(tb.shape):
            problems.append(error("shape-differs", f"tensor '{name}' is {list(source.shape)} "
                                   f"as merge makes it of {a.root} but {list(tb.shape)} in "
                                   f"{b.root}", tensor=name))
            continue
        cast = _cast_side(source.dtype, tb.dtype, policy)
        if source.dtype != tb.dtype and cast != "a":
            problems.append(error("dtype-differs", f"tensor '{name}' is {source.dtype.name} as "
                                   f"merge makes it of {a.root} but {tb.dtype.name} in "
                                   f"{b.root} (pass --allow-cast, with --dtype, to compare "
                                   "after the cast merge applies)", tensor=name))
            continue
        view = views.get(id(source)) if isinstance(source, Tensor) else None
        if view is not None and tie is None and view.stored_name not in streamed and not reverse:
            streamed.add(view.stored_name)
            pairs.append(Pair(view, tb, cast))
        else:
            computed.append(Computed(name, source, tb, tb.dtype, tie, reverse))
    for name, tb in names_b.items():
        if name not in outputs:
            problems.append(error(extra, f"tensor '{name}' ({tb.dtype.name} "
                                   f"{list(tb.shape)}) is in {b.root} but not in what merge "
                                   f"writes of {a.root} (through {mapped.what})", tensor=name))
    return AgainstPlan(tuple(pairs), tuple(problems), (), (), tuple(computed))


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]


def compare_computed(a: Checkpoint, b: Checkpoint, plan: AgainstPlan, reader_a: Reader,
                     reader_b: Reader, report: Progress, *, skip: set[str],
                     skip_b: set[str]) -> list[Problem]:
    """Each :class:`Computed` of ``plan`` made from ``a`` as merge makes it (the same
    planned source, the same cast) and compared whole with ``b``'s tensor; one output tensor
    in memory at a time. ``skip``, ``skip_b``: stored names found damaged (reported
    already)."""
    problems: list[Problem] = []
    for c in plan.computed:
        # made of the source (A, or OTHER for ``verify OUT --against SRC``), compared with
        # the output's tensor
        src, out = (b, a) if c.reverse else (a, b)
        read_src, read_out = (reader_b, reader_a) if c.reverse else (reader_a, reader_b)
        skip_src, skip_out = (skip_b, skip) if c.reverse else (skip, skip_b)
        inputs = c.source.inputs if isinstance(c.source, Derived) else (c.source,)
        if any(t.name in skip_src for t in inputs) or c.b.stored_name in skip_out:
            continue
        try:
            made = (derive.materialise(read_src, c.source, c.dtype)
                    if isinstance(c.source, Derived)
                    else _cast_bytes(read_src, c.source, c.dtype))
            held = tensors.read_range(read_out, c.b.tensor, 0, math.prod(c.b.shape))
        except InputError as e:
            problems.append(error("read-error", str(e), tensor=c.name))
            continue
        report(len(held))
        if made == held:
            if c.tie is not None:
                problems.append(info("tie-deduplicated", f"'{c.name}' is not in {out.root}, "
                                     f"but merge's '{c.name}' is identical to '{c.tie}' there: "
                                     "a tied copy stored once", tensor=c.name))
            continue
        if c.tie is not None:
            problems.append(error("extra-tensor" if c.reverse else "missing-tensor",
                                  f"tensor '{c.name}' of what merge writes of {src.root} is "
                                  f"not in {out.root}, and differs from its tie partner "
                                  f"'{c.tie}' there", tensor=c.name))
            continue
        element = tensors.first_difference(memoryview(made), held) // c.dtype.itemsize
        what = (c.source.what or "computed") if isinstance(c.source, Derived) else "copied"
        problems.append(error(
            "data-differs", f"tensor '{c.name}' differs between what merge makes of "
            f"{src.root} ({what}) and {out.root}: first at element {element} (index "
            f"{list(tensors.unravel(element, c.b.shape))})", tensor=c.name,
            **_location(read_out, c.b, element)))
    return problems


def _cast_bytes(reader: Reader, tensor: Tensor, dtype: DType) -> bytearray:
    """A stored tensor's bytes in C order, cast to ``dtype`` as merge casts a copy."""
    if tensor.dtype == dtype:
        return tensors.read_range(reader, tensor, 0, tensor.numel)
    return derive.materialise(reader, Derived(tensor.name, (tensor,), tensor.dtype,
                                              tensor.shape, derive.identity), dtype)


def _hub_parts(names_a: dict[str, TensorView], names_b: dict[str, TensorView],
               config: dict[str, Any] | None) -> dict[str, tuple[tuple[TensorView, int], ...]]:
    """A's tensors that B holds only in save_pretrained's layout (the same table merge used,
    :mod:`ckpttool.core.transforms.hub_layout`): their parts in B, each at its first element
    of A (a part of a fused tensor is one contiguous range of it)."""
    if config is None:
        return {}
    out: dict[str, tuple[tuple[TensorView, int], ...]] = {}
    for name, ta in names_a.items():
        if name in names_b:
            continue
        try:
            converted = hub_layout.convert([(name, ta.tensor)], config)
        except InputError:
            continue
        if converted is None or not all(n in names_b for n, _ in converted.sources):
            continue
        parts, start = [], 0
        for hub, source in converted.sources:
            parts.append((names_b[hub], start))
            start += math.prod(source.shape)
        out[name] = tuple(parts)
    return out


def _parts_pair(ta: TensorView, parts: tuple[tuple[TensorView, int], ...],
                policy: DTypePolicy | None, a: Checkpoint, b: Checkpoint,
                problems: list[Problem]) -> Pair | None:
    first = parts[0][0]
    sizes = [math.prod(v.shape) for v, _ in parts]
    if sum(sizes) != math.prod(ta.shape) or len({v.dtype for v, _ in parts}) != 1:
        problems.append(error("shape-differs", f"tensor '{ta.name}' {list(ta.shape)} in "
                               f"{a.root} is not what its parts in {b.root} make (e.g. "
                               f"'{first.name}' {list(first.shape)})", tensor=ta.name))
        return None
    cast = _cast_side(ta.dtype, first.dtype, policy)
    if ta.dtype != first.dtype and cast is None:
        problems.append(error("dtype-differs", f"tensor '{ta.name}' is {ta.dtype.name} in "
                               f"{a.root} but {first.dtype.name} in {b.root} ('{first.name}')",
                               tensor=ta.name))
        return None
    return Pair(ta, first, cast, parts)


def _cast_side(da: DType, db: DType, policy: DTypePolicy | None) -> str | None:
    if da == db or policy is None:
        return None
    if policy.output_dtype(da) == db:
        return "a"
    if policy.output_dtype(db) == da:
        return "b"
    return None



class Compare:
    """Feeds blocks of a tensor of A and compares them with the same elements of B."""

    def __init__(self, pair: Pair, a: Checkpoint, b: Checkpoint, reader_b: Reader,
                 report: Progress) -> None:
        self.pair, self.a, self.b, self.reader_b, self.report = pair, a, b, reader_b, report
        self.problem: Problem | None = None
        self.bytes_read = 0

    def feed(self, start: int, data: memoryview) -> None:
        if self.problem is not None:
            return
        pair = self.pair
        n = len(data) // pair.a.dtype.itemsize
        try:
            other = self._read_b(start, start + n)
        except InputError as e:
            self.problem = error("read-error", f"{e}", file=pair.b.files[0],
                                  tensor=pair.b.name)
            return
        self.report(len(other))
        self.bytes_read += len(other)
        if pair.cast is None:
            # bytearray first: its == is one memcmp; a memoryview's compares item by item
            # (measured: 40 GB/s against 0.26 GB/s).
            if other == data:
                return
            first = tensors.first_difference(data, other) // pair.a.dtype.itemsize
        else:
            found = cast_difference(data, pair.a.dtype, other, pair.b.dtype, pair.cast)
            if found is None:
                return
            first = found
        element = start + first
        index = tensors.unravel(element, pair.a.shape)
        where_b, element_b = self._part_at(element)
        how = ""
        if pair.cast is not None:
            src_dt, dst_dt = ((pair.a.dtype, pair.b.dtype) if pair.cast == "a"
                              else (pair.b.dtype, pair.a.dtype))
            how = f" after casting {src_dt.name} to {dst_dt.name}"
        self.problem = error(
            "data-differs", f"tensor '{pair.a.name}' differs between {self.a.root} and "
            f"{self.b.root}{how}: first at element {element} (index {list(index)})",
            tensor=pair.a.name, **_location(self.reader_b, where_b, element_b))

    def _read_b(self, start: int, stop: int) -> bytearray:
        """Elements [start, stop) of A's tensor as B holds them (across its parts)."""
        pair = self.pair
        if not pair.parts:
            return tensors.read_range(self.reader_b, pair.b.tensor, start, stop)
        out = bytearray()
        for view, first in pair.parts:
            lo, hi = max(start, first), min(stop, first + math.prod(view.shape))
            if lo < hi:
                out += tensors.read_range(self.reader_b, view.tensor, lo - first, hi - first)
        return out

    def _part_at(self, element: int) -> tuple[TensorView, int]:
        for view, first in reversed(self.pair.parts):
            if element >= first:
                return view, element - first
        return self.pair.b, element



def cast_difference(a: memoryview, da: DType, b: bytearray, db: DType, side: str) -> int | None:
    """First element where A and B differ once ``side`` is cast to the other's dtype; a NaN
    equals a NaN (PyTorch's casts do not fix the NaN payload)."""
    import torch  # only a cast needs torch

    ta = torch.frombuffer(a, dtype=getattr(torch, da.torch_name))
    tb = torch.frombuffer(b, dtype=getattr(torch, db.torch_name))
    if side == "a":
        ta = ta.to(tb.dtype)
    else:
        tb = tb.to(ta.dtype)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ta.element_size()]
    diff = ta.view(bits) != tb.view(bits)
    if ta.is_floating_point():
        diff &= ~(torch.isnan(ta) & torch.isnan(tb))
    where = diff.nonzero()
    return int(where[0, 0]) if where.numel() else None



def decide_tied(a: Checkpoint, b: Checkpoint, plan: AgainstPlan, equal: dict[str, bool | None],
                digests: dict[str, str], reader_b: Reader, report: Progress) -> list[Problem]:
    """A tensor on one side only whose tie partner is on both: fine when it is identical to
    that partner (a deduplicated tie, as merge writes it), unless the config unties them."""
    problems = []
    config_ties = hf.ties_word_embeddings(a.hf.config)
    for name, partner in plan.tied_missing:
        equal_partner = equal.get(partner)
        identical = name in digests and digests.get(name) == digests.get(partner)
        if identical and equal_partner and config_ties is not False:
            problems.append(info("tie-deduplicated", f"'{name}' is not in {b.root}, but it is "
                                  f"identical to '{partner}' here: a tied copy stored once",
                                  tensor=name))
        else:
            why = _not_a_tie(partner, identical=identical, partner_equal=equal_partner,
                             untied=config_ties is False)
            problems.append(error("missing-tensor", f"tensor '{name}' is in {a.root} but not "
                                   f"in {b.root} ({why}), so it is not a deduplicated tie",
                                   tensor=name))
    by_b = b.by_name()
    for name, partner in plan.tied_extra:
        equal_partner = equal.get(partner)
        try:
            identical = tensors.identical(reader_b, by_b[name].tensor, reader_b,
                                          by_b[partner].tensor, report)
        except InputError:
            identical = False
        if identical and equal_partner:
            problems.append(info("tie-deduplicated", f"'{name}' is only in {b.root}, where it "
                                  f"is identical to '{partner}': a tied copy stored once here",
                                  tensor=name))
        else:
            why = _not_a_tie(partner, identical=identical, partner_equal=equal_partner)
            problems.append(error("extra-tensor", f"tensor '{name}' is in {b.root} but not in "
                                   f"{a.root} ({why}), so it is not a deduplicated tie",
                                   tensor=name))
    return problems


def _not_a_tie(partner: str, *, identical: bool, partner_equal: bool | None,
               untied: bool = False) -> str:
    """Why a copy on one side only is not a deduplicated tie of ``partner``."""
    if not identical:
        return f"it differs from its tie partner '{partner}'"
    if untied:
        return f"config.json unties it from '{partner}'"
    if partner_equal is None:
        return f"its tie partner '{partner}' was not compared: see that error"
    return f"its tie partner '{partner}' differs between the two"


def _location(reader: Reader, t: TensorView, element: int) -> dict[str, Any]:
    file, offset = tensors.locate(reader, t.tensor, element)
    return {"file": file, "offset": offset}
