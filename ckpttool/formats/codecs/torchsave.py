"""``torch.save`` archives: the weights-only pickle inside the zip container
(:mod:`~ckpttool.formats.codecs.archive`).

Shared by the two formats built from them: a ``.bin``/``.pt`` file (:mod:`torchfile`) is one
archive, and a DCP ``.distcp`` file (:mod:`dcp`) is a concatenation of them, one per chunk or
object. An archive is an uncompressed zip holding ``<name>/data.pkl`` (the object, with each
tensor's storage as a persistent id), one ``<name>/data/<key>`` entry per storage, and small
``byteorder`` / ``version`` entries. The zip headers give each entry's offset and CRC-32, so
data is located (and checked) without reading it and without torch.

Pickles are read by an allow-list unpickler that maps the few globals a tensor needs onto inert
stand-ins; any other global is refused by name before it is looked up, so nothing from the file
ever runs.
"""

from __future__ import annotations

import functools
import io
import itertools
import pickle
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ckpttool._gc import gc_paused
from ckpttool.errors import CkptError, InputError
from ckpttool.formats.codecs import dtypes, policy
from ckpttool.formats.codecs.archive import RecordBytes, ZipEntry
from ckpttool.formats.codecs.dtypes import DType

# Re-exported: the stand-ins and the verdict every format uses live with the pickle policy.
from ckpttool.formats.codecs.policy import EnumClass as EnumClass
from ckpttool.formats.codecs.policy import PlainStub as PlainStub
from ckpttool.formats.codecs.policy import Refused as Refused
from ckpttool.formats.codecs.policy import Stub as Stub
from ckpttool.formats.codecs.policy import enum_getattr as enum_getattr
from ckpttool.formats.codecs.policy import one_bit_from as one_bit_from
from ckpttool.formats.codecs.policy import plain_stub_class as plain_stub_class
from ckpttool.formats.codecs.policy import refusal as refusal
from ckpttool.formats.codecs.policy import stub_class as stub_class

# What a corrupt pickle raises in the C unpickler (a refused global raises Refused instead).
PICKLE_ERRORS: tuple[type[Exception], ...] = (
    pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, struct.error,
)

# --------------------------------------------------------------------------------------------
# Allow-list unpickling


def corrupt(e: Exception) -> pickle.UnpicklingError:
    """A damaged pickle makes the C unpickler raise almost anything (an opcode applied to the
    wrong value: AttributeError, OverflowError for a FRAME length, RecursionError...): every
    one of them is a corrupt pickle, in one line."""
    text = " ".join(str(e).split())
    return pickle.UnpicklingError(f"{type(e).__name__}: {text}" if text else type(e).__name__)


class AllowListUnpickler(pickle.Unpickler):
    """An unpickler whose globals come only from ``lookup`` (None means refused)."""

    def __init__(self, file: io.BytesIO, lookup: Callable[[str, str], Any | None]) -> None:
        super().__init__(file)
        self._lookup = lookup

    def find_class(self, module: str, name: str) -> Any:
        found = self._lookup(module, name)
        if found is None:
            raise Refused(module, name)
        return found

    def load_deep(self, size: int) -> Any:
        """:meth:`load` of a pickle of ``size`` bytes, on a stack deep enough for any nesting
        those bytes can build. The C unpickler hashes a dict key or set member as it builds
        it, and hashing a tuple recurses in C without a limit: a tuple nested 200,000 deep
        (one byte a level) used as a key overflows an 8 MiB stack (a segmentation fault,
        not an exception). Small pickles load here; larger ones on a thread whose stack
        holds :data:`_STACK_PER_BYTE` bytes per pickle byte (reserved, touched only if used).
        """
        if size <= _SHALLOW_PICKLE:
            return self.load()
        import threading

        result: list[Any] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                result.append(self.load())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                failure.append(e)

        stack = min(max(_STACK_PER_BYTE * size, 16 << 20), _MAX_STACK)
        with _STACK_LOCK:  # stack_size is process-wide: set, start, restore
            while True:
                old = threading.stack_size(stack)
                try:
                    thread = threading.Thread(target=run, name="ckpttool-unpickle",
                                              daemon=True)
                    thread.start()
                    break
                except (RuntimeError, MemoryError):
                    # Not that much address space here: a smaller stack still holds any
                    # pickle that real checkpoints nest (a handful of levels).
                    if stack <= 16 << 20:
                        raise
                    stack //= 4
                finally:
                    threading.stack_size(old)
        thread.join()
        if failure:
            raise failure[0]
        return result[0]


# A pickle this small nests at most this deep: safe on any thread's stack (tuplehash uses
# under 64 bytes of C stack a level, measured 42 on CPython 3.11).
_SHALLOW_PICKLE = 32 << 10
_STACK_PER_BYTE = 64
_MAX_STACK = 8 << 30
_STACK_LOCK = threading.Lock()


def named_globals(data: bytes) -> list[str]:
    """Every ``module.name`` a pickle names (GLOBAL, and STACK_GLOBAL from the strings pushed
    before it, memoized ones included), read from its opcodes without running anything; the
    pickle's first refused global may be a decoy in front of the one that runs code."""
    return [f"{m}.{n}" for m, n in named_global_pairs(data)]


def named_global_pairs(data: bytes) -> list[tuple[str, str]]:
    """:func:`named_globals` as ``(module, name)`` pairs."""
    import pickletools

    found: list[tuple[str, str]] = []
    memo: dict[int, Any] = {}
    recent: list[Any] = []  # the last values pushed, strings or None
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name == "GLOBAL" and isinstance(arg, str):
                module, _sep, attr = arg.partition(" ")
                found.append((module, attr))
                recent.append(None)
            elif name == "STACK_GLOBAL":
                if len(recent) >= 2 and all(isinstance(v, str) for v in recent[-2:]):
                    found.append((recent[-2], recent[-1]))
                recent.append(None)
            elif name in ("MEMOIZE",):
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int):
                memo[arg] = recent[-1] if recent else None
            elif name in ("GET", "BINGET", "LONG_BINGET") and isinstance(arg, int):
                recent.append(memo.get(arg))
            elif isinstance(arg, str):
                recent.append(arg)
            else:
                recent.append(None)
            del recent[:-2]
    except Exception:  # noqa: BLE001 - a corrupt tail: what was found so far stands
        pass
    return list(dict.fromkeys(found))


def archive_globals(rb: RecordBytes, entries: dict[str, ZipEntry]) -> list[tuple[str, str]]:
    """The globals an archive's ``data.pkl`` names (nothing run), for :func:`refusal`."""
    pkl = entries.get("data.pkl")
    if pkl is None:
        return []
    try:
        return named_global_pairs(rb.read(pkl.data_offset, pkl.size))
    except (CkptError, OSError):
        return []


# dtypes torch can name that ckpttool does not convert; kept distinct so the error says so.
_OTHER_TORCH_DTYPES = frozenset((
    "complex128", "complex32", "cdouble", "cfloat", "chalf", "qint8", "quint8", "qint32",
    "quint4x2", "quint2x4", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    "float4_e2m1fn_x2", "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7", "int1",
    "int2", "int3", "int4", "int5", "int6", "int7",
))
_LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "_mkldnn", "jagged"})
_MEMORY_FORMATS = frozenset(
    {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"}
)


@dataclass(frozen=True)
class UnknownDType:
    """A torch dtype that has no safetensors name (complex128, quantized types...)."""

    torch_name: str


def size(values: Any = ()) -> tuple[int, ...]:
    """Stand-in for ``torch.Size``."""
    return tuple(int(v) for v in values)


def torch_attr(name: str) -> Any | None:
    """The stand-in for ``torch.<name>`` as a pickle may name it, or None if not allowed."""
    if name in dtypes.BY_TORCH_NAME:
        return dtypes.BY_TORCH_NAME[name]
    if name in _OTHER_TORCH_DTYPES:
        return UnknownDType(name)
    if name in _LAYOUTS or name in _MEMORY_FORMATS:
        return name
    if name == "Size":
        return size
    return None


_INT = {int}
_TUPLE = {tuple}


# torch stores sizes and offsets as int64: a larger one is damage (and 10**5000 could not
# even be printed: Python refuses int-to-string conversions past 4,300 digits).
MAX_INT = 2**63 - 1


def _shown(value: Any) -> str:
    """``value`` for a message, never a number too long to print."""
    if isinstance(value, tuple | list) and any(type(x) is int and x > MAX_INT for x in value):
        return f"a number above {MAX_INT} (2**63 - 1)"
    if type(value) is int and value > MAX_INT:
        return f"a number above {MAX_INT} (2**63 - 1)"
    return repr(value)[:200]


def all_ints(values: list[Any], where: str) -> None:
    """Every item of ``values`` is a tuple of ints in ``[0, 2**63)``, checked in three
    C-level passes (a ``.metadata`` of a million chunks holds millions of them).

    Raises:
        InputError: one is anything else.
    """
    if not values:
        return
    flat = list(itertools.chain.from_iterable(values)) if set(map(type, values)) == _TUPLE \
        else None
    if flat is None or (flat and (set(map(type, flat)) != _INT or min(flat) < 0
                                  or max(flat) > MAX_INT)):
        bad = next(v for v in values if type(v) is not tuple
                   or any(type(x) is not int or x < 0 or x > MAX_INT for x in v))
        raise InputError(f"{where}: holds {_shown(bad)} where a size or offset belongs; "
                         "corrupt")


def ints(value: Any, where: str) -> tuple[int, ...]:
    """``value`` (an unpickled ``torch.Size``) as a tuple of non-negative ints.

    Raises:
        InputError: it is anything else.
    """
    # C-level checks: this runs twice per chunk of a .metadata of millions of chunks.
    if type(value) is tuple and (not value or (set(map(type, value)) == _INT and min(value) >= 0
                                               and max(value) <= MAX_INT)):
        return value
    raise InputError(f"{where}: holds {_shown(value)} where a size or offset belongs; corrupt")


def _is_tensor_ref(value: Any) -> bool:
    return isinstance(value, TensorRef)


def has_tensor(value: Any, is_tensor: Callable[[Any], bool] = _is_tensor_ref) -> bool:
    """True if a container (dicts, lists, tuples) holds a tensor anywhere."""
    if is_tensor(value):
        return True
    if isinstance(value, dict):
        return any(has_tensor(v, is_tensor) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_tensor(v, is_tensor) for v in value)
    return False


def flatten(value: Any, *, is_tensor: Callable[[Any], bool] = _is_tensor_ref,
            path: tuple[str, ...] = (), expand_root: bool = False
            ) -> Iterator[tuple[tuple[str, ...], Any]]:
    """A state dict's leaves with their key paths: containers that hold tensors are opened,
    a subtree without tensors is one leaf (a non-tensor entry). ``expand_root`` opens the
    top-level dict even when it holds no tensor. One pass, bottom up: each container is asked
    whether it holds a tensor once (360,000 optimizer entries: 3.7 s of asking again at every
    level before)."""
    leaves, _ = _leaves(value, is_tensor, path, expand_root and not path)
    return iter(leaves)


def _leaves(value: Any, is_tensor: Callable[[Any], bool], path: tuple[str, ...], expand: bool
            ) -> tuple[list[tuple[tuple[str, ...], Any]], bool]:
    """:func:`flatten`'s leaves under ``value``, and whether a tensor is among them."""
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return [(path, value)], is_tensor(value)
    out: list[tuple[tuple[str, ...], Any]] = []
    found = False
    for k, v in items:
        got, tensor = _leaves(v, is_tensor, (*path, str(k)), False)
        out += got
        found = found or tensor
    if found or (expand and isinstance(value, dict)):
        return out, found
    return [(path, value)], False


# --------------------------------------------------------------------------------------------
# The pickle: tensors become references to storages, nothing else is allowed


@dataclass(frozen=True)
class StorageRef:
    key: str  # the storage's entry is data/<key>
    dtype: DType | None  # None for an untyped storage (dtype then comes from the rebuild call)
    numel: int

    def claims(self, record_size: int) -> str | None:
        """Why the storage's record of ``record_size`` bytes is not the size the pickle
        claims (its element count times the element size, in bytes for an untyped storage),
        or None: ``torch.load`` refuses such a file, so ckpttool does too."""
        nbytes = self.numel * (self.dtype.itemsize if self.dtype is not None else 1)
        if nbytes == record_size:
            return None
        return (f"storage 'data/{self.key}' claims {nbytes:,} bytes where the archive holds "
                f"{record_size:,}; corrupt")


@dataclass(frozen=True)
class TensorRef:
    """A tensor as the pickle describes it: a view of a storage."""

    storage: StorageRef
    storage_offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: DType


@dataclass(frozen=True)
class _StorageClass:
    dtype: DType | None


def _rebuild_v2(storage: Any, storage_offset: Any, size_: Any, stride: Any, *_: Any) -> TensorRef:
    if not isinstance(storage, StorageRef) or storage.dtype is None:
        raise pickle.UnpicklingError("tensor without a typed storage")
    return _tensor_ref(storage, storage_offset, size_, stride, storage.dtype)


def _tensor_ref(storage: StorageRef, storage_offset: Any, size_: Any, stride: Any,
                dtype: DType) -> TensorRef:
    """A view's geometry, refused if it could reach outside its storage (negative values)."""
    shape, strides = size(size_), size(stride)
    offset = int(storage_offset)
    if offset < 0 or any(n < 0 for n in shape) or any(s < 0 for s in strides) or (
            len(shape) != len(strides)):
        raise pickle.UnpicklingError(
            f"invalid tensor view (offset {offset}, shape {list(shape)}, stride {list(strides)})")
    return TensorRef(storage, offset, shape, strides, dtype)


def _rebuild_v3(
    storage: Any, storage_offset: Any, size_: Any, stride: Any, _rg: Any, _hooks: Any,
    dtype: Any, *_: Any,
) -> TensorRef:
    if not isinstance(storage, StorageRef) or not isinstance(dtype, DType):
        raise pickle.UnpicklingError("tensor with an unknown dtype")
    return _tensor_ref(storage, storage_offset, size_, stride, dtype)


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


def record_global(module: str, name: str) -> Any | None:
    """The allow-list of a tensor pickle: what ``torch.load(weights_only=True)`` needs for
    plain tensors, parameters and containers."""
    if module == "torch._utils":
        return {
            "_rebuild_tensor_v2": _rebuild_v2,
            "_rebuild_tensor_v3": _rebuild_v3,
            "_rebuild_parameter": _rebuild_parameter,
        }.get(name)
    if module == "torch":
        if name in dtypes.BY_STORAGE_CLASS:
            return _StorageClass(dtypes.BY_STORAGE_CLASS[name])
        if name == "device":
            return _device
        return torch_attr(name)  # dtypes, layouts, memory formats, Size (a tuple)
    if module == "torch.storage" and name == "UntypedStorage":
        return _StorageClass(None)
    if module == "torch.serialization" and name == "_get_layout":
        return str
    found = _NUMPY.get((module, name))
    # The rest by what it is (the one pickle policy): enums, paths, namespaces, containers...
    return found if found is not None else policy.data_global(module, name)


def _device(kind: Any, index: Any = None) -> str:
    """``torch.device`` as its string (``cuda:0``)."""
    if not isinstance(kind, str) or not (index is None or type(index) is int):
        raise pickle.UnpicklingError("torch.device() called other than with a name")
    return kind if index is None else f"{kind}:{index}"


# numpy arrays and scalars, as a training state pickles them (verl's extra_state holds
# np.random.get_state(): a uint32 array). Inert stand-ins that keep the pickled state and run
# nothing of numpy's; each checks its arguments as numpy's own pickles pass them.
class NumpyDType(Stub):
    """``numpy.dtype(code, align, copy)``: the type code (``'u4'``) and the BUILD state."""

    def __repr__(self) -> str:
        return f"numpy.dtype({self.args[0]!r})" if self.args else "numpy.dtype"


class NumpyArray(Stub):
    """``numpy._core.multiarray._reconstruct(ndarray, (0,), b'b')`` then BUILD with
    ``(version, shape, dtype, fortran, raw bytes or a list)``, or a scalar
    (``args``: dtype, bytes): kept as pickled, never made into an array."""

    def __repr__(self) -> str:
        state = self.state
        if isinstance(state, tuple) and len(state) == 5:
            return f"numpy.ndarray({state[2]!r}, shape {state[1]!r})"
        return f"numpy scalar {self.args[0]!r}" if self.args else "numpy.ndarray"


_NDARRAY = stub_class("ndarray")


def _np_dtype(code: Any, align: Any = False, copy: Any = True) -> NumpyDType:
    if type(code) is not str or len(code) > 16 or type(align) is not bool or \
            type(copy) is not bool:
        raise pickle.UnpicklingError("numpy.dtype() called other than with a type code")
    return NumpyDType(code)


def _np_reconstruct(cls: Any, shape: Any, typecode: Any) -> NumpyArray:
    if cls is not _NDARRAY or shape != (0,) or typecode != b"b":
        raise pickle.UnpicklingError("numpy _reconstruct called other than for an ndarray")
    return NumpyArray()


def _np_scalar(dtype: Any, data: Any = b"") -> NumpyArray:
    if not isinstance(dtype, NumpyDType) or not isinstance(data, bytes) or len(data) > 64:
        raise pickle.UnpicklingError("numpy scalar() called other than with a dtype and bytes")
    return NumpyArray(dtype, data)


_NUMPY: dict[tuple[str, str], Callable[..., Any] | type] = {
    **{(m, n): f for m in ("numpy.core.multiarray", "numpy._core.multiarray")
       for n, f in (("_reconstruct", _np_reconstruct), ("scalar", _np_scalar))},
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _np_dtype,
}


class RecordUnpickler(AllowListUnpickler):
    """Unpickles an archive's ``data.pkl``: storages become :class:`StorageRef`."""

    def __init__(self, file: io.BytesIO, *,
                 lookup: Callable[[str, str], Any | None] = record_global) -> None:
        super().__init__(file, lookup)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        kind = pid[1]
        if not isinstance(kind, _StorageClass):
            raise pickle.UnpicklingError("unknown storage class")
        return StorageRef(str(pid[2]), kind.dtype, int(pid[4]))


def load_pickle(rb: RecordBytes, entries: dict[str, ZipEntry], *,
                lookup: Callable[[str, str], Any | None] = record_global,
                max_nodes: int | None = None) -> Any:
    """The archive's ``data.pkl``, unpickled onto stand-ins (tensors as :class:`TensorRef`).

    Args:
        lookup: the allow-list; a format that needs more stand-ins than a plain tensor (a
            DTensor's spec and mesh) passes one that falls back on :func:`record_global`.

    Raises:
        InputError: the archive has no data.pkl.
        Refused: the pickle names a global outside the allow-list (nothing was run).
        pickle.UnpicklingError and the rest of :data:`PICKLE_ERRORS`: a corrupt pickle.
    """
    pkl = entries.get("data.pkl")
    if pkl is None:
        raise InputError(f"{rb.where}: torch.save record has no data.pkl; corrupt")
    try:
        with gc_paused():
            value = RecordUnpickler(io.BytesIO(rb.read(pkl.data_offset, pkl.size)),
                                    lookup=lookup).load_deep(pkl.size)
    except MemoryError as err:
        # A damaged length field asks the C unpickler for an absurd buffer.
        raise pickle.UnpicklingError("a length in the pickle is beyond its data") from err
    except (Refused, CkptError, pickle.UnpicklingError):
        raise
    except Exception as e:  # noqa: BLE001 - see corrupt()
        raise corrupt(e) from e
    check_size(value, max_nodes)
    return value


# What one unpickled value may expand to, counting a shared reference each time it is reached
# (what walking it costs). A state dict of N tensors is about 2N values and an optimizer state
# about 9N, so the limit for whole files is far above any real model; a non-tensor entry (a
# step counter, a config) gets the small one. A pickle of shared references (x = [x, x] forty
# times) is far above both.
MAX_NODES = 100_000_000
OBJECT_MAX_NODES = 1_000_000
MAX_DEPTH = 100


class TooComplex(pickle.UnpicklingError):
    """An unpickled value too large (counting shared references each time), too deep, or
    cyclic to walk safely."""


_CONTAINERS = (dict, list, tuple, set, frozenset)


def check_size(root: Any, max_nodes: int | None = None) -> None:
    """Raise :class:`TooComplex` unless ``root`` expands to at most ``max_nodes`` (default
    :data:`MAX_NODES`) values, :data:`MAX_DEPTH` levels and no cycle. Iterative, and linear in
    the distinct nodes."""
    limit = MAX_NODES if max_nodes is None else max_nodes
    if not isinstance(root, _CONTAINERS):
        return
    sizes: dict[int, int] = {}
    active = {id(root)}
    frames: list[list[Any]] = [[root, iter(_children(root)), 1]]  # node, children, size
    while frames:
        frame = frames[-1]
        child = next(frame[1], _END)
        if child is _END:
            frames.pop()
            active.discard(id(frame[0]))
            sizes[id(frame[0])] = frame[2]
            if frames:
                frames[-1][2] += frame[2]
        elif not isinstance(child, _CONTAINERS):
            frame[2] += 1
        elif id(child) in sizes:
            frame[2] += sizes[id(child)]
        elif id(child) in active:
            raise TooComplex("the pickle holds a cycle")
        elif len(frames) >= MAX_DEPTH:
            raise TooComplex(f"the pickle nests deeper than {MAX_DEPTH} levels")
        else:
            active.add(id(child))
            frames.append([child, iter(_children(child)), 1])
        if frames and frames[-1][2] > limit:
            raise TooComplex(f"the pickle expands to more than {limit:,} values")


_END = object()


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    return list(node)


# --------------------------------------------------------------------------------------------
# Views of storages


@functools.lru_cache(maxsize=4096)  # a state dict repeats a few shapes many times
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (a size-0 dim counts as 1)."""
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def view_extent(shape: tuple[int, ...], stride: tuple[int, ...], storage_offset: int, *,
                contiguous: bool) -> int:
    """How many elements of its storage a view reaches (offset included)."""
    if contiguous:
        n = 1
        for s in shape:
            n *= s
        return storage_offset + n
    return storage_offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


def gather_strided(storage: bytes, *, itemsize: int, shape: tuple[int, ...],
                   stride: tuple[int, ...], storage_offset: int) -> bytes:
    """Copy a strided view out of its storage bytes into C order (rare: views are saved
    contiguous almost always)."""
    n = 1
    for s in shape:
        n *= s
    out = bytearray(n * itemsize)
    view = memoryview(storage)
    pos = 0
    for index in _iter_index(shape):
        src = storage_offset + sum(i * s for i, s in zip(index, stride, strict=True))
        out[pos : pos + itemsize] = view[src * itemsize : src * itemsize + itemsize]
        pos += itemsize
    return bytes(out)


def _iter_index(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    if 0 in shape:
        return
    index = [0] * len(shape)
    while True:
        yield tuple(index)
        d = len(shape) - 1
        while d >= 0:
            index[d] += 1
            if index[d] < shape[d]:
                break
            index[d] = 0
            d -= 1
        if d < 0:
            return
