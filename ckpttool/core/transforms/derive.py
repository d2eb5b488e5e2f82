"""Output tensors computed from whole source tensors: a LoRA update folded into a weight, a
fused projection split or permuted into a model family's own names.

A :class:`Derived` stands where a stored :class:`~ckpttool.formats.base.Tensor` would in a
merge plan. Merge reads its inputs whole, calls ``compute`` and casts the result by the dtype
policy, one output tensor at a time: memory is bounded by the inputs of the largest output
tensor, never by the model. Torch is imported only here, only when a plan holds one.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpttool.core.checkpoint import tensors
from ckpttool.core.runtime.scratch import buffer, held
from ckpttool.errors import InputError
from ckpttool.formats.base import Blocks, Reader, Tensor
from ckpttool.formats.codecs.dtypes import DType

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Derived:
    """An output tensor ``compute(inputs)`` of ``shape``; ``dtype`` is what the dtype policy
    sees (the dtype of the weight it replaces), whatever dtype ``compute`` returns."""

    name: str  # the output name, for messages
    inputs: tuple[Tensor, ...]
    dtype: DType
    shape: tuple[int, ...]
    compute: Callable[[list[torch.Tensor]], torch.Tensor]
    what: str = ""  # one line for reports: "lora fused (scale 2.0)", "split of wqkv"
    # The reader of each input where it is not the merge's own (an adapter merged into a
    # separate base model); empty or None entries: the merge's reader.
    readers: tuple[Reader | None, ...] = ()
    # Per input, an index along its dim 0 to read instead of the whole tensor (one expert of
    # a grouped [E, ...] weight): only that slice's bytes are read, so splitting a tensor in E
    # costs its bytes once, not E times. A tuple indexes the leading dims (one layer's expert
    # of a stacked [L, E, ...] weight). Empty: every input whole.
    select: tuple[int | tuple[int, ...] | None, ...] = ()
    # Per input, elements [start, stop) of its C order, read as a tensor of the given shape
    # (one part of one expert of a fused [E, 2I, H] weight): only those bytes are read.
    # Empty or None entries: ``select``, else the whole input.
    spans: tuple[tuple[int, int, tuple[int, ...]] | None, ...] = ()
    # Per input, boxes of it read one after the other, each in C order (Megatron's layer,
    # q/k/v, gate/up and expert slices: :data:`~ckpttool.core.checkpoint.tensors.Boxes`),
    # as a tensor of ``shape`` where the numbers of elements agree (else flat). With
    # :func:`identity` as ``compute`` and one input, the output is a pure rearrangement of
    # stored bytes (:func:`is_selection`): merge moves them file to file, no torch.
    boxes: tuple[tensors.Boxes | None, ...] = ()
    # ``compute`` as the output's bytes in consecutive pieces, cast to the torch dtype given
    # (as ``Tensor.to`` would), each piece valid until the next is asked for: a merge writes
    # each while it is still in the core's cache, and the whole output is never in memory
    # (a LoRA fold, block by block of rows: :func:`stream`). None: ``compute``.
    pieces: Callable[[list[torch.Tensor], torch.dtype], Iterator[memoryview]] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def identity(inputs: list[torch.Tensor]) -> torch.Tensor:
    """``compute`` of a derived tensor that is its one input as read (a selection)."""
    return inputs[0]


def is_selection(derived: Derived) -> bool:
    """True if ``derived`` is boxes of one stored tensor and nothing computed on them."""
    return (len(derived.inputs) == 1 and derived.compute is identity
            and len(derived.boxes) == 1 and derived.boxes[0] is not None
            and not derived.readers)


def read_whole(reader: Reader, tensor: Tensor) -> torch.Tensor:
    """The full tensor, assembled from its chunks in C order."""
    return _read_elements(reader, tensor, 0, tensor.numel, tensor.shape)


def read_slice(reader: Reader, tensor: Tensor, index: int | tuple[int, ...]) -> torch.Tensor:
    """``tensor[index]`` (along dim 0; a tuple: along the leading dims), reading only its
    bytes."""
    at = (index,) if isinstance(index, int) else index
    shape = tensor.shape[len(at):]
    inner = math.prod(shape)
    flat = 0
    for i, n in zip(at, tensor.shape, strict=False):
        flat = flat * n + i
    return _read_elements(reader, tensor, flat * inner, (flat + 1) * inner, shape)


def _read_elements(reader: Reader, tensor: Tensor, start: int, stop: int,
                   shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    dtype = getattr(torch, tensor.dtype.torch_name)
    data = tensors.read_range(reader, tensor, start, stop)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


def _read_boxes(reader: Reader, tensor: Tensor, boxes: tensors.Boxes,
                shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    data = tensors.read_boxes(reader, tensor, boxes)
    dtype = getattr(torch, tensor.dtype.torch_name)
    numel = len(data) // tensor.dtype.itemsize
    if not data:
        return torch.empty(shape if math.prod(shape) == 0 else (0,), dtype=dtype)
    flat = torch.frombuffer(data, dtype=dtype)
    return flat.reshape(shape) if math.prod(shape) == numel else flat


def scratch(name: str, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A flat work tensor of ``numel`` elements of ``dtype`` (float32 by default; contents
    undefined) on this thread's work buffer ``name`` (:func:`ckpttool.core.runtime.scratch.
    buffer`, kept from one tensor to the next, on a cache line); its bytes are
    :func:`scratch_bytes` of the same name."""
    import torch

    dtype = dtype or torch.float32
    if not numel:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer(name, numel * dtype.itemsize), dtype=dtype,
                            count=numel)


def scratch_bytes(name: str, nbytes: int) -> memoryview:
    """The first ``nbytes`` of this thread's work buffer ``name`` (:func:`scratch`)."""
    return held(name, nbytes)


# An input of at least this many bytes is computed on where it lies in the page cache.
MAPPED_INPUT = 1 << 20


def _mapped_whole(reader: Reader, tensor: Tensor) -> torch.Tensor:
    """:func:`read_whole`, but a tensor stored as one run of a local file comes as a view of
    the page cache (copy-on-write, never written through): no copy of a weight's bytes before
    it is computed on (measured: a third of a LoRA fold's reading time)."""
    import torch

    chunks = [c for c in tensor.chunks if c.numel]
    size = tensor.nbytes
    if (len(chunks) != 1 or chunks[0].numel != tensor.numel or size < MAPPED_INPUT
            or not reader.capabilities.local_files):
        return read_whole(reader, tensor)
    p = tensors.payload(reader, tensor, chunks[0])
    if p.start is None or p.compression is not None:
        return read_whole(reader, tensor)
    # Blocks of at most len(buf) bytes: one, mapped; where the store cannot map it, read into
    # buf (an anonymous mapping: its pages are made only where they are written).
    buf = memoryview(mmap.mmap(-1, size))
    views = list(reader.read(Blocks(p.file, p.start, size, buf)))
    if len(views) != 1 or len(views[0]) != size:
        return read_whole(reader, tensor)  # cut short: read_whole says where, in its words
    dtype = getattr(torch, tensor.dtype.torch_name)
    return torch.frombuffer(views[0], dtype=dtype).reshape(tensor.shape)


def _inputs(reader: Reader, derived: Derived) -> list[torch.Tensor]:
    """``derived``'s inputs as it asks for them: boxes, spans, slices or whole; a whole input
    of a tensor computed in pieces (a weight folded block by block) where it lies in the page
    cache."""
    num = len(derived.inputs)
    readers = derived.readers + (None,) * (num - len(derived.readers))
    select = derived.select + (None,) * (num - len(derived.select))
    spans = derived.spans + (None,) * (num - len(derived.spans))
    boxes = derived.boxes + (None,) * (num - len(derived.boxes))
    whole = _mapped_whole if derived.pieces is not None else read_whole
    return [
        _read_boxes(r or reader, t, b, derived.shape) if b is not None
        else _read_elements(r or reader, t, *span) if span is not None
        else whole(r or reader, t) if i is None else read_slice(r or reader, t, i)
        for r, t, i, span, b in zip(readers, derived.inputs, select, spans, boxes,
                                    strict=True)]


def stream(reader: Reader, derived: Derived, dtype: DType) -> Iterator[memoryview]:
    """``derived`` (one with ``pieces``) computed and cast to ``dtype``: its C-ordered bytes in
    consecutive pieces, each valid until the next is asked for.

    Raises:
        InputError: the pieces do not add up to the planned tensor (a wrong recipe must fail
            loudly, never write a tensor cut short).
    """
    import torch

    assert derived.pieces is not None
    size = derived.numel * dtype.itemsize
    done = 0
    if size:
        for piece in derived.pieces(_inputs(reader, derived), getattr(torch, dtype.torch_name)):
            done += len(piece)
            if done > size:
                break
            yield piece
    if done != size:
        raise InputError(f"'{derived.name}': computed {done} bytes, not the planned {size} "
                         f"({derived.what or 'derived tensor'})")


def materialise(reader: Reader, derived: Derived, dtype: DType) -> bytearray:
    """``derived`` computed and cast to ``dtype``, as C-ordered bytes.

    Raises:
        InputError: ``compute`` gave a tensor of another shape (a wrong recipe or name map
            must fail loudly, never write a reshaped tensor).
    """
    import torch

    if derived.pieces is not None:
        whole = bytearray()
        for piece in stream(reader, derived, dtype):
            whole += piece
        return whole
    target = getattr(torch, dtype.torch_name)
    out_tensor = derived.compute(_inputs(reader, derived))
    if tuple(out_tensor.shape) != derived.shape:
        raise InputError(f"'{derived.name}': computed shape {list(out_tensor.shape)} is not the "
                         f"planned {list(derived.shape)} ({derived.what or 'derived tensor'})")
    buf = bytearray(derived.numel * dtype.itemsize)
    if buf:  # into our own buffer: no numpy, no storage a view may share with its base
        torch.frombuffer(buf, dtype=target).copy_(out_tensor.reshape(-1).to(target))
    return buf
