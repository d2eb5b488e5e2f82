"""Which dtype each tensor is written in: the ``--dtype`` policy, decided before any data moves."""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.errors import InputError
from ckpttool.formats import dtypes
from ckpttool.formats.dtypes import DType

CHOICES = ("auto", "keep", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class DTypePolicy:
    """The resolved ``--dtype``: a target for floating tensors, or None to keep every dtype."""

    requested: str  # what the user asked for: auto, keep, bf16...
    target: DType | None
    source: str  # why: "--dtype bf16", "config.json torch_dtype=bfloat16", "no config.json"

    def output_dtype(self, dtype: DType) -> DType:
        """The dtype a tensor of ``dtype`` is written in. Float8, integer and bool never change."""
        if self.target is None or not dtype.is_float:
            return dtype
        return self.target


def resolve(requested: str, config: dict[str, object] | None, config_name: str = "config.json"
            ) -> DTypePolicy:
    """Resolve ``--dtype`` against an optional parsed ``config.json``.

    Raises:
        InputError: an unknown ``--dtype`` value.
    """
    requested = requested.lower()
    if requested == "keep":
        return DTypePolicy("keep", None, "--dtype keep")
    if requested != "auto":
        name = dtypes.ALIASES.get(requested)
        if name is None:
            raise InputError(
                f"unknown --dtype '{requested}'; use one of: {', '.join(CHOICES)}"
            )
        return DTypePolicy(requested, dtypes.get(name), f"--dtype {requested}")
    if config is None:
        return DTypePolicy("auto", None, f"no {config_name} found, dtypes kept")
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str):
            name = dtypes.ALIASES.get(value.lower().removeprefix("torch."))
            if name is not None:
                return DTypePolicy("auto", dtypes.get(name), f"{config_name} {key}={value}")
    return DTypePolicy("auto", None, f"{config_name} names no dtype, dtypes kept")
