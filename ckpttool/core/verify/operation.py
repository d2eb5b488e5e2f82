"""``verify``: prove a checkpoint is whole, sane and (with ``against``) equal to another.

The orchestration of pure checks and one data pass, each a source of
:class:`~ckpttool.formats.base.Problem` with a severity and a location:

* structure (:mod:`~ckpttool.core.checkpoint.structure`, pure): chunks tile every tensor; every
  data file
  exists and holds every byte range; no stray data files; what the format found in its
  metadata (a safetensors index that disagrees with its shards);
* content (:mod:`~ckpttool.core.verify.scan`, one streaming pass, bounded memory): every stored
  piece
  decodes as the metadata promises and its CRC-32 matches; NaN / Inf counts; all-zero tensors;
* ties (:func:`~ckpttool.core.ties.check_ties`) and dtypes
  (:func:`~ckpttool.core.dtype_policy.check_dtypes`), pure;
* ``against`` (:mod:`~ckpttool.core.verify.against`): names, shapes, dtypes and bytes of another
  checkpoint, in the same pass;
* ``manifest`` (:mod:`~ckpttool.core.verify.manifest`): a SHA-256 per tensor, written or checked;
* ``receipt`` (:mod:`~ckpttool.core.verify.receipt`): an output of ``merge --all`` checked against
  the receipt it carries (files, sizes, every tensor's SHA-256), unless a manifest is given.

Only values (NaN counts, casts) need torch; the CRC pass does not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpttool.core import contract, dtype_policy, quantization, ties
from ckpttool.core.checkpoint import architecture, structure
from ckpttool.core.checkpoint.discover import (
    Checkpoint,
    Part,
    describe,
    discover,
    open_reader,
    select,
)
from ckpttool.core.checkpoint.parts import Content
from ckpttool.core.dtype_policy import DTypePolicy
from ckpttool.core.runtime import urls
from ckpttool.core.runtime.report import Progress, document, locked
from ckpttool.core.transforms.lora.plan import (
    merged_adapter_config,
    unchanged_from_base,
    verify_adapter,
)
from ckpttool.core.transforms.lora.report import AdapterSummary
from ckpttool.core.verify import receipt, scan
from ckpttool.core.verify.against import AgainstPlan, plan_against
from ckpttool.core.verify.manifest import ManifestUse, finish, prepare
from ckpttool.errors import InputError, UsageError
from ckpttool.formats.base import SEVERITIES, Location, Problem, error, warning
from ckpttool.storage.store import LOCAL, Stores

__all__ = ["Location", "Problem", "VerifyReport", "verify"]


@dataclass
class VerifyReport:
    """What ``verify`` found, for people (CLI) and programs (``to_json``)."""

    path: str
    checkpoint: str
    format: str
    kind: str
    storage: dict[str, Any] = field(default_factory=dict)  # CheckpointInfo.storage
    against: dict[str, str] | None = None
    manifest: ManifestUse | None = None
    lora: AdapterSummary | None = None  # the LoRA adapter found (rank, alpha, targets...)
    parts: list[Part] = field(default_factory=list)  # other checkpoints verified
    contents: list[Content] = field(default_factory=list)  # model, optimizer... all read
    checks: list[str] = field(default_factory=list)
    num_tensors: int = 0
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(1 for p in self.problems if p.severity == s) for s in SEVERITIES}

    @property
    def ok(self) -> bool:
        """True when nothing at error severity was found."""
        return self.counts["error"] == 0

    def to_json(self) -> dict[str, Any]:
        doc = document("verify", self)
        doc["counts"] = self.counts
        doc["ok"] = self.ok
        return doc


@urls.urls(sources=("path", "against", "base"))
def verify(
    path: str | os.PathLike[str],
    *,
    against: str | os.PathLike[str] | None = None,
    base: str | os.PathLike[str] | None = None,
    allow_cast: bool = False,
    dtype: str | None = None,
    expect_dtype: str | None = None,
    config: str | os.PathLike[str] | None = None,
    manifest: str | os.PathLike[str] | None = None,
    manifest_action: str | None = None,
    workers: int | None = None,
    follow_links: bool = False,
    adapter_config: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    stores: Stores = LOCAL,
    iteration: int | None = None,
    write_manifest: str | os.PathLike[str] | None = None,
    check_manifest: str | os.PathLike[str] | None = None,
    loader: str | None = None,
    names: str | None = None,
    lora_alpha: float | None = None,
) -> VerifyReport:
    """Check the checkpoint at ``path``; problems are reported, not raised.

    Args:
        path: any supported checkpoint (see :func:`~ckpttool.core.checkpoint.discover.discover`).
        against: another checkpoint (any format) that must hold the same tensors, bit for bit.
        base: the checkpoint ``path`` was made from (a merge's base model, the step
            before): a ``path`` identical to it, bit for bit, is a warning.
        allow_cast: with ``against``, compare after the cast ``merge --dtype`` would apply.
        dtype: that ``--dtype`` (default ``auto``: the config's); only with ``allow_cast``.
        expect_dtype: ``auto``, ``bf16``, ``fp16`` or ``fp32``: floating tensors of another
            dtype are errors.
        config: config.json (or its directory) instead of the one beside ``path``.
        iteration: of a Megatron-Core run directory, this iteration instead of the one
            ``latest_checkpointed_iteration.txt`` names.
        loader: ``"transformers"``: hold the model's tensors against the class config.json
            names, as a merge does before publishing (:mod:`ckpttool.core.contract`).
        names: with ``against``, the ``--names`` map the merge that made it was given (a
            Megatron-Core model's map applies unasked, as in merge; ``"none"``: none).
        lora_alpha: with ``against``, the ``--lora-alpha`` that merge was given (a LoRA fold
            is made again to compare; alpha is never guessed).
        manifest: a file to write SHA-256 digests to, or to check them against if it exists.
        manifest_action: ``"write"`` (the file must not exist) or ``"check"`` (it must);
            None: check when it exists, else write.
        write_manifest: as the command's ``--write-manifest FILE``: ``manifest=FILE`` with
            ``manifest_action="write"``.
        check_manifest: as ``--check-manifest FILE``: ``manifest=FILE``,
            ``manifest_action="check"``.
        workers: tensors read in parallel (default: the CPUs this process may use).
        follow_links: read data files that are links out of the checkpoint directory.
        adapter_config: PEFT's adapter_config.json for a LoRA checkpoint, where it is not
            beside it.
        progress: called with bytes read.
        on_start: called once with the bytes about to be read.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False when an error was found.

    Raises:
        InputError: ``path`` (or ``against``) cannot be read at all, or a bad option.
        UnsupportedError: a format or layout ckpttool does not read yet.
        OutputError: the manifest cannot be written.
    """
    started = time.perf_counter()
    manifest, manifest_action = _manifest_use(manifest, manifest_action, write_manifest,
                                              check_manifest)
    _check_options(dtype, allow_cast=allow_cast, against=against, names=names,
                   lora_alpha=lora_alpha)
    ckpt = discover(path, config=config, command="verify", stores=stores, iteration=iteration)
    other = (discover(against, command="verify", stores=stores) if against is not None
             else None)
    expect, cast_policy = _policies(ckpt, expect_dtype, dtype if allow_cast else None,
                                    allow_cast=allow_cast)
    manifest_path, expected = prepare(manifest, manifest_action)

    report = VerifyReport(path=str(ckpt.path), checkpoint=str(ckpt.root), format=ckpt.format,
                          kind=ckpt.kind, num_tensors=len(ckpt.tensors),
                          storage=dict(ckpt.info.storage) if ckpt.info else {})
    report.contents = ckpt.contents()
    # Ties, dtypes and --against concern what merge writes: the model (or the optimizer state
    # --against names); every part is still read and checked for damage.
    model = select(ckpt, ckpt.kind) if ckpt.has_part(ckpt.kind) else ckpt
    report.checks = ["structure", "content", "ties", "dtypes"]
    plan = None
    if other is not None:
        report.checks.append("against")
        report.against = {"path": str(other.path), "checkpoint": str(other.root),
                          "format": other.format}
        a, b = _comparable(ckpt, other)
        plan = plan_against(a, b, policy=cast_policy, names=names, lora_alpha=lora_alpha,
                            adapter_config=Path(adapter_config) if adapter_config else None)
    if manifest_path is not None:
        report.checks.append("manifest")
    held = _contract(ckpt, model, loader)
    if held is not None:
        report.checks.append("contract")
    kept = _receipt(ckpt, report) if manifest_path is None else None
    parts = _other_parts(ckpt)
    read = locked(progress)
    if on_start is not None:
        on_start(sum(t.nbytes for c in (ckpt, other, *(p for _, p in parts)) if c is not None
                     for t in c.tensors))
    pair = ties.find_pair(model.by_name()) if ckpt.kind == "model" else None
    # The tied pair is compared after the pass (below); --against decides a deduplicated tie
    # from its digests.
    want_digest = ({t.name for t in ckpt.tensors} if manifest_path or kept
                   else set(pair or ()) if other is not None else set())
    problems, damaged, damaged_b = _structures(ckpt, other)
    done = scan.data_pass(ckpt, other, plan, want_digest, workers, read, skip=damaged,
                          skip_b=damaged_b, follow_links=follow_links)
    problems += done.problems
    with open_reader(ckpt, follow_links=follow_links) as reader:  # integrity.json and such
        problems += reader.check_file_digests()
    digests = done.digests
    same = (ties.pair_identical(ckpt, model, pair, done.complete, digests,
                                follow_links=follow_links, block_bytes=scan.READ_BLOCK)
            if pair is not None else None)
    problems += ties.check_ties(model, same) + architecture.problems_of(model) + (held or [])
    report.lora, lora_problems = verify_adapter(
        ckpt, model, Path(adapter_config) if adapter_config is not None else None,
        follow_links=follow_links)
    problems += lora_problems
    if report.lora is not None:
        report.checks.append("lora")
    problems += dtype_policy.check_dtypes(model, expect)
    problems += _quantization(model, report)
    if plan is not None:
        problems += [*plan.problems, *done.tied]
        problems += _unchanged_from_base(ckpt, other, plan, done, problems, adapter_config)
    part_problems, part_bytes = _check_parts(ckpt, parts, workers, read,
                                             follow_links=follow_links)
    problems += part_problems
    report.parts = [p for p in ckpt.parts if p.path in dict(parts)]
    found, report.manifest = (
        finish(ckpt, manifest_path, expected, digests) if manifest_path is not None
        else receipt.verify(ckpt, kept, digests) if kept is not None else ([], None))
    problems += found
    if base is not None:
        report.checks.append("base")
        problems += _against_base(model, base, stores, workers, read, follow_links=follow_links)
    report.problems = problems
    report.bytes_read = done.bytes_read + part_bytes
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def _against_base(model: Checkpoint, base: str | os.PathLike[str], stores: Stores,
                  workers: int | None, read: Progress, *, follow_links: bool) -> list[Problem]:
    """``--base``: a model identical to its base is a warning (the check verl users ask for:
    why is my merged model the base?)."""
    from ckpttool.core.diff.operation import against_base

    return against_base(model, discover(base, command="verify", stores=stores),
                        workers=workers, follow_links=follow_links, progress=read)


def _contract(ckpt: Checkpoint, model: Checkpoint, loader: str | None
              ) -> list[Problem] | None:
    """``--loader``: the model's tensors against the class config.json names (None: not
    asked). Before any data is read: a missing loader or config stops here."""
    if loader is None:
        return None
    shapes = {t.name: t.shape for t in model.tensors if t.part == "model"}
    return contract.verify_problems(shapes, model.hf.config, where=str(ckpt.path),
                                    loader=loader)


def _receipt(ckpt: Checkpoint, report: VerifyReport) -> receipt.Receipt | None:
    """The receipt ``merge --all`` wrote into an output (checked instead of a manifest)."""
    kept = (receipt.read(ckpt.root, ckpt.stores) if ckpt.stores.is_dir(ckpt.root)
            else None)
    if kept is not None:
        report.checks.append("receipt")
    return kept


def _unchanged_from_base(ckpt: Checkpoint, other: Checkpoint | None, plan: AgainstPlan,
                         done: scan.Pass, problems: list[Problem],
                         adapter_config: str | os.PathLike[str] | None) -> list[Problem]:
    """``verify MERGED --against BASE`` of a model merged from a LoRA adapter (its
    adapter_config.json beside it or given) whose target weights all equal the base's."""
    if other is None:
        return []
    try:
        doc, source = merged_adapter_config(
            ckpt.root if ckpt.stores.is_dir(ckpt.root) else ckpt.root.parent,
            Path(adapter_config) if adapter_config is not None else None, stores=ckpt.stores)
    except InputError:
        return []  # the LoRA check above reports a bad --adapter-config
    if doc is None or source is None:
        return []
    flagged = {p.location.tensor for p in problems if p.location.tensor is not None}
    compared = {pair.a.name: pair.a.tensor.shape for pair in plan.pairs}
    unchanged = {n for n in compared if n in done.complete and n not in flagged}
    return unchanged_from_base(compared, unchanged, doc, source, str(ckpt.root),
                                    str(other.root))


def _structures(ckpt: Checkpoint, other: Checkpoint | None
                ) -> tuple[list[Problem], set[str], set[str]]:
    """Structure problems of both sides, and the tensors of each found damaged (the data pass
    skips them)."""
    damaged: set[str] = set()
    damaged_b: set[str] = set()
    problems = _structure(ckpt, damaged)
    # A side file (meta.pt) that does not read: damage, unless it only names classes that a
    # weights-only reader refuses (a custom object in the saved state).
    problems += [(warning if "refused to load" in note else error)(
        "side-file-unreadable", note) for note in ckpt.side_notes]
    if other is not None:
        problems += _structure(other, damaged_b)
    return problems, damaged, damaged_b


def _manifest_use(manifest: str | os.PathLike[str] | None, action: str | None,
                  write: str | os.PathLike[str] | None, check: str | os.PathLike[str] | None
                  ) -> tuple[str | os.PathLike[str] | None, str | None]:
    """``write_manifest=`` / ``check_manifest=`` (the command's names) as ``manifest=`` and
    ``manifest_action=``; one way of naming it at a time (else a UsageError)."""
    given = [n for n, v in (("manifest", manifest), ("write_manifest", write),
                            ("check_manifest", check)) if v is not None]
    if len(given) > 1:
        raise UsageError(f"pass one of {' and '.join(given)}")
    if write is not None:
        return write, "write"
    if check is not None:
        return check, "check"
    return manifest, action


def _quantization(model: Checkpoint, report: VerifyReport) -> list[Problem]:
    """quantization_config against the stored tensors (block size against scale shapes,
    dtypes, modules left unquantized), for a model that holds quantized weights."""
    if model.kind != "model":
        return []
    stored = {t.name: (t.dtype, tuple(t.shape)) for t in model.tensors}
    if quantization.scheme(model.hf.config, stored) is None:
        return []
    report.checks.append("quantization")
    return quantization.check(model.hf.config, stored, model.hf.config_path.name
                              if model.hf.config_path else "config.json")


def _check_options(dtype: str | None, *, allow_cast: bool,
                   against: str | os.PathLike[str] | None, names: str | None = None,
                   lora_alpha: float | None = None) -> None:
    if dtype is not None and not allow_cast:
        raise UsageError("--dtype applies to the cast that --allow-cast allows; pass "
                         "--allow-cast too, or leave --dtype out")
    if allow_cast and against is None:
        raise UsageError("--allow-cast needs --against OTHER")
    for given, option in ((names, "--names"), (lora_alpha, "--lora-alpha")):
        if given is not None and against is None:
            raise UsageError(f"{option} says how merge made OTHER; it needs --against OTHER")


def _policies(ckpt: Checkpoint, expect_dtype: str | None, cast_dtype: str | None, *,
              allow_cast: bool) -> tuple[DTypePolicy | None, DTypePolicy | None]:
    """The ``--expect-dtype`` policy and the cast ``--allow-cast`` compares after."""
    config_name = str(ckpt.hf.config_path) if ckpt.hf.config_path else "config.json"
    expect = None
    if expect_dtype is not None:
        if expect_dtype.lower() == "keep":
            raise UsageError("--expect-dtype keep checks nothing; use auto, bf16, fp16 or fp32")
        expect = dtype_policy.resolve(expect_dtype, ckpt.hf.config, config_name)
    cast = (dtype_policy.resolve(cast_dtype or "auto", ckpt.hf.config, config_name)
            if allow_cast else None)
    return expect, cast


def _check_parts(ckpt: Checkpoint, parts: list[tuple[str, Checkpoint]], workers: int | None,
                 read: Progress, *, follow_links: bool) -> tuple[list[Problem], int]:
    """The rest of a training checkpoint (optimizer, side files...) must be whole too: its
    problems, located in their part, and the bytes read."""
    problems: list[Problem] = []
    bytes_read = 0
    for name, part in parts:
        part_damaged: set[str] = set()
        part_problems = _structure(part, part_damaged)
        part_pass = scan.data_pass(part, None, None, set(), workers, read, skip=part_damaged,
                                   follow_links=follow_links)
        for p in part_problems + part_pass.problems:
            file = p.location.file
            if file is not None and name not in dict(ckpt.side):  # a side file: beside ckpt
                file = f"{name}/{file}"
            problems.append(replace(p, location=replace(p.location, file=file)))
        bytes_read += part_pass.bytes_read
    return problems, bytes_read


def _structure(ckpt: Checkpoint, damaged: set[str]) -> list[Problem]:
    assert ckpt.info is not None
    return structure.check(ckpt.info, ckpt.canonical(), damaged)


def _comparable(ckpt: Checkpoint, other: Checkpoint) -> tuple[Checkpoint, Checkpoint]:
    """What ``--against`` compares: two checkpoints of several parts (model and optimizer
    state in one DCP, say) whole; else the side with several narrowed to the part the other
    holds, in either order (a merge's output against its training checkpoint, or the
    checkpoint against the output: the optimizer state merge leaves out is not extra)."""
    several_a = len({t.part for t in ckpt.tensors}) > 1
    several_b = len({t.part for t in other.tensors}) > 1
    if several_a and not several_b and ckpt.has_part(other.kind):
        return select(ckpt, other.kind), other
    if several_b and not several_a and other.has_part(ckpt.kind):
        return ckpt, select(other, ckpt.kind)
    return ckpt, other


def _other_parts(ckpt: Checkpoint) -> list[tuple[str, Checkpoint]]:
    """The other checkpoints of a training directory (optimizer_0/ beside the model's
    pytorch_model_fsdp_0/) and the side files of a checkpoint (Lightning's meta.pt), each
    verified for structure and content too."""
    return ([(name, describe(ckpt.path / name, info, stores=ckpt.stores))
             for name, info in ckpt.others]
            + [(name, describe(ckpt.root / name, info, stores=ckpt.stores))
               for name, info in ckpt.side])
