"""``diff A B --write-delta DIR``: what rebuilds B from A, and the file that says so.

A delta directory holds ``delta.safetensors`` (per tensor of B that is not A's: its changed
elements as flat int64 ``indices`` and their ``values``, where that is smaller than the tensor,
else the whole tensor), ``delta.json`` (how each tensor of B is made, and A's and B's contents
as ``verify --write-manifest`` manifests: a SHA-256 per tensor under canonical names) and
B's config and tokenizer files. Written as merge writes: temporary names, published complete,
``delta.json`` last.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.core.diff import stream
from ckpttool.core.diff.plan import CHANGED, IDENTICAL, DiffPlan, Named, View
from ckpttool.core.diff.values import bits, changed_positions
from ckpttool.core.runtime.report import SCHEMA, Section, section
from ckpttool.core.verify import manifest
from ckpttool.errors import InputError, OutputError
from ckpttool.formats import safetensors
from ckpttool.formats.base import Reader
from ckpttool.formats.codecs.dtypes import DType, get
from ckpttool.storage.outputs import (
    AtomicOutputs,
    check_apart,
    check_space,
    existing_outputs,
    pwrite_all,
    remove_stale,
)

if TYPE_CHECKING:
    from ckpttool.core.diff.values import Measured

DELTA_KIND = "ckpttool-delta"
DELTA_JSON = "delta.json"
DELTA_DATA = "delta.safetensors"
INDICES, VALUES = ":indices", ":values"  # a sparse tensor's two entries: NAME:indices...
INDEX = get("I64")
OWN = (DELTA_JSON, DELTA_DATA)
BLOCK_BYTES = 8 << 20

# How a tensor of B is made: A's tensor as it is, A's with elements replaced, or stored whole.
BASE, SPARSE, WHOLE = "base", "sparse", "whole"


@section
class DeltaSummary(Section):
    """``diff``'s ``delta``: where it was written, how many tensors of B each way, its size."""

    path: str
    from_base: int
    sparse: int
    whole: int
    bytes: int


@dataclass(frozen=True)
class Recipe:
    """How one tensor of B is made."""

    name: str
    how: str  # BASE, SPARSE or WHOLE
    source: str | None  # A's name (BASE, SPARSE)
    dtype: DType
    shape: tuple[int, ...]
    num_changed: int = 0  # SPARSE: elements replaced


def plan_recipes(plan: DiffPlan, measured: Sequence[Measured]) -> list[Recipe]:
    """Per tensor stored in B: the smallest way to make it from A. Pure."""
    out = []
    for e, m in zip(plan.entries, measured, strict=True):
        if e.b is None or e.b_tied:
            continue  # not stored in B
        dtype, shape = e.b.dtype, e.b.shape
        source = e.a.name if e.a is not None else None
        k = m.row.changed_elements
        if m.row.status == IDENTICAL:
            out.append(Recipe(e.name, BASE, source, dtype, shape))
        elif m.row.status == CHANGED and k is not None and k * (
                INDEX.itemsize + dtype.itemsize) < e.b.nbytes:
            out.append(Recipe(e.name, SPARSE, source, dtype, shape, k))
        else:
            out.append(Recipe(e.name, WHOLE, None, dtype, shape))
    return out


def entries(recipes: Sequence[Recipe]) -> list[tuple[str, DType, tuple[int, ...]]]:
    """The tensors of ``delta.safetensors``."""
    out: list[tuple[str, DType, tuple[int, ...]]] = []
    for r in recipes:
        if r.how == WHOLE:
            out.append((r.name, r.dtype, r.shape))
        elif r.how == SPARSE:
            out += [(r.name + INDICES, INDEX, (r.num_changed,)),
                    (r.name + VALUES, r.dtype, (r.num_changed,))]
    return out


def _taken(name: str, extra: set[str]) -> bool:
    return name in (DELTA_JSON, DELTA_DATA) or name in extra


def check_output(out: Path, *, overwrite: bool, sources: Sequence[Named]) -> None:
    """DIR is apart from A and B and holds no delta, unless ``overwrite``. Creates nothing.

    Raises:
        OutputError: it is inside a source or holds a delta already.
    """
    check_apart(out, *(s.root for s in sources))
    extra = {name for name, _ in sources[-1].hf.named()}
    existing = existing_outputs(out, lambda n: _taken(n, extra))
    if existing and not overwrite:
        raise OutputError(f"{out}: already holds {existing[0]}; pass --overwrite to replace "
                          "it or choose an empty directory")


def write(out: Path, plan: DiffPlan, measured: Sequence[Measured], a: Named, b: Named,
          reader_a: Reader, reader_b: Reader, *, overwrite: bool) -> DeltaSummary:
    """Write the delta of ``plan`` (measured, with digests) into ``out``.

    Raises:
        InputError: A or B changed since they were compared.
        OutputError: ``out`` cannot be written.
    """
    recipes = plan_recipes(plan, measured)
    layout = safetensors.layout(entries(recipes), {"format": "pt", "written_by": "ckpttool diff"})
    slots = {s.name: s for s in layout.slots}
    files = dict(b.hf.named())
    doc = {
        "schema": SCHEMA,
        "kind": DELTA_KIND,
        "about": "rebuilds B from A: ckpttool apply A DELTA OUT",
        "data": DELTA_DATA,
        "files": sorted(files),
        "a": document(a, {e.name: m.sha_a for e, m in zip(plan.entries, measured, strict=True)
                          if m.sha_a}),
        "b": document(b, {e.name: m.sha_b for e, m in zip(plan.entries, measured, strict=True)
                          if m.sha_b}),
        "tensors": {r.name: {"how": r.how, **({"from": r.source} if r.source else {})}
                    for r in recipes},
    }
    check_space(out, layout.file_size)
    by_b = {e.name: e for e in plan.entries}

    def check() -> None:
        check_output(out, overwrite=overwrite, sources=(a, b))

    with AtomicOutputs(out, check=check) as outputs:
        fd = outputs.create(DELTA_DATA, layout.file_size)
        pwrite_all(fd, layout.header, 0)
        for r in recipes:
            e = by_b[r.name]
            assert e.b is not None
            if r.how == WHOLE:
                _copy(reader_b, e.b, fd, slots[r.name].begin)
            elif r.how == SPARSE:
                assert e.a is not None
                _sparse(reader_a, e.a, reader_b, e.b, fd, slots[r.name + INDICES].begin,
                        slots[r.name + VALUES].begin, r.num_changed)
        for name, path in files.items():
            outputs.write_bytes(name, b.hf.read(path))
        outputs.write_bytes(DELTA_JSON, (json.dumps(doc, indent=1) + "\n").encode())
        keep = {DELTA_DATA, DELTA_JSON, *files}
        outputs.commit(last=(DELTA_JSON,), before_last=(
            lambda: remove_stale(out, keep, lambda n: _taken(n, set()))) if overwrite else None)
    return DeltaSummary(str(out), sum(r.how == BASE for r in recipes),
                        sum(r.how == SPARSE for r in recipes),
                        sum(r.how == WHOLE for r in recipes), layout.file_size)


def document(side: Named, digests: dict[str, str]) -> dict[str, Any]:
    """A side's manifest, as ``verify --write-manifest`` writes it (its ``kind``, schema and
    entries): under the names compared (a Megatron-Core run's Hugging Face names)."""
    return {
        "schema": SCHEMA,
        "kind": manifest.MANIFEST_KIND,
        "algorithm": "sha256",
        "about": "SHA-256 of each tensor's bytes in C order, under canonical names; any format",
        "tensors": {n: {"dtype": v.dtype.name, "shape": list(v.shape), "sha256": digests[n]}
                    for n, v in sorted(side.views.items()) if n in digests},
    }


def _copy(reader: Reader, t: View, fd: int, at: int) -> None:
    side = stream.Side(reader, t.source)
    step = max(1, BLOCK_BYTES // t.dtype.itemsize)
    buf = memoryview(bytearray(min(step, max(t.numel, 1)) * t.dtype.itemsize))
    for start in range(0, t.numel, step):
        for data in side.read(start, min(t.numel, start + step), buf):
            pwrite_all(fd, data, at + start * t.dtype.itemsize)


def _sparse(reader_a: Reader, a: View, reader_b: Reader, b: View, fd: int,
            at_indices: int, at_values: int, want: int) -> None:
    """The elements of B that differ from A: their numbers, then their values."""
    item = b.dtype.itemsize
    side_a, side_b = stream.Side(reader_a, a.source), stream.Side(reader_b, b.source)
    buf_a, buf_b = (memoryview(bytearray(BLOCK_BYTES)) for _ in range(2))
    done = 0
    for start, stop in stream.pairs(side_a, side_b, max(1, BLOCK_BYTES // item)):
        for da in side_a.read(start, stop, buf_a):
            for db in side_b.read(start, stop, buf_b):
                if stream.equal(da, db):
                    continue
                where = changed_positions(da, db, b.dtype)
                if done + len(where) > want:
                    break
                pwrite_all(fd, (where + start).tobytes(), at_indices + done * INDEX.itemsize)
                pwrite_all(fd, bits(db, b.dtype)[where].tobytes(), at_values + done * item)
                done += len(where)
    if done != want:
        raise InputError(f"tensor '{b.name}' changed while the delta was written (A or B is "
                         "being written to); run ckpttool diff again when they are complete")


def read(delta: Path) -> tuple[dict[str, Any], Path]:
    """A delta's ``delta.json`` and the path of its data file.

    Raises:
        InputError: not a delta written by ``ckpttool diff --write-delta``.
    """
    path = delta / DELTA_JSON if delta.is_dir() else delta
    hint = "pass a directory that ckpttool diff A B --write-delta DIR wrote"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"{path}: cannot read the delta ({e}); {hint}") from e
    if (not isinstance(doc, dict) or doc.get("kind") != DELTA_KIND
            or not all(isinstance(doc.get(k), dict) for k in ("a", "b", "tensors"))
            or not all(isinstance(doc[k].get("tensors"), dict) for k in ("a", "b"))
            or not isinstance(doc.get("files", []), list)):
        raise InputError(f"{path}: not a ckpttool delta; {hint}")
    return doc, path.parent / DELTA_DATA
