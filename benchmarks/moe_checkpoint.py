"""Write a mixture-of-experts-shaped DCP checkpoint with torch's own DCP writer: many small
tensors, each split in row chunks as FSDP2 on ``--ranks`` GPUs splits it.

    .venv/bin/python benchmarks/moe_checkpoint.py OUT [--layers 40] [--experts 128] [--ranks 64]
                                                  [--workers 1] [--check]

Shapes follow the issue's Qwen3-MoE-like model: ``layers x experts x 3`` expert projections of
``[64, 32]`` bf16, two norms per layer, a router per layer and an embedding, under accelerate's
``{"model": ...}`` key.

64 GPU processes do not fit on this machine, so the save runs the steps ``dcp.save`` runs on
``--ranks`` ranks, one rank after another, with torch's own objects: every rank's planner (a
subclass of torch's ``DefaultSavePlanner``) plans the row chunk FSDP2 gives that rank
(``torch.chunk`` on dim 0); rank 0's planner makes the global plan and the metadata
(``create_global_plan``: torch's index hints and overlap/bounds validation), torch's
``FileSystemWriter.prepare_global_plan`` names each rank's file (``__<rank>_0.distcp``); each
rank's ``FileSystemWriter.write_data`` writes its file and ``FileSystemWriter.finish`` writes
``.metadata``. Every byte on disk comes from torch's writer; the layout is what a 64-rank save
with one writer thread per rank writes. The rank files are written in ``--workers`` processes
of their own (1 by default; each makes the state dict's values and one rank's plan at a time);
the global plan is made in a process of its own before them and once more for ``finish``
after them, so nothing holds all chunks while the ranks write. A stopped build goes on from
the rank files it finished (kept in ``OUT.build``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing
import os
import pickle
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult


def moe_state(layers: int, experts: int, hidden: int = 32, inter: int = 64,
              vocab: int = 4096, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The model's full state dict (bf16; values from a fixed seed). ``device="meta"``: the
    same names, shapes and dtypes without values (for planning)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        if device == "meta":
            return torch.empty(*shape, dtype=torch.bfloat16, device="meta")
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


def row_chunk(rows: int, ranks: int, rank: int) -> tuple[int, int] | None:
    """Rank ``rank``'s (first row, rows), or None where it holds nothing."""
    per = -(-rows // ranks)
    first = rank * per
    return (first, min(per, rows - first)) if first < rows else None


class RowChunkPlanner(DefaultSavePlanner):
    """One rank's planner: its write items are the row chunk FSDP2 gives ``rank`` of every
    tensor on ``ranks`` ranks (what torch plans for a DTensor sharded on dim 0)."""

    def __init__(self, ranks: int, rank: int) -> None:
        super().__init__()
        self.ranks = ranks
        self.rank = rank

    def _rows(self, rows: int) -> list[tuple[int, int]]:
        """The (first row, rows) pieces of a tensor of ``rows`` rows this planner writes."""
        piece = row_chunk(rows, self.ranks, self.rank)
        return [] if piece is None else [piece]

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, tensor in self.state_dict.items():
            pieces = self._rows(tensor.shape[0])
            if not pieces:
                continue
            props = TensorProperties.create_from_tensor(tensor)
            for first, n in pieces:
                offsets = torch.Size([first] + [0] * (tensor.dim() - 1))
                sizes = torch.Size([n, *tensor.shape[1:]])
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), props,
                                                tensor.size())))
        self.plan = dataclasses.replace(SavePlan(items), planner_data=self.mappings)
        return self.plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        # Every chunk has exactly one writer (its rank): nothing to deduplicate. torch's
        # dedup_save_plans would index all items of all ranks only to find that.
        return all_plans

    def lookup_object(self, index: MetadataIndex) -> Any:
        # A view; torch's loader copies it into a storage of its own before torch.save.
        tensor = self.state_dict[index.fqn]
        first = index.offset[0]
        per = -(-tensor.shape[0] // self.ranks)
        return tensor.narrow(0, first, min(per, tensor.shape[0] - first))


class AllRanksPlanner(RowChunkPlanner):
    """One planner for every rank: its write items are the row chunks of every tensor on
    ``ranks`` ranks, which ``FileSystemWriter(thread_count=files)`` spreads over ``files``
    files (the tests' small checkpoints: other file counts than ranks, one process)."""

    def __init__(self, ranks: int) -> None:
        super().__init__(ranks, 0)

    def _rows(self, rows: int) -> list[tuple[int, int]]:
        return row_chunks(rows, self.ranks)

    def lookup_object(self, index: MetadataIndex) -> Any:
        # A copy: one process writes every chunk, each with a storage of its own.
        return super().lookup_object(index).clone()


def write_one_process(out: Path, *, layers: int, experts: int, ranks: int, files: int
                      ) -> dict[str, int]:
    """The checkpoint written by one ``dcp.save`` with :class:`AllRanksPlanner` over
    ``files`` files (small levels and the tests); returns its counts."""
    sd = moe_state(layers, experts)
    chunks = sum(len(row_chunks(t.shape[0], ranks)) for t in sd.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd},
                 storage_writer=dcp.FileSystemWriter(out, thread_count=files),
                 planner=AllRanksPlanner(ranks), no_dist=True)
    return {"tensors": len(sd), "chunks": chunks,
            "payload": sum(t.numel() * t.element_size() for t in sd.values())}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg} (rss {_rss_mb():.0f} MB, load "
          f"{os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)


def _central_plan(planner: RowChunkPlanner, writer: dcp.FileSystemWriter, tmp: Path
                  ) -> SavePlan:
    """The rank's central plan as the coordinator made it, rebuilt in the rank's own process
    from torch's outputs that the coordinator left in ``tmp``: the index hints of
    ``create_global_plan`` (``create_default_global_save_plan`` puts each into the item's
    index, as here) and the file prefix of ``prepare_global_plan``. Rebuilding costs less
    than pickling every item over to the rank, as ``dcp.save``'s scatter does."""
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    with open(tmp / f"plan-{planner.rank}.pkl", "rb") as f:
        prefix, names, hints = pickle.load(f)
    if [(i.index.fqn, tuple(i.index.offset)) for i in local_plan.items] != names:
        raise AssertionError(f"rank {planner.rank}: local plan differs from the coordinator's")
    items = [dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint))
             for item, hint in zip(local_plan.items, hints, strict=True)]
    return dataclasses.replace(local_plan, items=items, storage_data=prefix)


def _write_ranks(out: Path, tmp: Path, layers: int, experts: int, ranks: int,
                 mine: list[int]) -> None:
    """One writer process: each rank's ``write_data`` from its central plan, as that rank runs
    it in ``dcp.save``. Each rank's write results go to ``tmp/results-<rank>.pkl`` as their
    fields (fqn, offset, index hint, size, file, file offset, length), for the coordinator's
    ``finish``; a rank whose results are there is done (a stopped build goes on from there)."""
    warnings.simplefilter("ignore")
    sd = {"model": moe_state(layers, experts)}
    for rank in mine:
        t0, c0 = time.perf_counter(), time.process_time()
        planner = RowChunkPlanner(ranks, rank)
        planner.set_up_planner(sd, is_coordinator=rank == 0)
        writer = dcp.FileSystemWriter(out, thread_count=1)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        central_plan = _central_plan(planner, writer, tmp)
        results = writer.write_data(planner.finish_plan(central_plan), planner).value()
        fields = []
        for r in results:
            info = r.storage_data
            if info.transform_descriptors is not None:
                raise AssertionError("no stream transforms expected")
            fields.append((r.index.fqn, tuple(r.index.offset), r.index.index, r.size_in_bytes,
                           info.relative_path, info.offset, info.length))
        part = tmp / f"results-{rank}.part"
        with open(part, "wb") as f:
            pickle.dump(fields, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(part, tmp / f"results-{rank}.pkl")
        _log(f"rank {rank}: {len(results)} chunks written in {time.perf_counter() - t0:.1f} s, "
             f"{time.process_time() - c0:.1f} CPU s")


def _load_results(tmp: Path, rank: int, names: dict[str, str]) -> list[WriteResult]:
    """A rank's write results, as torch's ``write_data`` returned them; each name is the
    metadata's own string object (``names``), as in a one-process save, so that ``.metadata``
    pickles it once (the 1M cache was written so)."""
    with open(tmp / f"results-{rank}.pkl", "rb") as f:
        fields = pickle.load(f)
    return [WriteResult(index=MetadataIndex(names[fqn], torch.Size(offset), hint),
                        size_in_bytes=size, storage_data=_StorageInfo(path, start, length))
            for fqn, offset, hint, size, path, start, length in fields]


def _global_plan(out: Path, tmp: Path, layers: int, experts: int, ranks: int
                 ) -> tuple[dcp.FileSystemWriter, Metadata]:
    """What ``dcp.save`` runs on every rank (local step), then on the coordinator (global
    step), with the state dict's shapes only. Leaves each rank's part of the central plan in
    ``tmp/plan-<rank>.pkl`` (its file prefix, chunks and index hints), or checks it against
    the one there; returns the coordinator's writer and the metadata."""
    state = {"model": moe_state(layers, experts, device="meta")}
    writer = dcp.FileSystemWriter(out, thread_count=1)
    coordinator = RowChunkPlanner(ranks, 0)
    local_plans = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rank in range(ranks):
            planner = coordinator if rank == 0 else RowChunkPlanner(ranks, rank)
            rank_writer = writer if rank == 0 else dcp.FileSystemWriter(out, thread_count=1)
            planner.set_up_planner(state, storage_meta=rank_writer.storage_meta(),
                                   is_coordinator=rank == 0)
            rank_writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            local_plans.append(rank_writer.prepare_local_plan(planner.create_local_plan()))
    del planner, rank_writer
    _log(f"local plans of {ranks} ranks: {sum(len(p.items) for p in local_plans)} items")
    central_plans, metadata = coordinator.create_global_plan(local_plans)
    del local_plans, coordinator
    central_plans = writer.prepare_global_plan(central_plans)
    _log("global plan and metadata")
    for rank in range(ranks):
        plan = central_plans[rank]
        central_plans[rank] = None  # type: ignore[call-overload]
        part = (plan.storage_data, [(i.index.fqn, tuple(i.index.offset)) for i in plan.items],
                [i.index.index for i in plan.items])
        path = tmp / f"plan-{rank}.pkl"
        if path.exists():
            with open(path, "rb") as f:
                if pickle.load(f) != part:
                    raise AssertionError(f"rank {rank}: the plan differs from the earlier run's")
        else:
            with open(path, "wb") as f:
                pickle.dump(part, f, protocol=pickle.HIGHEST_PROTOCOL)
    _log("central plans handed to the ranks")
    return writer, metadata


def _plan_only(out: Path, tmp: Path, layers: int, experts: int, ranks: int) -> None:
    _global_plan(out, tmp, layers, experts, ranks)


def write(out: Path, *, layers: int, experts: int, ranks: int, files: int | None = None,
          workers: int = 1) -> dict[str, int]:
    """Write the checkpoint into ``out`` (one ``.distcp`` file per rank); returns its counts.
    ``files`` is accepted for older callers and must equal ``ranks`` if given. Rank files
    written by a stopped run with the same arguments (``OUT.build/results-*.pkl``) are kept.

    Three steps, each in processes of its own, so that no process holds more than it needs
    while the ranks write: the global plan (a process that leaves each rank's part in
    ``OUT.build``), the rank files (``workers`` processes), then the global plan once more
    in this process (the same torch calls; checked against the first) for ``finish``."""
    if files is not None and files != ranks:
        raise ValueError("one file per rank: files must equal ranks")
    out = Path(out)
    tmp = Path(f"{out}.build")
    args_file = tmp / "args.json"
    key = json.dumps({"layers": layers, "experts": experts, "ranks": ranks})
    if not (args_file.exists() and args_file.read_text() == key):
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        tmp.mkdir(parents=True)
        args_file.write_text(key)
    (out / ".metadata").unlink(missing_ok=True)
    shapes = moe_state(layers, experts, device="meta")
    counts = {"tensors": len(shapes),
              "chunks": sum(len(row_chunks(t.shape[0], ranks)) for t in shapes.values()),
              "payload": sum(t.numel() * t.element_size() for t in shapes.values())}
    del shapes
    ctx = multiprocessing.get_context("spawn")

    def run(groups: list[tuple[Any, tuple[Any, ...]]]) -> None:
        procs = [ctx.Process(target=target, args=a) for target, a in groups]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            raise SystemExit("a build process failed; run again to go on from there")

    if not all((tmp / f"plan-{r}.pkl").exists() for r in range(ranks)):
        run([(_plan_only, (out, tmp, layers, experts, ranks))])
    # Each rank writes its file (write_data), in --workers processes.
    todo = [r for r in range(ranks) if not (tmp / f"results-{r}.pkl").exists()]
    if len(todo) < ranks:
        _log(f"{ranks - len(todo)} ranks already written by an earlier run")
    run([(_write_ranks, (out, tmp, layers, experts, ranks, todo[k::workers]))
         for k in range(min(workers, len(todo)))])
    writer, metadata = _global_plan(out, tmp, layers, experts, ranks)
    gc.collect()
    names = {name: name for name in metadata.state_dict_metadata}
    results = [_load_results(tmp, rank, names) for rank in range(ranks)]
    _log("write results of all ranks")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer.finish(metadata=metadata, results=results)
    _log(".metadata written")
    shutil.rmtree(tmp)
    return counts


def check(out: Path, *, layers: int, experts: int) -> str:
    """dcp.load of the checkpoint against the generator's tensors, bit for bit."""
    want = moe_state(layers, experts)
    got = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=dcp.FileSystemReader(out), no_dist=True)
    bad = [k for k, v in want.items()
           if not torch.equal(got["model"][k].view(torch.uint8), v.view(torch.uint8))]
    return f"dcp.load: {len(want)} tensors, {len(bad)} differ" + (f" (first {bad[0]})"
                                                                     if bad else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1,
                    help="processes writing the rank files (default 1)")
    ap.add_argument("--check", action="store_true",
                    help="then dcp.load it and compare with the generator's tensors")
    args = ap.parse_args()
    t0 = time.perf_counter()
    counts = write(args.out, layers=args.layers, experts=args.experts, ranks=args.ranks,
                   workers=args.workers)
    print(f"{args.out}: {counts['tensors']} tensors, {counts['chunks']} chunks, "
          f"{counts['payload'] / 1e6:.1f} MB payload, in {time.perf_counter() - t0:.1f} s",
          flush=True)
    # The counts beside the checkpoint, as benchmarks/scale.py caches them (OUT.json).
    Path(f"{args.out}.json").write_text(json.dumps(counts))
    if args.check:
        print(check(args.out, layers=args.layers, experts=args.experts), flush=True)


if __name__ == "__main__":
    main()
