"""The allow-list of a per-rank state-dict pickle: what a pickled DTensor (FSDP2) or
ShardedTensor (FSDP1 ``SHARDED_STATE_DICT``) names, mapped onto inert stand-ins (torch 2.13's
names); anything else is refused by name before it is looked up."""


from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from ckpttool.formats.codecs import policy, torchsave

# --------------------------------------------------------------------------------------------
# The allow-list: what a pickled DTensor names, as inert stand-ins


class _Fields(tuple, metaclass=policy.Sealed):  # type: ignore[type-arg]
    """Stand-in for a NamedTuple pickle builds with NEWOBJ (``TensorMeta``, ``ShardOrderEntry``)."""

    def __new__(cls, *fields: Any) -> _Fields:
        return tuple.__new__(cls, fields)




DTensorSpec = torchsave.stub_class("DTensorSpec")
DeviceMesh = torchsave.stub_class("DeviceMesh")
MeshLayout = torchsave.stub_class("_MeshLayout")
FlatLayout = torchsave.stub_class("_FlatLayout")
Shard = torchsave.stub_class("Shard")
Replicate = torchsave.stub_class("Replicate")
# Recognised only to say they are not supported: a Partial tensor is a sum of the ranks'
# pieces, a StridedShard interleaves them.
Partial = torchsave.stub_class("Partial")
StridedShard = torchsave.stub_class("_StridedShard")
_TensorMeta = type("TensorMeta", (_Fields,), {})
_ShardOrderEntry = type("ShardOrderEntry", (_Fields,), {})


class _DTensorClass(metaclass=policy.Sealed):
    """Stand-in for the ``DTensor`` class object itself (an argument, never instantiated)."""


@dataclass(frozen=True)
class _WrapperArgs:
    dtype: Any
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DTensorRef:
    """A DTensor as the pickle describes it: global dtype and shape, local piece, spec."""

    dtype: Any
    shape: tuple[int, ...]
    local: Any  # torchsave.TensorRef when well formed
    spec: Any  # DTensorSpec stand-in when well formed


class _ShardedTensorClass(metaclass=policy.Sealed):
    """Stand-in for the ``ShardedTensor`` class object (an argument, never instantiated)."""


@dataclass(frozen=True)
class ShardedTensorRef:
    """An FSDP1 ShardedTensor as the pickle describes it (``ShardedTensor.__getstate__``):
    global dtype and shape, this rank's shards, the global metadata and the process group the
    writer saw."""

    dtype: Any
    shape: tuple[int, ...]
    local_shards: Any  # a list of LocalShard stand-ins when well formed
    metadata: Any  # ShardedTensorMetadata stand-in when well formed
    process_group: Any  # ProcessGroupState stand-in when well formed


LocalShard = torchsave.stub_class("Shard")  # sharded_tensor.shard.Shard: tensor + metadata
ShardMetadata = torchsave.stub_class("ShardMetadata")
ShardedTensorMetadata = torchsave.stub_class("ShardedTensorMetadata")
_TensorProperties = torchsave.stub_class("TensorProperties")
_RemoteDevice = torchsave.stub_class("_remote_device")
_ChunkShardingSpec = torchsave.stub_class("ChunkShardingSpec")
ProcessGroupState = torchsave.stub_class("ProcessGroupState")


# The enum TensorProperties pickles its memory format as (torch 2.13's members).
_MEM_FORMAT_ENCODING = torchsave.EnumClass("MEM_FORMAT_ENCODING", {
    "TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2})


def _getattr(obj: Any, name: Any) -> Any:
    """``getattr`` as a ShardedTensor pickle calls it: ``getattr(ShardedTensor,
    "ProcessGroupState")`` (a nested class) or an allow-listed Enum member by name (Python
    3.11), nothing else; the object is a stand-in, so nothing real is ever reached."""
    if obj is _ShardedTensorClass:
        if name == "ProcessGroupState":
            return ProcessGroupState
        raise torchsave.Refused("builtins", f"getattr(ShardedTensor, {str(name)[:60]!r})")
    return torchsave.enum_getattr(obj, name)


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, *_: Any) -> _WrapperArgs:
    if cls is not _DTensorClass and cls is not _ShardedTensorClass:
        raise pickle.UnpicklingError("a tensor subclass other than DTensor and ShardedTensor")
    return _WrapperArgs(dtype, torchsave.size(size))


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any,
                          state: Any) -> DTensorRef | ShardedTensorRef:
    if func is not _rebuild_wrapper_subclass or new_type not in (_DTensorClass,
                                                                  _ShardedTensorClass):
        raise pickle.UnpicklingError("a tensor subclass other than DTensor and ShardedTensor")
    wrapper = func(*args)
    if new_type is _ShardedTensorClass:
        # (local shards, metadata, process group state, sharding spec, init_rrefs)
        if not isinstance(state, tuple) or len(state) != 5:
            raise pickle.UnpicklingError("ShardedTensor without its state")
        return ShardedTensorRef(wrapper.dtype, wrapper.shape, state[0], state[1], state[2])
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}
    if not isinstance(state, dict):
        raise pickle.UnpicklingError("DTensor without state")
    return DTensorRef(wrapper.dtype, wrapper.shape, state.get("_local_tensor"),
                      state.get("_spec"))


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


DTENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch.distributed.tensor", "DTensor"): _DTensorClass,
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"): DTensorSpec,
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"): _TensorMeta,
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"): _ShardOrderEntry,
    ("torch.distributed.device_mesh", "DeviceMesh"): DeviceMesh,
    ("torch.distributed._mesh_layout", "_MeshLayout"): MeshLayout,
    ("torch.distributed._mesh_layout", "_FlatLayout"): FlatLayout,
    ("torch.distributed.tensor.placement_types", "Shard"): Shard,
    ("torch.distributed.tensor.placement_types", "Replicate"): Replicate,
    ("torch.distributed.tensor.placement_types", "Partial"): Partial,
    ("torch.distributed.tensor.placement_types", "_StridedShard"): StridedShard,
    ("torch", "device"): _device,
    ("torch", "Size"): torchsave.size,
    ("torch.serialization", "_get_layout"): str,
}

# What FSDP1's SHARDED_STATE_DICT pickles (torch 2.13 names); the enum and the nested class
# come through a call (MEM_FORMAT_ENCODING(0), getattr(ShardedTensor, "ProcessGroupState")).
_ST = "torch.distributed._shard.sharded_tensor"
_SHARDED_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    (f"{_ST}.api", "ShardedTensor"): _ShardedTensorClass,
    (f"{_ST}.shard", "Shard"): LocalShard,
    ("torch.distributed._shard.metadata", "ShardMetadata"): ShardMetadata,
    (f"{_ST}.metadata", "ShardedTensorMetadata"): ShardedTensorMetadata,
    (f"{_ST}.metadata", "TensorProperties"): _TensorProperties,
    (f"{_ST}.metadata", "MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch.distributed._shard.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"):
        _ChunkShardingSpec,
    ("torch.distributed.remote_device", "_remote_device"): _RemoteDevice,
}


class ShardedTensorFound(Exception):
    """The pickle names a ``torch.distributed._shard`` global that is not allowed (another
    form of ShardedTensor than FSDP1's SHARDED_STATE_DICT writes); nothing was run."""

    def __init__(self, qualname: str) -> None:
        super().__init__(qualname)
        self.qualname = qualname


def dtensor_global(module: str, name: str) -> Any | None:
    """The allow-list of a per-rank state-dict pickle: :func:`torchsave.record_global` plus
    DTensor's spec, mesh and placements and FSDP1 ShardedTensor's shards and metadata (torch
    2.13 names), as inert stand-ins.

    Raises:
        ShardedTensorFound: another ``torch.distributed._shard`` global.
    """
    found = DTENSOR_GLOBALS.get((module, name)) or _SHARDED_TENSOR_GLOBALS.get((module, name))
    if found is not None:
        return found
    if module in ("__builtin__", "builtins") and name == "getattr":
        return _getattr
    if module == "torch.distributed._shard" or module.startswith("torch.distributed._shard."):
        raise ShardedTensorFound(f"{module}.{name}")
    return torchsave.record_global(module, name)

