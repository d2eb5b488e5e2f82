"""What changed in a block of a tensor: which elements differ in their bits, and by how much
in value. numpy only (bfloat16 widened by a shift, 8-bit floats through a table); no torch
unless a tensor is an 8-bit float.

Identity is bitwise: a NaN whose payload changed, or 0.0 that became -0.0, is a changed
element. The sizes of a change (max_abs_diff, the L2 norms) leave out elements where either
side is NaN or infinite, so one NaN does not hide the size of everything else.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.core.runtime.report import Section, section
from ckpttool.formats.codecs.dtypes import DType

if TYPE_CHECKING:
    import numpy as np

_BITS = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}
# Elements looked at a time (:meth:`Change.add`): temporaries stay in the CPU's caches, and
# A's norm is summed in float32 over no more than this.
NORM_SPAN = 1 << 16


def bits(data: bytes | bytearray | memoryview, dtype: DType) -> np.ndarray[Any, Any]:
    """The elements as unsigned integers of their width (complex64: 8 bytes)."""
    import numpy as np

    return np.frombuffer(data, dtype=_BITS[dtype.itemsize])


def changed_positions(a: bytes | bytearray | memoryview, b: bytes | bytearray | memoryview,
                      dtype: DType) -> np.ndarray[Any, Any]:
    """Element numbers (int64, ascending) where the two blocks differ in their bits."""
    import numpy as np

    where = np.flatnonzero(bits(a, dtype) != bits(b, dtype))
    return where if where.dtype == np.int64 else where.astype(np.int64)


def as_float(raw: np.ndarray[Any, Any], dtype: DType) -> np.ndarray[Any, Any]:
    """Elements (given as their bits, :func:`bits`) as float64 (complex128 for C64)."""
    import numpy as np

    name = dtype.name
    if name == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype.kind == "float8":
        table: np.ndarray[Any, Any] = _float8_table(name)
        return table.take(raw)
    view = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
            "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "u1",
            "C64": "<c8"}[name]
    out = raw.view(view)
    return out.astype(np.complex128 if name == "C64" else np.float64)


def _as_float32(raw: np.ndarray[Any, Any], dtype: DType) -> np.ndarray[Any, Any] | None:
    """BF16, F16 and F32 elements (as their bits) as float32 (exact); None for any other."""
    import numpy as np

    if dtype.name == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype.name == "F16":
        return raw.view("<f2").astype(np.float32)
    if dtype.name == "F32":
        return raw.view("<f4")
    return None


@functools.cache
def _float8_table(name: str) -> np.ndarray[Any, Any]:
    """The float64 value of each of the 256 bit patterns of an 8-bit float (torch's)."""
    import numpy as np
    import torch

    from ckpttool.formats.codecs.dtypes import get

    patterns = torch.arange(256, dtype=torch.uint8).view(getattr(torch, get(name).torch_name))
    return np.asarray(patterns.to(torch.float64).numpy(), dtype=np.float64)


@dataclass
class Change:
    """A tensor's change so far, block after block."""

    changed: int = 0
    max_abs: float = 0.0
    diff_sq: float = 0.0
    a_sq: float = 0.0

    def add(self, a: bytes | bytearray | memoryview, b: bytes | bytearray | memoryview,
            dtype: DType, *, compare: bool = True) -> None:
        """Add a block: the elements where ``a`` and ``b`` differ (``compare``) and A's share
        of ||A||^2, a span of :data:`NORM_SPAN` elements at a time (its temporaries stay in
        the CPU's caches)."""
        ra, rb = bits(a, dtype), bits(b, dtype)
        for lo in range(0, len(ra), NORM_SPAN):
            sa = ra[lo : lo + NORM_SPAN]
            if compare:
                self._changes(sa, rb[lo : lo + NORM_SPAN], dtype)
            self._norm(sa, dtype)

    def _changes(self, ra: np.ndarray[Any, Any], rb: np.ndarray[Any, Any], dtype: DType
                 ) -> None:
        import numpy as np

        where = np.flatnonzero(ra != rb)
        if not len(where):
            return
        self.changed += len(where)
        va, vb = as_float(ra[where], dtype), as_float(rb[where], dtype)
        finite = np.isfinite(va) & np.isfinite(vb)
        d = np.abs(vb[finite] - va[finite])
        if len(d):
            self.max_abs = max(self.max_abs, float(d.max()))
            self.diff_sq += float(np.dot(d, d))

    def _norm(self, ra: np.ndarray[Any, Any], dtype: DType) -> None:
        """A's share of ||A||^2 (finite elements). Floats of up to 32 bits are squared and
        summed in float32 by BLAS, the spans summed in float64 (a norm to about 1e-6, at
        memory speed); a span that holds a NaN or an infinity, or overflows, is summed again
        exactly, leaving those out."""
        import numpy as np

        wide = _as_float32(ra, dtype)
        if wide is not None:
            fast = float(np.dot(wide, wide))
            if math.isfinite(fast):
                self.a_sq += fast
                return
        v = as_float(ra, dtype)
        v = np.abs(v[np.isfinite(v)])
        self.a_sq += float(np.dot(v, v))

    @property
    def rel_l2(self) -> float | None:
        """||B - A|| / ||A|| over finite elements, to 7 significant digits; None where A's
        norm is 0 and B's is not."""
        if not self.diff_sq:
            return 0.0
        if not self.a_sq:
            return None
        # To the digits the float32 sums of ||A|| carry (:meth:`_norm`), no more.
        return float(f"{math.sqrt(self.diff_sq) / math.sqrt(self.a_sq):.7g}")


@section
class TensorDiff(Section):
    """One row of ``diff``'s ``tensors``: the canonical name, its status and, for a tensor of
    one dtype and shape on both sides, the elements whose bits changed, the largest absolute
    change and ||B - A|| / ||A|| (None where not defined: added, removed, reshaped,
    dtype-changed; ``rel_l2`` also where ||A|| is 0 and B is not)."""

    name: str
    status: str
    changed_elements: int | None
    max_abs_diff: float | None
    rel_l2: float | None


@dataclass
class Measured:
    """What the data pass found for one entry (digests only where asked)."""

    row: TensorDiff
    sha_a: str | None = None
    sha_b: str | None = None
    bytes_read: int = 0
