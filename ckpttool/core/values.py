"""``verify``'s value checks (NaN, Inf, all-zero) from the bit patterns, without torch.

A floating value is NaN or infinite exactly when its exponent bits are all ones, and zero when
every bit but the sign is clear: integer comparisons on the stored bytes decide both, for the
IEEE formats (F64, F32, F16, BF16) as for integers and bools (all-zero: every byte clear). Per
block that is two integer maxima, viewed signed and unsigned (numpy, at memory speed and with
the interpreter lock released); the exact counts are taken only in a block where a maximum
says some value is not finite. ``import torch`` costs about a second, more than checking
3 GB this way; torch is used (:class:`Stats`) only where numpy is not
installed or for the float8 formats, whose special values differ from format to format.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

from ckpttool.formats.codecs.dtypes import DType

# Exponent mask of each IEEE format, by safetensors name (sign bit: the top one).
_EXPONENT = {"F64": 0x7FF0_0000_0000_0000, "F32": 0x7F80_0000, "F16": 0x7C00, "BF16": 0x7F80}
# Integer dtypes whose all-zero check is "every byte clear". (U64 and complex: no value checks,
# as in Stats.)
_INTEGER = frozenset({"I64", "I32", "I16", "I8", "U32", "U16", "U8", "BOOL"})


# --------------------------------------------------------------------------------------------
# Values with torch: min, max, mean, NaN and Inf counts (inspect --stats; verify's fallback)


@dataclass
class TensorStats:
    min: float | None = None  # over finite values
    max: float | None = None
    mean: float | None = None
    abs_max: float | None = None
    nan: int = 0
    inf: int = 0
    all_zero: bool | None = None  # None: not known (an empty tensor, an unsupported dtype)

    def to_json(self) -> dict[str, Any]:
        return {"min": self.min, "max": self.max, "mean": self.mean, "abs_max": self.abs_max,
                "nan": self.nan, "inf": self.inf, "all_zero": self.all_zero}


class Stats:
    """Accumulates :class:`TensorStats` over a tensor's blocks.

    ``full=False`` (what ``verify`` needs) costs one min/max pass per block: NaN and Inf are
    counted only in blocks whose extremes are not finite, and all-zero follows from the
    extremes. ``full=True`` adds the mean.
    """

    _SUB = 4 << 20  # elements converted at once for float8 (to float32)
    # Blocks smaller than this are gathered first: a reduction per kilobyte-sized chunk costs
    # far more than the bytes it looks at.
    _GATHER = 1 << 20

    def __init__(self, dtype: DType, *, full: bool) -> None:
        import torch  # values need torch; everything else in inspect and verify does not

        self._torch = torch
        self.dtype = dtype
        self.full = full
        self.supported = dtype.kind in ("float", "float8", "int", "bool") and dtype.name != "U64"
        self._torch_dtype = getattr(torch, dtype.torch_name) if self.supported else None
        self.stats = TensorStats()
        self._pending = bytearray()
        self._sum = 0.0
        self._finite = 0

    def update(self, data: bytearray | memoryview) -> None:
        if not self.supported or not len(data):
            return
        if len(data) < self._GATHER:
            self._pending += data
            if len(self._pending) < self._GATHER:
                return
            data, self._pending = self._pending, bytearray()
        elif self._pending:
            self._flush()
        self._reduce(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, bytearray()
        if pending:
            self._reduce(pending)

    def _reduce(self, data: bytearray | memoryview) -> None:
        torch = self._torch
        t = torch.frombuffer(data, dtype=self._torch_dtype)
        if self.dtype.kind == "float8":
            for i in range(0, t.numel(), self._SUB):
                self._update(t[i : i + self._SUB].float())
            return
        if self.dtype.kind == "bool":
            t = t.view(torch.uint8)
        elif self.dtype.name in ("U16", "U32"):
            t = t.to(torch.int64)
        self._update(t)

    def _update(self, t: Any) -> None:
        torch = self._torch
        s = self.stats
        mn, mx = (v.item() for v in torch.aminmax(t))
        is_float = t.is_floating_point()
        if is_float and not (_finite(mn) and _finite(mx)):
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum())
            s.nan += nan
            s.inf += inf
            t = t[torch.isfinite(t)]
            if not t.numel():
                s.all_zero = False
                return
            mn, mx = (v.item() for v in torch.aminmax(t))
            s.all_zero = False
        elif s.all_zero is not False:
            s.all_zero = mn == 0 and mx == 0
        s.min = mn if s.min is None else min(s.min, mn)
        s.max = mx if s.max is None else max(s.max, mx)
        s.abs_max = max(abs(s.min), abs(s.max))
        if self.full:
            self._sum += float(t.sum(dtype=torch.float64))
            self._finite += t.numel()

    def result(self) -> TensorStats:
        self._flush()
        s = self.stats
        if self.full and self._finite:
            s.mean = self._sum / self._finite
        if s.min is not None and s.max is not None and not self.dtype.kind.startswith("float"):
            s.min, s.max, s.abs_max = int(s.min), int(s.max), int(s.abs_max or 0)
        return s


def _finite(v: float) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))


class ValueCheck(Protocol):
    def update(self, data: bytearray | memoryview) -> None: ...

    def result(self) -> TensorStats: ...


@functools.cache
def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional (the "fast" extra)
        return None
    return numpy


def needs_torch(dtype: DType) -> bool:
    """True when :func:`check` of ``dtype`` imports torch."""
    return _numpy() is None or (dtype.name not in _EXPONENT and dtype.name not in _INTEGER
                                and dtype.kind in ("float8", "float", "int", "bool")
                                and dtype.name != "U64")


def check(dtype: DType) -> ValueCheck:
    """The value checks of one tensor of ``dtype``, fed its bytes block by block (in any
    order) and asked for :class:`TensorStats` (``nan``, ``inf``,
    ``all_zero``; no extremes) at the end."""
    if needs_torch(dtype):
        return Stats(dtype, full=False)
    return _Bits(dtype)


class _Bits:
    # Blocks smaller than this are gathered first (as Stats does): a reduction per
    # kilobyte-sized chunk costs more than the bytes it looks at.
    _GATHER = 1 << 20

    def __init__(self, dtype: DType) -> None:
        np = _numpy()
        self._np = np
        self.dtype = dtype
        item = dtype.itemsize
        self._exponent = _EXPONENT.get(dtype.name)
        if self._exponent is not None:
            self._sign = 1 << (8 * item - 1)
            self._signed = np.dtype(f"<i{item}")
            self._unsigned = np.dtype(f"<u{item}")
        self._supported = self._exponent is not None or dtype.name in _INTEGER
        self._pending = bytearray()
        self._seen = False
        self._nonzero = False
        self._nan = 0
        self._inf = 0

    def update(self, data: bytearray | memoryview) -> None:
        if not self._supported or not len(data):
            return
        item = self.dtype.itemsize
        if len(data) < self._GATHER or len(data) <= -len(self._pending) % item:
            self._pending += data
            if len(self._pending) < self._GATHER:
                return
            data, self._pending = self._pending, bytearray()
        elif self._pending:  # what was gathered, its last element completed from ``data``
            need = -len(self._pending) % item
            pending, self._pending = self._pending + data[:need], bytearray()
            self._reduce(pending)
            data = memoryview(data)[need:]
        whole = len(data) - len(data) % item
        if whole < len(data):  # an element split between blocks: finished by the next one
            self._pending += data[whole:]
            data = memoryview(data)[:whole]
        self._reduce(data)

    def _reduce(self, data: bytearray | memoryview) -> None:
        if not len(data):
            return
        self._seen = True
        np = self._np
        if self._exponent is None:  # integers, bools
            if not self._nonzero:
                self._nonzero = bool(np.frombuffer(data, np.uint8).max())
            return
        signed = np.frombuffer(data, self._signed)
        high_signed = int(signed.max())  # the largest positive value's bits
        high = int(signed.view(self._unsigned).max())  # the largest negative value's bits
        exponent, sign = self._exponent, self._sign
        if high_signed >= exponent or high >= sign | exponent:
            magnitude = signed.view(self._unsigned) & (sign - 1)
            self._nan += int(np.count_nonzero(magnitude > exponent))
            self._inf += int(np.count_nonzero(magnitude == exponent))
        # Zero is +0 (all bits clear) or -0 (only the sign bit).
        self._nonzero = self._nonzero or high_signed > 0 or high > sign

    def result(self) -> TensorStats:
        pending, self._pending = self._pending, bytearray()
        self._reduce(pending[: len(pending) - len(pending) % self.dtype.itemsize])
        stats = TensorStats(nan=self._nan, inf=self._inf)
        if self._seen:
            stats.all_zero = not self._nonzero
        return stats
