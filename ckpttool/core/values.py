"""``verify``'s value checks (NaN, Inf, all-zero) from the bit patterns, without torch.

A floating value is NaN or infinite exactly when its exponent bits are all ones, and zero when
every bit but the sign is clear: integer comparisons on the stored bytes decide both, for the
IEEE formats (F64, F32, F16, BF16) as for integers and bools (all-zero: every byte clear). Per
block that is two integer maxima, viewed signed and unsigned (numpy, at memory speed and with
the interpreter lock released); the exact counts are taken only in a block where a maximum
says some value is not finite. ``import torch`` costs about a second, more than checking
3 GB this way; torch is used (:class:`~ckpttool.core.inspect.Stats`) only where numpy is not
installed or for the float8 formats, whose special values differ from format to format.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

from ckpttool.core.inspect import Stats, TensorStats
from ckpttool.formats.codecs.dtypes import DType

# Exponent mask of each IEEE format, by safetensors name (sign bit: the top one).
_EXPONENT = {"F64": 0x7FF0_0000_0000_0000, "F32": 0x7F80_0000, "F16": 0x7C00, "BF16": 0x7F80}
# Integer dtypes whose all-zero check is "every byte clear". (U64 and complex: no value checks,
# as in Stats.)
_INTEGER = frozenset({"I64", "I32", "I16", "I8", "U32", "U16", "U8", "BOOL"})


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
    order) and asked for :class:`~ckpttool.core.inspect.TensorStats` (``nan``, ``inf``,
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
