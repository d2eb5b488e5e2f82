"""Write a mixture-of-experts-shaped DCP checkpoint with torch's own DCP writer: many small
tensors, each split in row chunks as FSDP2 on ``--ranks`` GPUs splits it.

    .venv/bin/python benchmarks/moe_checkpoint.py OUT [--layers 40] [--experts 128] [--ranks 64]

Shapes follow the issue's Qwen3-MoE-like model: ``layers x experts x 3`` expert projections of
``[64, 32]`` bf16, two norms per layer, a router per layer and an embedding, under accelerate's
``{"model": ...}`` key. 64 GPU processes do not fit on this machine, so one process saves with
a planner (a subclass of torch's ``DefaultSavePlanner``) whose write items are the row chunks
FSDP2 would give each rank (``torch.chunk`` on dim 0), and ``FileSystemWriter`` writes them
spread over ``--files`` ``.distcp`` files, as a 64-rank save writes one file per rank. Every
byte on disk (records, ``.metadata``) comes from torch's writer.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)


def moe_state(layers: int, experts: int, hidden: int = 32, inter: int = 64,
              vocab: int = 4096) -> dict[str, torch.Tensor]:
    """The model's full state dict (bf16; values from a fixed seed)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": t(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        sd[f"{p}.input_layernorm.weight"] = t(hidden)
        sd[f"{p}.post_attention_layernorm.weight"] = t(hidden)
        sd[f"{p}.mlp.gate.weight"] = t(experts, hidden)
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            sd[f"{q}.gate_proj.weight"] = t(inter, hidden)
            sd[f"{q}.up_proj.weight"] = t(inter, hidden)
            sd[f"{q}.down_proj.weight"] = t(inter, hidden)
    sd["model.norm.weight"] = t(hidden)
    return sd


def row_chunks(rows: int, ranks: int) -> list[tuple[int, int]]:
    """(first row, rows) of each rank's piece, as ``torch.chunk`` (FSDP2) splits dim 0; ranks
    past the end hold nothing and write nothing."""
    per = -(-rows // ranks)
    return [(r * per, min(per, rows - r * per)) for r in range(ranks) if r * per < rows]


class RowChunkPlanner(DefaultSavePlanner):
    """Write items are the row chunks of every tensor on ``ranks`` ranks."""

    def __init__(self, ranks: int) -> None:
        super().__init__()
        self.ranks = ranks

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, tensor in self.state_dict.items():
            props = TensorProperties.create_from_tensor(tensor)
            for first, n in row_chunks(tensor.shape[0], self.ranks):
                offsets = torch.Size([first] + [0] * (tensor.dim() - 1))
                sizes = torch.Size([n, *tensor.shape[1:]])
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), props,
                                                tensor.size())))
        self.plan = dataclasses.replace(SavePlan(items), planner_data=self.mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        tensor = self.state_dict[index.fqn]
        first = index.offset[0]
        rows = next(n for f, n in row_chunks(tensor.shape[0], self.ranks) if f == first)
        return tensor.narrow(0, first, rows).clone()


def write(out: Path, *, layers: int, experts: int, ranks: int, files: int) -> dict[str, int]:
    """Write the checkpoint into ``out``; returns its counts."""
    sd = moe_state(layers, experts)
    chunks = sum(len(row_chunks(t.shape[0], ranks)) for t in sd.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd},
                 storage_writer=dcp.FileSystemWriter(out, thread_count=files),
                 planner=RowChunkPlanner(ranks), no_dist=True)
    return {"tensors": len(sd), "chunks": chunks,
            "payload": sum(t.numel() * t.element_size() for t in sd.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--files", type=int, default=64)
    args = ap.parse_args()
    t0 = time.perf_counter()
    counts = write(args.out, layers=args.layers, experts=args.experts, ranks=args.ranks,
                   files=args.files)
    print(f"{args.out}: {counts['tensors']} tensors, {counts['chunks']} chunks, "
          f"{counts['payload'] / 1e6:.1f} MB payload, in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
