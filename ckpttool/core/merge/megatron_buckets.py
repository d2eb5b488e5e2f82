"""Megatron-Core's distributed optimizer in its default ``dp_reshardable`` layout, read back
into model space (``merge --part optimizer``).

That layout saves each gradient bucket of DDP's buffers as one flat tensor per kind of state
(``optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_<dtypes>.bucket_idx_K.<kind>``;
a ChainedOptimizer's dense parameters below ``chained_0.``, its expert parameters below
``chained_1.``), of the bucket's unpadded length. Nothing in the checkpoint names the
parameters in a bucket: DDP lays them out itself, and this module lays them out the same way
from what the checkpoint does record (``args`` and the model's own tensors):

* ``G`` is the rank in the model-parallel group that owns the buffers: ``pp * TP + tp`` for
  the dense parameters, ``(pp * EP + ep) * ETP + etp`` for the experts'; ``B`` is the model
  chunk (one buffer per virtual pipeline stage);
* a chunk holds, in module registration order, the embedding (first stage), its layers
  (``num_layers / (PP * VPP)`` each, stage ``v * PP + pp``), then the final norm and output
  layer (last stage; a tied one there is a parameter of its own, saved as the embedding);
  each layer's parameters in the order its modules register them (:data:`_LOCAL_ORDER` for
  ``--transformer-impl local``, :data:`_TE_ORDER` for Transformer Engine), the expert
  parameters in the expert optimizer's buffers only;
* DDP walks that list backwards, starting each parameter at a multiple of 64 elements and a
  new bucket where the last one reached its recorded length;
* each parameter's local piece is its model tensor's chunk for that rank (the tensor-parallel
  rank's, or both gate and up halves of a SwiGLU ``linear_fc1``).

Every parameter so placed must start and end where the checkpoint's own chunks of the bucket
do (each parameter's piece on each data-parallel rank is its own chunk), and every bucket must
be filled to its length: a layout this module does not know (another layer spec, an uneven
pipeline split) fails these checks and is refused (exit 4), never guessed. The result is one
tensor per kind and parameter, ``optimizer.state.<kind>.<model key>``, of the model tensor's
global shape, whose chunks point at the stored bytes (raw, no copy): the fully_reshardable
layout's names, which :mod:`ckpttool.core.merge.megatron_optimizer` maps to Hugging Face names.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ckpttool.core.checkpoint import tensors
from ckpttool.errors import UnsupportedError
from ckpttool.formats.base import RAW, Chunk, Payload, Reader, Tensor

_BUCKET = re.compile(r"^(?P<chain>chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(?P<g>\d+)"
                     r"\.gbuf_idx_(?P<b>\d+)\.dtype_.+\.bucket_idx_(?P<k>\d+)\.(?P<kind>\w+)$")
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")
_ALIGN = 64  # DDP starts every parameter at a multiple of 64 elements

# A layer's parameters in registration order, by their checkpoint keys below
# ``decoder.layers.`` (the local layer spec maps its norms' keys onto TE's fused names).
# (Attention builds its core attention, whose learnable softmax offset is gpt-oss's sinks,
# before linear_proj; SelfAttention its linear_qkv after both.)
_ATTENTION = ("self_attention.core_attention.softmax_offset", "self_attention.linear_proj.weight",
              "self_attention.linear_proj.bias")
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_QKV_NORM = ("self_attention.linear_qkv.layer_norm_weight",
             "self_attention.linear_qkv.layer_norm_bias")
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
             "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias")
_FC1_NORM = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias")
_FC = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
       "mlp.linear_fc2.bias")
_MOE = ("mlp.router.weight", "mlp.router.bias")
_EXPERTS = ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc1.bias",
            "mlp.experts.experts.linear_fc2.weight", "mlp.experts.experts.linear_fc2.bias")
_SHARED = ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.bias",
           "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2.bias",
           "mlp.shared_experts.gate_weight")
_EXPERT_MARK = "mlp.experts."
# --transformer-impl local: input_layernorm, self_attention (linear_proj, linear_qkv, q/k
# norms), pre_mlp_layernorm, mlp (linear_fc1, linear_fc2 | router, experts, shared experts).
_LOCAL_ORDER = (("input_layernorm.weight", "input_layernorm.bias"), _QKV_NORM, _ATTENTION, _QKV,
                _QK_NORMS, ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"), _FC1_NORM,
                _FC, _MOE, _EXPERTS, _SHARED)
# Transformer Engine: the norms live in the fused linear_qkv / linear_fc1 modules, each
# registering its norm before its weight.
_TE_ORDER = (("input_layernorm.weight", "input_layernorm.bias"), _ATTENTION, _QKV_NORM, _QKV,
             _QK_NORMS, ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"), _FC1_NORM,
             _FC, _MOE, _EXPERTS, _SHARED)
_FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_LAST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
_UNEVEN = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
           "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
           "account_for_loss_in_pipeline_split", "mtp_num_layers")

Box = tuple[tuple[int, ...], tuple[int, ...]]


def holds(named: Sequence[tuple[str, Any]]) -> bool:
    """True if ``named`` (an optimizer part) holds dp_reshardable bucket tensors."""
    return any(_BUCKET.match(n) for n, _ in named)


def _refused(why: str) -> UnsupportedError:
    return UnsupportedError(
        f"the optimizer state is Megatron-Core's distributed optimizer in its dp_reshardable "
        f"layout, and {why}; merge --part optimizer does not read that layout yet (the model "
        "merges: merge without --part). Save the run with "
        "--dist-ckpt-optim-fully-reshardable for the optimizer state")


def _int(args: Mapping[str, Any], key: str, default: int) -> int:
    value = args.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def unbucketed(model: Sequence[Tensor], named: Sequence[tuple[str, Any]],
               args: Mapping[str, Any] | None, reader: Reader) -> list[tuple[str, Tensor]]:
    """``named``'s bucket tensors as ``optimizer.state.<kind>.<model key>`` tensors of the
    model's shapes (what :func:`holds` found), other entries dropped.

    Args:
        model: the checkpoint's model tensors (their global shapes and chunks).
        args: Megatron-LM's ``args`` (the parallel layout).
        reader: the checkpoint's reader: where each stored piece's elements are.

    Raises:
        UnsupportedError: a layout this module cannot place exactly (see the module doc).
    """
    if not isinstance(args, Mapping):
        raise _refused("the run's args (the parallel layout) are not readable")
    for key in _UNEVEN:
        if args.get(key) not in (None, False, 0):
            raise _refused(f"args.{key} is set (an uneven pipeline split or MTP layers)")
    tp = _int(args, "tensor_model_parallel_size", 1)
    pp = _int(args, "pipeline_model_parallel_size", 1)
    ep = _int(args, "expert_model_parallel_size", 1)
    etp = _int(args, "expert_tensor_parallel_size", tp)
    vpp = _int(args, "virtual_pipeline_model_parallel_size", 1)
    layers = _int(args, "num_layers", 0)
    experts = _int(args, "num_experts", 0)
    impl = args.get("transformer_impl", "transformer_engine")
    order = _LOCAL_ORDER if impl == "local" else _TE_ORDER
    if not layers or layers % (pp * vpp):
        raise _refused(f"{layers} layers do not split evenly over PP {pp} x VPP {vpp}")
    per_stage = layers // (pp * vpp)
    local_experts = experts // ep if experts else 0
    tensors = {t.name: t for t in model}
    tied = not args.get("untie_embeddings_and_output_weights") and "output_layer.weight" \
        not in tensors

    buckets: dict[tuple[str, int, int, str], dict[int, Tensor]] = {}
    for name, tensor in named:
        m = _BUCKET.match(name)
        if m and isinstance(tensor, Tensor):
            where = (m["chain"] or "", int(m["g"]), int(m["b"]), m["kind"])
            buckets.setdefault(where, {})[int(m["k"])] = tensor
    chains = sorted({c for c, _, _, _ in buckets})
    if len(chains) < 2 and etp != tp and any(_EXPERT_MARK in k for k in tensors):
        raise _refused(
            f"its experts (expert-tensor-parallel size {etp}) share the dense parameters' "
            f"buckets (tensor-parallel size {tp}, no expert-parallel optimizer): each "
            "data-parallel rank saved its part of one bucket from its own expert shards, so "
            "no expert's whole state is in the checkpoint")
    out: dict[str, list[Chunk]] = {}
    dtypes: dict[str, Any] = {}
    starts: dict[int, Payload] = {}  # per stored piece of a bucket, decoded once
    by_place: dict[int, tuple[list[Chunk], list[int]]] = {}
    for (chain, group, gbuf, kind), by_index in sorted(buckets.items()):
        expert = len(chains) > 1 and chain == chains[-1]
        if expert:
            rank_tp, stage = group % etp, group // (etp * ep)
            rank_ep = (group // etp) % ep
        else:
            rank_tp, stage, rank_ep = group % tp, group // tp, 0
        if stage >= pp or gbuf >= vpp:
            raise _refused(f"'{chain}...dp_group_idx_{group}.gbuf_idx_{gbuf}' is not a stage "
                           f"of PP {pp} x VPP {vpp}")
        virtual = gbuf * pp + stage
        params = _params(tensors, order, first=virtual == 0, last=virtual == pp * vpp - 1,
                         layers=range(virtual * per_stage, (virtual + 1) * per_stage),
                         expert=expert if len(chains) > 1 else None,
                         experts=range(rank_ep * local_experts, (rank_ep + 1) * local_experts),
                         tied_copy=tied)
        placed = _place(params, tensors, [by_index[k] for k in sorted(by_index)],
                        rank_tp, etp if expert else tp, where=f"{chain}dp_group_idx_{group}."
                        f"gbuf_idx_{gbuf} ({kind})")
        for key, bucket, span, boxes in placed:
            name = f"optimizer.state.{kind}.{key}"
            dtypes[name] = bucket.dtype
            have = {c.offsets for c in out.setdefault(name, [])}
            if boxes[0][0] in have:
                continue  # replicated over tensor-parallel ranks: the first rank's copy
            out[name] += _chunks(reader, bucket, span, boxes, starts, by_place)
    result = []
    for name, chunks in out.items():
        key = name.split(".", 3)[3]
        shape = tensors[key].shape
        if sum(c.numel for c in chunks) != math.prod(shape):
            raise _refused(f"'{key}' is not whole in the buckets")
        chunks.sort(key=lambda c: c.offsets)
        result.append((name, Tensor(name, tuple(name.split(".", 3)), dtypes[name], shape,
                                    tuple(chunks))))
    return result


def _params(tensors: Mapping[str, Tensor], order: tuple[tuple[str, ...], ...], *,
            first: bool, last: bool, layers: range, expert: bool | None, experts: range,
            tied_copy: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """One model chunk's parameters in registration order: ``(model key, index into its
    stacked leading dims)`` (``(layer,)``, ``(layer, expert)``, or ``()``); ``expert``: only
    the experts' (True), only the others (False), or all (None)."""
    def wanted(key: str) -> bool:
        return key in tensors and (expert is None or (_EXPERT_MARK in key) == expert)

    out: list[tuple[str, tuple[int, ...]]] = []
    if first:
        out += [(k, ()) for k in _FIRST if wanted(k)]
    for layer in layers:
        for group in order:
            keys = [f"decoder.layers.{k}" for k in group]
            if group is _EXPERTS:
                out += [(k, (layer, e)) for e in experts for k in keys if wanted(k)]
            else:
                out += [(k, (layer,)) for k in keys if wanted(k)]
    if last:
        out += [(k, ()) for k in _LAST if wanted(k)]
        if tied_copy and not first and expert is not True:
            # a tied output layer on another stage than the embedding: a parameter of its
            # own there (kept equal to the embedding by Megatron), saved as the embedding
            out.append((_FIRST[0], ()))
    return out


def _local_boxes(tensor: Tensor, lead: tuple[int, ...], rank: int, ranks: int) -> list[Box]:
    """The boxes of ``tensor`` that tensor-parallel rank ``rank`` holds of instance ``lead``,
    in the order its local parameter's elements follow."""
    chunks = sorted((c for c in tensor.chunks if c.offsets[:len(lead)] == lead),
                    key=lambda c: c.offsets)
    if len(chunks) == 1:
        return [(chunks[0].offsets, chunks[0].sizes)]
    if not chunks or len(chunks) % ranks:
        raise _refused(f"'{tensor.name}' is stored in {len(chunks)} pieces per instance, not "
                       f"a multiple of its {ranks} tensor-parallel ranks")
    per = len(chunks) // ranks
    return [(chunks[i * ranks + rank].offsets, chunks[i * ranks + rank].sizes)
            for i in range(per)]


def _place(params: list[tuple[str, tuple[int, ...]]], tensors: Mapping[str, Tensor],
           buckets: list[Tensor], rank: int, ranks: int, *, where: str
           ) -> list[tuple[str, Tensor, int, list[Box]]]:
    """Each parameter's bucket and first element there, as DDP lays them out (backwards,
    64-aligned, a new bucket where one reached its length), checked against the stored
    chunks' boundaries."""
    placed = []
    index, at = 0, 0
    bounds = [{c.offsets[0] for c in b.chunks} | {c.offsets[0] + c.sizes[0] for c in b.chunks}
              for b in buckets]
    for key, lead in reversed(params):
        boxes = _local_boxes(tensors[key], lead, rank, ranks)
        numel = sum(math.prod(s) for _, s in boxes)
        if index >= len(buckets):
            raise _refused(f"{where}: the model's parameters do not fit its buckets")
        at = -(-at // _ALIGN) * _ALIGN
        if at and at == buckets[index].shape[0]:
            # a bucket closed before a parameter that needs its own (the shared embedding
            # at PP > 1), its length counting the alignment
            index, at = index + 1, 0
            if index >= len(buckets):
                raise _refused(f"{where}: the model's parameters do not fit its buckets")
        bucket = buckets[index]
        if at + numel > bucket.shape[0]:
            raise _refused(f"{where}: '{key}' does not fit bucket {index}")
        if at not in bounds[index] or at + numel not in bounds[index]:
            raise _refused(f"{where}: '{key}' would lie across the stored pieces of bucket "
                           f"{index} (another layer spec or parameter order)")
        placed.append((key, bucket, at, boxes))
        at += numel
        if at == bucket.shape[0]:
            index, at = index + 1, 0
    if index != len(buckets):
        raise _refused(f"{where}: the model's parameters fill {index} of {len(buckets)} "
                       "buckets")
    return placed


def _chunks(reader: Reader, bucket: Tensor, span: int, boxes: list[Box],
            starts: dict[int, Payload],
            by_place: dict[int, tuple[list[Chunk], list[int]]]) -> list[Chunk]:
    """Raw chunks of the global tensor: ``boxes`` (in order) filled from the bucket's
    elements from ``span`` on, where the stored pieces lie (``starts`` and ``by_place``: each
    piece's payload and each bucket's pieces by position, found once)."""
    if id(bucket) not in by_place:
        pieces = sorted(bucket.chunks, key=lambda c: c.offsets[0])
        by_place[id(bucket)] = (pieces, [c.offsets[0] for c in pieces])
    pieces, firsts = by_place[id(bucket)]
    item = bucket.dtype.itemsize
    out: list[Chunk] = []
    at = span
    for offsets, sizes in boxes:
        numel = math.prod(sizes)
        lo, hi = at, at + numel
        i = bisect.bisect_right(firsts, lo) - 1
        while lo < hi:
            piece = pieces[i]
            end = min(hi, piece.offsets[0] + piece.sizes[0])
            payload = starts.get(id(piece))
            if payload is None:
                payload = starts[id(piece)] = tensors.payload(reader, bucket, piece)
            if payload.start is None:
                raise _refused(f"'{bucket.name}' is stored as a strided view")
            base = payload.start + (lo - piece.offsets[0]) * item
            # The record's CRC-32 covers its whole storage: merge checks it as it reads.
            stored = (payload.storage_offset, payload.storage_size)
            done = 0
            for sub_off, sub_size in _sub_boxes(sizes, lo - at, end - at):
                n = math.prod(sub_size)
                out.append(Chunk(tuple(o + s for o, s in zip(offsets, sub_off, strict=True)),
                                 sub_size, piece.file, base + done * item, n * item, RAW,
                                 payload.crc32, stored if payload.crc32 is not None else None))
                done += n
            lo = end
            i += 1
        at = hi
    return out


def _sub_boxes(sizes: tuple[int, ...], lo: int, hi: int
               ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements ``[lo, hi)`` of a box of ``sizes`` in C order, as boxes (offsets within it,
    sizes), in order."""
    if lo >= hi:
        return []
    if not sizes:
        return [((), ())]
    inner = math.prod(sizes[1:])
    rest = tuple(0 for _ in sizes[1:])
    first, last = lo // inner, hi // inner
    if first == last or (first + 1 == last and hi % inner == 0 and lo % inner):
        row = first
        return [((row, *o), (1, *s)) for o, s in
                _sub_boxes(sizes[1:], lo - row * inner, min(hi - row * inner, inner))]
    out = []
    if lo % inner:
        out += [((first, *o), (1, *s)) for o, s in _sub_boxes(sizes[1:], lo % inner, inner)]
        first += 1
    if last > first:
        out.append(((first, *rest), (last - first, *sizes[1:])))
    if hi % inner:
        out += [((last, *o), (1, *s)) for o, s in _sub_boxes(sizes[1:], 0, hi % inner)]
    return out


def model_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The model's tensors among a Megatron checkpoint's (not the optimizer's)."""
    return [t for t in tensors if not _OPTIMIZER.match(t.name)]
