"""Megatron-Core optimizer state under Hugging Face names (``merge --part optimizer``).

Megatron-Core saves Adam's state in model space, each state tensor sharded as its parameter,
under ``optimizer.state.<kind>.<parameter key>``: its non-distributed optimizer, and the
distributed optimizer with ``--dist-ckpt-optim-fully-reshardable`` (``fully_reshardable``).
The kinds are Adam's ``exp_avg`` and ``exp_avg_sq`` and, for the distributed optimizer, the
fp32 master parameters (``param``). Each kind is a copy of the model's layout (stacked
layers, fused QKV, padded vocabulary), so the model's family map applies to it as it does to
the weights; its outputs are written as ``state.<Hugging Face name>.<kind>`` (torch's
optimizer-state naming, as for the other formats).

The distributed optimizer's default layout, ``dp_reshardable``, saves the state as flat
buffers per gradient bucket (``optimizer.distributed.dp_group_idx_N.gbuf_idx_M...
bucket_idx_K.<kind>``; a ChainedOptimizer's, dense and expert parameters apart, below
``chained_<i>.``), which hold the parameters in DDP's bucket order, not by name: merge
turns them into these names first (:mod:`ckpttool.core.merge.megatron_buckets`); buckets
that reach :func:`model_view` still are a layout it could not place (exit 4).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpttool.core.transforms import namemaps
from ckpttool.errors import UnsupportedError

PREFIX = "optimizer.state."
# dp_reshardable's flat per-bucket buffers
_BUCKETS = "optimizer.distributed."


def model_view(named: list[tuple[str, Any]]) -> dict[str, list[tuple[str, Any]]] | None:
    """The state of each kind under its parameter's Megatron name (``{"exp_avg": [(name,
    tensor)...]}``), if ``named`` is a Megatron-Core model's optimizer state in model space;
    None otherwise (another framework's optimizer: its names are kept).

    Raises:
        UnsupportedError: the distributed optimizer's ``dp_reshardable`` buffers.
    """
    buckets = [n for n, _ in named if (n.startswith(_BUCKETS) or f".{_BUCKETS}" in n)
               and ".bucket_idx_" in n]
    if buckets:
        raise UnsupportedError(
            f"'{buckets[0]}': the optimizer state is Megatron-Core's distributed optimizer in "
            "its dp_reshardable layout (flat buffers per gradient bucket, parameters in DDP's "
            "bucket order, not by name), which merge --part optimizer does not read yet; the "
            "model merges (merge without --part). For the optimizer state, save the run "
            "with --dist-ckpt-optim-fully-reshardable")
    groups: dict[str, list[tuple[str, Any]]] = {}
    for name, tensor in named:
        kind, _, rest = name.removeprefix(PREFIX).partition(".")
        if not name.startswith(PREFIX) or not rest:
            return None
        groups.setdefault(kind, []).append((rest, tensor))
    if not groups or not all(namemaps.is_megatron(t) for t in groups.values()):
        return None
    return groups


def implied(named: list[tuple[str, Any]], config: Mapping[str, Any] | None, *,
            config_path: str | None = None) -> str | None:
    """The family map of a Megatron-Core model's optimizer state (see
    :func:`ckpttool.core.transforms.namemaps.implied`), None for other optimizer state."""
    groups = model_view(named)
    if groups is None:
        return None
    return namemaps.implied(next(iter(groups.values())), config, config_path=config_path)


def apply(map_name: str, named: list[tuple[str, Any]], config: Mapping[str, Any] | None, *,
          config_path: str | None = None, asked: bool = True) -> namemaps.Mapped | None:
    """The map ``map_name`` applied to each kind of state, as to the model's weights
    (``state.<Hugging Face name>.<kind>``); None where ``named`` is not a Megatron-Core
    model's optimizer state.

    Raises:
        InputError: as :func:`ckpttool.core.transforms.namemaps.apply`, for any kind.
    """
    groups = model_view(named)
    if groups is None:
        return None
    out = namemaps.Mapped(map_name, [])
    for kind, tensors in groups.items():
        mapped = namemaps.apply(map_name, tensors, config, config_path=config_path,
                                asked=asked)
        out.tensors += [(f"state.{name}.{kind}", source) for name, source in mapped.tensors]
        out.how += [{**h, "from": f"{PREFIX}{kind}.{h['from']}",
                     "to": f"state.{h['to']}.{kind}"} for h in mapped.how]
        out.dropped += [(f"{PREFIX}{kind}.{n}", t, note) for n, t, note in mapped.dropped]
        out.mtp_layers = max(out.mtp_layers, mapped.mtp_layers)  # the config written says so
    return out
