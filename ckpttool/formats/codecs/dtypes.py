"""Element types, named the safetensors way (``BF16``, ``F8_E4M3``...), without importing torch.

Every format module translates its own spelling (a pickled ``torch.bfloat16``, a legacy
``torch.BFloat16Storage`` class, a safetensors header string) into these names, so the rest of
ckpttool compares plain strings.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # safetensors spelling: "BF16"
    torch_name: str  # attribute of the torch module: "bfloat16"
    itemsize: int
    kind: str  # "float", "float8", "int", "bool", "complex"

    def __setstate__(self, state: dict[str, object]) -> None:
        # A pickle's BUILD on a shared dtype (torch.float32 as the allow-list hands it out)
        # would change it for every file the process reads; only a new one takes a state.
        if self.__dict__:
            raise pickle.UnpicklingError(f"a pickle set the state of the dtype {self.name}")
        self.__dict__.update(state)

    @property
    def is_float(self) -> bool:
        """True for the floating types that a dtype conversion may cast (never float8)."""
        return self.kind == "float"


_ALL = (
    DType("F64", "float64", 8, "float"),
    DType("F32", "float32", 4, "float"),
    DType("F16", "float16", 2, "float"),
    DType("BF16", "bfloat16", 2, "float"),
    DType("F8_E4M3", "float8_e4m3fn", 1, "float8"),
    DType("F8_E5M2", "float8_e5m2", 1, "float8"),
    DType("F8_E4M3FNUZ", "float8_e4m3fnuz", 1, "float8"),
    DType("F8_E5M2FNUZ", "float8_e5m2fnuz", 1, "float8"),
    DType("F8_E8M0", "float8_e8m0fnu", 1, "float8"),
    DType("I64", "int64", 8, "int"),
    DType("I32", "int32", 4, "int"),
    DType("I16", "int16", 2, "int"),
    DType("I8", "int8", 1, "int"),
    DType("U64", "uint64", 8, "int"),
    DType("U32", "uint32", 4, "int"),
    DType("U16", "uint16", 2, "int"),
    DType("U8", "uint8", 1, "int"),
    DType("BOOL", "bool", 1, "bool"),
    DType("C64", "complex64", 8, "complex"),
)

BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in _ALL}

# Legacy typed-storage classes that torch.save names in a record's pickle (torch.FloatStorage...).
BY_STORAGE_CLASS: dict[str, DType] = {
    "DoubleStorage": BY_NAME["F64"],
    "FloatStorage": BY_NAME["F32"],
    "HalfStorage": BY_NAME["F16"],
    "BFloat16Storage": BY_NAME["BF16"],
    "LongStorage": BY_NAME["I64"],
    "IntStorage": BY_NAME["I32"],
    "ShortStorage": BY_NAME["I16"],
    "CharStorage": BY_NAME["I8"],
    "ByteStorage": BY_NAME["U8"],
    "BoolStorage": BY_NAME["BOOL"],
    "ComplexFloatStorage": BY_NAME["C64"],
}

# What users type for --dtype and what config.json says in torch_dtype / dtype.
ALIASES: dict[str, str] = {
    "bf16": "BF16",
    "bfloat16": "BF16",
    "fp16": "F16",
    "f16": "F16",
    "float16": "F16",
    "half": "F16",
    "fp32": "F32",
    "f32": "F32",
    "float32": "F32",
    "float": "F32",
    "fp64": "F64",
    "float64": "F64",
}


# What --dtype takes (any ALIASES spelling of these is accepted too: bfloat16, float16...).
CHOICES = ("auto", "keep", "bf16", "fp16", "fp32")


def normalize_choice(value: str) -> str | None:
    """``value`` as one of :data:`CHOICES` (``"bfloat16"`` -> ``"bf16"``), or None."""
    v = value.lower().removeprefix("torch.")
    if v in CHOICES:
        return v
    name = ALIASES.get(v)
    return next((c for c in CHOICES if ALIASES.get(c) == name), None) if name else None


def get(name: str) -> DType:
    """Return the dtype named ``name`` (safetensors spelling)."""
    return BY_NAME[name]


# A float32 -> bfloat16 cast done in Python (:func:`f32_to_bf16`) for at most this many
# elements: Megatron keeps norm weights in float32 in a bf16 run, and casting those few
# thousand elements must not cost a merge the second that importing torch takes.
SMALL_CAST = 1 << 16


def cast_without_torch(src: DType, dst: DType, numel: int) -> bool:
    """True if :func:`f32_to_bf16` casts ``numel`` elements of ``src`` to ``dst``."""
    return src.name == "F32" and dst.name == "BF16" and numel <= SMALL_CAST


def f32_to_bf16(data: bytes | bytearray | memoryview) -> bytearray:
    """Little-endian float32 bytes as bfloat16, rounded to nearest even; every NaN becomes
    0xFFFF (what torch's CPU ``Tensor.to(torch.bfloat16)`` gives, bit for bit)."""
    import sys
    from array import array

    src = array("I")
    src.frombytes(bytes(data))
    if sys.byteorder != "little":
        src.byteswap()
    out = array("H", [(x + 0x7FFF + ((x >> 16) & 1)) >> 16 if x & 0x7FFFFFFF <= 0x7F800000
                      else 0xFFFF for x in src])
    if sys.byteorder != "little":
        out.byteswap()
    return bytearray(out.tobytes())
