"""Which dtype each tensor is written in (the ``--dtype`` policy, decided before any data
moves), and what a checkpoint's dtypes say against an expected one (``--expect-dtype``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpttool.core import quantization
from ckpttool.core.checkpoint import hf
from ckpttool.errors import InputError
from ckpttool.formats.base import Problem, error, info, warning
from ckpttool.formats.codecs import dtypes
from ckpttool.formats.codecs.dtypes import DType

if TYPE_CHECKING:
    from ckpttool.core.checkpoint.discover import Checkpoint

CHOICES = dtypes.CHOICES


@dataclass(frozen=True)
class DTypePolicy:
    """The resolved ``--dtype``: a target for floating tensors, or None to keep every dtype."""

    requested: str  # what the user asked for: auto, keep, bf16...
    target: DType | None
    source: str  # why: "--dtype bf16", "config.json torch_dtype=bfloat16", "no config.json"
    # Names kept as stored whatever the target: the scales of quantized weights
    # (:func:`ckpttool.core.quantization.kept_names`).
    keep: frozenset[str] = frozenset()

    def output_dtype(self, dtype: DType, name: str | None = None) -> DType:
        """The dtype a tensor of ``dtype`` (named ``name``) is written in. Float8, integer
        and bool never change, nor a tensor that scales or indexes a quantized one."""
        if self.target is None or not dtype.is_float or name in self.keep:
            return dtype
        return self.target


def resolve(requested: str, config: dict[str, object] | None, config_name: str = "config.json"
            ) -> DTypePolicy:
    """Resolve ``--dtype`` against an optional parsed ``config.json``.

    Raises:
        InputError: an unknown ``--dtype`` value.
    """
    requested = dtypes.normalize_choice(requested) or requested.lower()
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


def check_dtypes(ckpt: Checkpoint, expect: DTypePolicy | None) -> list[Problem]:
    """Floating tensors against an expected dtype (``--expect-dtype``); float8, integer and
    bool tensors are judged apart; an ``FSDP`` prefix in config.json's architectures."""
    problems: list[Problem] = []
    config = ckpt.hf.config
    config_name = ckpt.hf.config_path.name if ckpt.hf.config_path else "config.json"
    if config is not None:
        _, changes = hf.strip_fsdp_prefix(config)
        if changes:
            # merge fixes it on the way out of a sharded checkpoint; in weights that are served
            # as they are, it is fatal.
            sharded = ckpt.info is not None and ckpt.info.sharded
            make = warning if sharded else error
            problems.append(make("fsdp-prefix", f"{ckpt.hf.config_path}: architectures names "
                                 f"{', '.join(c.split(' -> ')[0] for c in changes)}, a class no "
                                 "library defines (vLLM picks the model class from it); ckpttool "
                                 f"merge writes {', '.join(c.split(' -> ')[1] for c in changes)}",
                                 file=config_name))
    if ckpt.kind != "model":
        return problems
    # The scales of quantized weights keep their stored dtype (merge never casts them).
    scales = quantization.kept_names(((t.name, t.dtype) for t in ckpt.tensors), config)
    floats = [t for t in ckpt.tensors if t.dtype.is_float and t.name not in scales]
    if expect is None or expect.target is None:
        if expect is not None:
            problems.append(info("dtype-unknown", f"--expect-dtype {expect.requested}: "
                                  f"{expect.source}; dtypes not checked"))
            return problems
        policy = resolve("auto", config, config_name)
        other = sorted({t.dtype.name for t in floats} - ({policy.target.name}
                                                         if policy.target else set()))
        if policy.target is not None and other:
            problems.append(info("dtype-differs-from-config",
                                  f"floating tensors are {', '.join(other)} but {policy.source}; "
                                  "ckpttool merge --dtype auto casts them (check with "
                                  "--expect-dtype auto)"))
        return problems
    target = expect.target
    why = expect.source if expect.requested == "auto" else f"--expect-dtype {expect.requested}"
    for t in floats:
        if t.dtype == target:
            continue
        if t.dtype.itemsize > target.itemsize:
            problems.append(error(
                "dtype-upcast", f"tensor '{t.name}' is {t.dtype.name}, wider than the expected "
                f"{target.name} ({why}): mixed precision's fp32 copy? ckpttool merge "
                f"--dtype {expect.requested} casts it", tensor=t.name))
        else:
            problems.append(error(
                "dtype-mismatch", f"tensor '{t.name}' is {t.dtype.name}, not the expected "
                f"{target.name} ({why})", tensor=t.name))
    for kind, label in (("float8", "float8"), ("int", "integer"), ("bool", "bool")):
        found = [t for t in ckpt.tensors if t.dtype.kind == kind]
        if found:
            dts = ", ".join(sorted({t.dtype.name for t in found}))
            problems.append(info(
                f"{kind}-tensors", f"{len(found)} {label} tensors ({dts}, e.g. '{found[0].name}') "
                f"are kept as stored; --expect-dtype does not apply to them"))
    return problems
