"""Is a checkpoint whole? Pure checks from its description: one implementation for merge (which
raises on the first error) and verify (which reports them all).

Every data file the metadata references exists and holds every byte range placed in it; no data
file is left over; every tensor's chunks tile it exactly; plus what the format itself found in
its metadata (``CheckpointInfo.problems``: a safetensors index that disagrees with its shards).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckpttool.core import chunks as chunk_geometry
from ckpttool.errors import InputError
from ckpttool.formats.base import CheckpointInfo, Chunk, Problem, error, warning
from ckpttool.formats.store import missing_message


def check(info: CheckpointInfo, canonical: Mapping[str, str],
          damaged: set[str] | None = None) -> list[Problem]:
    """Every structure problem of ``info``; ``canonical`` maps stored to canonical names.

    Args:
        damaged: filled with the stored names of tensors whose bytes these problems make
            unreadable (missing or short files, bad tiling): the content pass skips them
            instead of reporting the same damage again.
    """
    problems = list(info.problems)
    sizes = {f.name: f.size for f in info.files}
    bad_files: set[str] = set()  # missing, or shorter than what the metadata places in them
    for file, ends in sorted(info.extents().items()):
        size = sizes.get(file)
        path = info.base / file
        if size is None:
            bad_files.add(file)
            problems.append(error("missing-file", missing_message(
                path, info.metadata_name, f"{len(ends)} entries, e.g. {ends[0][1]}"), file=file))
            continue
        beyond = [e for e in ends if e[0] > size]
        if beyond:
            bad_files.add(file)
            end, what = max(beyond)
            problems.append(error(
                "truncated-file", f"{path}: truncated: {info.metadata_name} places {what} up to "
                f"byte {end} but the file has {size} bytes; copy the checkpoint again",
                file=file, offset=size))
    for name in info.stray:
        problems.append(warning(
            "stray-file", f"{info.base / name}: not referenced by the checkpoint's metadata; "
            "left over from another save, or the metadata belongs to a different save",
            file=name))
    for t in info.tensors:
        reason = _coverage(t.shape, t.chunks)
        if reason is not None:
            name = canonical.get(t.name, t.name)
            problems.append(error(_coverage_code(reason),
                                  f"{info.root}: tensor '{name}': {reason}; the checkpoint is "
                                  "incomplete or corrupt", tensor=name))
        if damaged is not None and (reason is not None or (bad_files and any(
                c.file in bad_files and c.end > (sizes.get(c.file) or 0) for c in t.chunks))):
            damaged.add(t.name)
    return problems


def raise_first(problems: list[Problem]) -> None:
    """Raise the first error-severity problem as an :class:`InputError` (merge, reshard)."""
    for p in problems:
        if p.severity == "error":
            raise InputError(p.message)


def _coverage(shape: tuple[int, ...], chunks: Sequence[Chunk]) -> str | None:
    return chunk_geometry.coverage_problem(shape, [(c.offsets, c.sizes) for c in chunks])


def _coverage_code(reason: str) -> str:
    # coverage_problem explains in words; these are the three ways a tiling fails.
    if "overlap" in reason:
        return "chunk-overlap"
    if "missing" in reason:
        return "chunk-gap"
    return "chunk-bounds"
