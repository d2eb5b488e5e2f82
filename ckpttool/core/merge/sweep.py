"""``merge RUN OUT_ROOT --all``: every checkpoint of a training run, each into its own output.

Steps, each a function of its own:

1. :func:`find`: the checkpoints under RUN, in step order: each entry with a step number in
   its name (or such an entry of a directory of them, such as accelerate's ``checkpoints/``)
   that a format claims, or that holds one that a format claims
   (``checkpoint-500/pytorch_model_fsdp_0``), recognised by the same registry as every
   command. Each says whether it is still being written: what its
   format says (:func:`ckpttool.formats.base.Format.pending`: DCP's ``.metadata`` not there yet,
   DeepSpeed's ``latest`` naming an earlier tag...), or files changed less than ``settle``
   seconds ago. Names and ``stat`` only.
2. :func:`select` (``--steps``) and :func:`assign` (``--task I/N``), pure.
3. :func:`decide`: per checkpoint, merge it, skip it (its receipt matches:
   :mod:`ckpttool.core.verify.receipt`), leave it (its source or options changed, without
   ``overwrite``), or wait for it.
4. :func:`sweep`: do it, reporting each checkpoint's :class:`Outcome` as it is known; one
   failure does not stop the others. ``watch`` goes on, polling, until interrupted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool import settings
from ckpttool.core.checkpoint.discover import discover
from ckpttool.core.merge import guards
from ckpttool.core.merge.options import MergeOptions
from ckpttool.core.runtime.report import SCHEMA, Section, jsonable, section
from ckpttool.core.verify import receipt
from ckpttool.errors import CkptError, InputError, InternalError, UnsupportedError, UsageError
from ckpttool.formats import registry
from ckpttool.storage import places
from ckpttool.storage.outputs import TMP_SUFFIX

if TYPE_CHECKING:
    from ckpttool.core.merge.report import MergeReport

# What each outcome's ``status`` may be.
MERGED = "merged"  # merged now (receipt written)
DONE = "done"  # skipped: its receipt matches the source and options
CHANGED = "changed"  # skipped: merged before from another source or options (--overwrite)
WAITING = "waiting"  # still being written; left alone
FAILED = "failed"
PLANNED = "would merge"  # a dry run's


# --------------------------------------------------------------------------------------------
# 1. Finding the checkpoints of a run


@dataclass(frozen=True)
class Found:
    """A checkpoint of a run, from names and ``stat`` only."""

    name: str  # relative to RUN, "/"-separated: the output's name under OUT_ROOT
    path: Path
    step: int | None  # the last number in its name; None: none
    num_bytes: int  # of every file under it
    pending: str | None  # why it is still being written; None: complete
    files: tuple[receipt.SourceFile, ...] = ()
    # Seconds until its files will have been unchanged for --settle, where that is all that
    # keeps it pending (its format says it is complete); 0 otherwise.
    settling: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "step": self.step,
                "bytes": self.num_bytes, "pending": self.pending}


_NUMBER = re.compile(r"\d+")


def step_of(name: str) -> int | None:
    """The step a checkpoint's name says: its last number (``checkpoint-500``,
    ``global_step10``, ``iter_0001000``, ``epoch=2-step=300.ckpt``)."""
    found = _NUMBER.findall(name)
    return int(found[-1]) if found else None


def find(run: Path, *, settle: float = 0.0, skip: Sequence[Path] = (),
         now: float | None = None) -> list[Found]:
    """The checkpoints under the training run directory ``run``, in step order.

    Args:
        settle: a checkpoint with a file modified less than this many seconds ago is pending.
        skip: directories not to look in (the output root, where it lies inside ``run``).
        now: the time to compare with (tests); default: now.

    Raises:
        InputError: ``run`` is not a directory.
    """
    if not run.is_dir():
        raise InputError(f"{run}: not a directory; pass the training run directory that holds "
                         "the checkpoints (checkpoint-500/, global_step10/...)")
    now = time.time() if now is None else now
    skipped = {p.resolve() for p in skip}
    found = [_describe(run, p, settle, now) for p in _candidates(run, skipped, depth=2)]
    return sorted(found, key=lambda f: (f.step is None, f.step or 0, f.name))


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted((p for p in directory.iterdir()
                       if not p.name.startswith(".") and not p.name.endswith(TMP_SUFFIX)),
                      key=lambda p: p.name)
    except OSError:
        return []


def _claimed(path: Path) -> bool:
    return not path.is_symlink() and registry.detect(path) is not None


def _candidates(directory: Path, skipped: set[Path], depth: int) -> list[Path]:
    """Entries of ``directory`` that are checkpoints: a step number in the name, and a format
    claims them or an entry of theirs. Directories without a step are looked into, ``depth``
    levels down (accelerate's ``checkpoints/``). Files of a directory a format claims are its
    own (HF Trainer's final ``model-00001-of-00002.safetensors`` at the top of a run), and
    entries without a step are not checkpoints of the run (``training_args.bin``)."""
    out = []
    own_files = registry.detect(directory) is not None
    for p in _entries(directory):
        if p.resolve() in skipped or p.is_symlink():
            continue
        stepped = step_of(p.name) is not None
        if p.is_file():
            if stepped and not own_files and _claimed(p):
                out.append(p)
        elif p.is_dir():
            if stepped and (_claimed(p) or any(_claimed(q) for q in _entries(p))):
                out.append(p)  # a checkpoint, or a training checkpoint directory
            elif not stepped and depth > 1:
                out += _candidates(p, skipped, depth - 1)
    return out


def _describe(run: Path, path: Path, settle: float, now: float) -> Found:
    files = receipt.source_files(path)
    newest = max((f.mtime_ns for f in files), default=0) / 1e9
    pending = _pending(path)
    settling = 0.0
    if pending is None and settle > 0 and now - newest < settle:
        settling = settle - max(0.0, now - newest)
        pending = (f"a file changed {max(0.0, now - newest):.1f} s ago; waiting {settle:g} s "
                   "for writes to settle (--settle)")
    name = path.relative_to(run).as_posix()
    return Found(name, path, step_of(path.name), sum(f.size for f in files), pending, files,
                 settling)


# merge --all (not --watch) waits for a complete checkpoint to settle at most this many times
# --settle, then leaves it waiting (a writer that never stops touching it).
SETTLE_ROUNDS = 10


def settled(run: Path, found: Found, settle: float) -> Found:
    """``found`` once its files have stayed unchanged for ``settle`` seconds: a checkpoint
    whose format says it is complete but whose files changed moments ago is waited for, not
    left behind (a CI step run as training ends must get the final model). Gives up after
    :data:`SETTLE_ROUNDS` times ``settle`` (the checkpoint is then still waiting)."""
    deadline = time.monotonic() + SETTLE_ROUNDS * settle
    while found.settling > 0 and time.monotonic() < deadline:
        time.sleep(min(found.settling, max(0.0, deadline - time.monotonic())) + 0.01)
        found = _describe(run, found.path, settle, time.time())
    return found


def _pending(path: Path) -> str | None:
    """What the formats say about ``path`` (a checkpoint, or a training directory holding
    some) still being written."""
    fmt = registry.detect(path) if not path.is_symlink() else None
    if fmt is not None:
        return fmt.pending(path)
    for p in _entries(path):
        sub = registry.detect(p) if not p.is_symlink() else None
        if sub is not None:
            why = sub.pending(p)
            if why is not None:
                return f"{p.name}: {why}"
    return None


# --------------------------------------------------------------------------------------------
# 2. Selecting (--steps) and sharing (--task I/N)


@dataclass(frozen=True)
class Steps:
    """``--steps``: which checkpoints, by step. ``ranges`` empty: every step."""

    ranges: tuple[tuple[int, int], ...] = ()  # inclusive
    every: int | None = None  # steps divisible by it
    latest: bool = False  # only the last complete one of those


def parse_steps(text: str) -> Steps:
    """``"1000-5000"``, ``"500,1500"``, ``"every 1000"``, ``"latest"``, combined with commas
    (``"1000-5000,every 1000"``: the steps of the range divisible by 1000).

    Raises:
        UsageError: anything else, with the forms it takes (exit 2).
    """
    ranges: list[tuple[int, int]] = []
    every = None
    latest = False
    for item in (s.strip().lower() for s in text.split(",")):
        if m := re.fullmatch(r"(\d+)\s*-\s*(\d+)", item):
            lo, hi = int(m[1]), int(m[2])
            if lo > hi:
                raise UsageError(f"--steps {text!r}: range {item} runs backwards; write "
                                 f"{hi}-{lo}")
            ranges.append((lo, hi))
        elif item.isdigit():
            ranges.append((int(item), int(item)))
        elif m := re.fullmatch(r"every\s*(\d+)", item):
            every = int(m[1])
            if not every:
                raise UsageError(f"--steps {text!r}: every 0 selects nothing; use every N, N > 0")
        elif item == "latest":
            latest = True
        else:
            raise UsageError(f"--steps {text!r}: {item!r} is not a step selection; use N, A-B, "
                             "every N or latest, joined by commas (e.g. 1000-5000,every 1000)")
    return Steps(tuple(ranges), every, latest)


def select(found: list[Found], steps: Steps) -> list[Found]:
    """The checkpoints ``steps`` asks for (a checkpoint without a step number only when all
    are asked for). ``latest``: the last complete one. Pure."""
    def wanted(f: Found) -> bool:
        if f.step is None:
            return not steps.ranges and steps.every is None
        in_range = not steps.ranges or any(lo <= f.step <= hi for lo, hi in steps.ranges)
        return in_range and (steps.every is None or f.step % steps.every == 0)

    chosen = [f for f in found if wanted(f)]
    if steps.latest:
        complete = [f for f in chosen if f.pending is None]
        chosen = complete[-1:]
    return chosen


def parse_task(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N), 0 <= I < N.

    Raises:
        UsageError: anything else (exit 2).
    """
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None or not int(m[2]) or int(m[1]) >= int(m[2]):
        raise UsageError(f"--task {text!r}: expected I/N with 0 <= I < N, e.g. --task "
                         "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT")
    return int(m[1]), int(m[2])


def assign(found: list[Found], count: int) -> list[int]:
    """The task (of ``count``) each checkpoint goes to: largest first, each to the task with
    the fewest bytes so far (lowest number on a tie), so that every task computes the same
    answer from the same run. The largest task holds at most the mean plus one checkpoint.
    Pure."""
    loads = [0] * count
    task = [0] * len(found)
    for i in sorted(range(len(found)), key=lambda i: (-found[i].num_bytes, found[i].name)):
        t = min(range(count), key=lambda k: (loads[k], k))
        task[i] = t
        loads[t] += found[i].num_bytes
    return task


# --------------------------------------------------------------------------------------------
# 3. Deciding, 4. doing


@dataclass
class Outcome:
    """What became of one checkpoint (one JSON line of ``merge --all --json``)."""

    found: Found
    out: Path
    status: str  # MERGED, DONE, CHANGED, WAITING, FAILED or PLANNED
    reason: str | None = None  # why skipped, waiting or failed
    task: int | None = None  # --task: the task it belongs to
    exit_code: int = 0  # FAILED: the exit status a single merge of it would have had
    seconds: float = 0.0
    merge: MergeReport | None = None  # MERGED: the merge's report
    then: Then | None = None  # --then: the command run and its exit status

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "command": "merge --all", "checkpoint": self.found.name,
                "path": str(self.found.path), "step": self.found.step,
                "bytes": self.found.num_bytes, "out": str(self.out), "status": self.status,
                "reason": self.reason, "task": self.task, "exit_code": self.exit_code,
                "seconds": self.seconds, "merge": jsonable(self.merge), "then": jsonable(self.then)}


@dataclass
class SweepReport:
    """Every outcome, in the order they were known."""

    run: str
    out_root: str
    outcomes: list[Outcome] = field(default_factory=list)
    task: tuple[int, int] | None = None

    def counts(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for o in self.outcomes:
            found[o.status] = found.get(o.status, 0) + 1
        return found

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == FAILED]

    @property
    def exit_code(self) -> int:
        """0 when nothing failed, else the most serious failure's status: 70 (a bug) before
        3 (bad input or output) before 4 (unsupported)."""
        codes = {o.exit_code for o in self.failed}
        for code in (InternalError.exit_code, InputError.exit_code, UnsupportedError.exit_code):
            if code in codes:
                return code
        return max(codes, default=0)


def decide(found: Found, out: Path, options: dict[str, Any], *, overwrite: bool
           ) -> tuple[str, str | None]:
    """``(status, reason)`` for ``found`` before anything is written: PLANNED (to merge),
    DONE, CHANGED or WAITING. No data read.

    Raises:
        InputError: ``out`` holds a receipt that cannot be read.
    """
    if found.pending is not None:
        return WAITING, found.pending
    kept = receipt.read(out)
    if kept is None:
        if not _holds_output(out):
            return PLANNED, None
        # A merge made by hand, or a sweep cut between the output and its receipt.
        bare = f"{out} holds an output without a {receipt.RECEIPT_NAME}"
        return (PLANNED, f"merging again: {bare}") if overwrite else (
            CHANGED, f"{bare}; pass --overwrite to merge it again")
    why = receipt.compare(kept, found.path.resolve(), found.files, options, out)
    if why is None:
        return DONE, f"merged already ({receipt.RECEIPT_NAME} matches)"
    if overwrite:
        return PLANNED, f"merging again: {why}"
    return CHANGED, f"{why}; pass --overwrite to merge it again"


def _holds_output(out: Path) -> bool:
    """``out`` holds safetensors weights or an index (names only)."""
    try:
        return any(p.name.endswith((".safetensors", ".index.json")) for p in out.iterdir()
                   if not p.name.startswith("."))
    except OSError:
        return False


MergeFunction = Callable[..., Any]  # ckpttool.core.merge.operation.merge


def sweep(
    run: str | os.PathLike[str],
    out_root: str | os.PathLike[str],
    options: MergeOptions | None = None,
    *,
    steps: Steps | None = None,
    task: tuple[int, int] | None = None,
    settle: float = 5.0,
    watch: bool = False,
    poll: float = 30.0,
    then: str | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> SweepReport:
    """Merge every complete checkpoint of the training run at ``run`` into
    ``out_root/<its name>/``, in step order, skipping those done already.

    Args:
        options: what every merge gets (None: merge's defaults). Those that change the
            output are recorded in each receipt (:meth:`MergeOptions.recorded`); a receipt
            made with others is not done. ``options.write.overwrite``: merge again an output
            whose source or options changed; ``options.write.dry_run``: decide, and write
            nothing.
        steps: which checkpoints (:func:`parse_steps`); None: all.
        task: ``(I, N)``: only task I's share of N (:func:`assign`).
        settle: seconds a checkpoint's files must have stayed unchanged.
        watch: go on, looking again every ``poll`` seconds, until interrupted (or ``stop``).
        then: a shell command run after each merge, with ``CKPTTOOL_OUT``, ``CKPTTOOL_SRC``,
            ``CKPTTOOL_STEP`` and ``CKPTTOOL_NAME`` in its environment (:func:`run_then`);
            its exit status is reported, non-zero fails it.
        on_outcome: called with each outcome as soon as it is known.
        stop: watch: asked before each round; True ends the sweep.

    Returns:
        A :class:`SweepReport`; ``exit_code`` says whether any checkpoint failed.

    Raises:
        InputError: ``run`` is not a directory, or a bad option.
        UsageError: ``-`` as ``run`` or ``out_root``; ``{out}``-style placeholders in
            ``then`` (:func:`check_then`).
        UnsupportedError: a URL as ``run`` or ``out_root`` (object storage: not yet), or
            of a scheme ckpttool does not serve.
    """
    from ckpttool.core.merge.operation import merge

    run_path, root = local_dirs(run, out_root)
    if then is not None:
        check_then(then)
    options = options or MergeOptions()
    recorded = options.recorded()
    overwrite, dry_run = options.write.overwrite, options.write.dry_run
    report = SweepReport(str(run_path), str(root), task=task)
    seen: dict[str, tuple[str, tuple[receipt.SourceFile, ...]]] = {}

    def tell(o: Outcome) -> None:
        report.outcomes.append(o)
        if on_outcome is not None:
            on_outcome(o)

    while True:
        found = find(run_path, settle=settle, skip=(root,))
        chosen = select(found, steps or Steps())
        owners = assign(chosen, task[1]) if task is not None else [None] * len(chosen)
        for f, owner in zip(chosen, owners, strict=True):
            if task is not None and owner != task[0]:
                continue
            if f.settling > 0 and not watch and not dry_run:
                f = settled(run_path, f, settle)
            out = root / f.name
            try:
                status, reason = decide(f, out, recorded, overwrite=overwrite)
            except CkptError as e:
                status, reason = FAILED, str(e)
            # Watching, each checkpoint is told once per state (and again when its files
            # change after a failure).
            key = (status, f.files if status == FAILED else ())
            if watch and seen.get(f.name) == key:
                continue
            if status == FAILED:
                seen[f.name] = key
                tell(Outcome(f, out, FAILED, reason, owner, InputError.exit_code))
                continue
            if status != PLANNED or dry_run:
                seen[f.name] = key
                tell(Outcome(f, out, status, reason, owner))
                continue
            outcome = _merge_one(merge, f, out, options, recorded, reason, owner, then=then)
            seen[f.name] = (outcome.status if outcome.status != MERGED else DONE,
                            f.files if outcome.status == FAILED else ())
            tell(outcome)
        if not watch or (stop is not None and stop()):
            return report
        time.sleep(poll)
        if stop is not None and stop():
            return report


def local_dirs(run: str | os.PathLike[str], out_root: str | os.PathLike[str]
               ) -> tuple[Path, Path]:
    """RUN and OUT_ROOT as local paths, classified as every command's paths are
    (:func:`ckpttool.storage.places.classify`). A sweep keeps its receipts and reads its
    checkpoints' ``stat`` on a file system, so object storage is refused (never turned into
    a local ``gs:/`` directory).

    Raises:
        UsageError: ``-``.
        UnsupportedError: a URL (exit 4), naming what to do instead.
    """
    run_place = places.classify(run, what="RUN")
    root_place = places.classify(out_root, what="OUT_ROOT")
    if run_place.remote:
        raise UnsupportedError(
            f"{run_place}: merge --all reads a training run on a local or shared file system, "
            f"not yet {run_place.scheme}://; merge each checkpoint with ckpttool merge "
            f"{run_place}/CHECKPOINT OUT, or copy the run to a local directory")
    if root_place.remote:
        raise UnsupportedError(
            f"{root_place}: merge --all writes its outputs and receipts to a local or shared "
            f"file system, not yet {root_place.scheme}://; merge each checkpoint with "
            f"ckpttool merge CHECKPOINT {root_place}/CHECKPOINT, or sweep into a local "
            "directory and upload it")
    return run_place.path, root_place.path


def _merge_one(merge: MergeFunction, f: Found, out: Path, options: MergeOptions,
               recorded: dict[str, Any], reason: str | None, owner: int | None, *,
               then: str | None) -> Outcome:
    """Merge one checkpoint, then write its receipt and run ``then``: every error becomes
    the outcome (KeyboardInterrupt goes on up)."""
    started = time.perf_counter()
    outcome = Outcome(f, out, MERGED, reason, owner)
    try:
        before = identity(f.path)
        if tuple(receipt.SourceFile(*i[:3]) for i in before) != f.files:
            raise guards.SourceChanged(f"{f.path}: changed since it was found (a save or copy "
                                       "still going on); merged again next time")

        def unchanged() -> None:  # just before the output is published
            if identity(f.path) != before:
                raise guards.SourceChanged(
                    f"{f.path}: changed while it was merged (a save or copy still going on); "
                    "nothing was published, it is merged again next time")

        if options.write.overwrite:
            receipt.remove(out)
        with guards.before_publish(unchanged):
            report = merge(f.path, out, options)
        outcome.merge = report
        # The source as merged: a file that changed while it was read fails the receipt.
        now = receipt.source_files(f.path)
        if now != f.files:
            raise InputError(f"{f.path}: changed while it was merged; it is merged again "
                             "next time (with --overwrite)")
        receipt.write(out, receipt.make(out, f.path.resolve(), f.files, recorded,
                                          workers=options.share.workers))
    except guards.SourceChanged as e:
        outcome.status, outcome.reason = WAITING, str(e)
    except CkptError as e:
        still = incomplete(f.path) if type(e) is InputError else None
        if still is not None:
            outcome.status, outcome.reason = WAITING, still
        else:
            outcome.status, outcome.reason, outcome.exit_code = FAILED, str(e), e.exit_code
    except OSError as e:  # the environment (permissions, a full disk), not our bug
        outcome.status, outcome.exit_code = FAILED, InputError.exit_code
        outcome.reason = f"{e.filename or f.path}: {e.strerror or e}"
    except Exception as e:  # noqa: BLE001 - one checkpoint's bug must not stop the others
        if settings.debug():
            raise
        outcome.status, outcome.exit_code = FAILED, InternalError.exit_code
        outcome.reason = (f"internal error (a bug in ckpttool): {e!r}; please report it, with "
                          "the traceback CKPTTOOL_DEBUG=1 shows")
    if outcome.status == MERGED and then is not None:
        outcome.then = run_then(then, f, out)
        if outcome.then.exit_code:
            outcome.status, outcome.exit_code = FAILED, InputError.exit_code
            outcome.reason = (f"merged, but --then exited {outcome.then.exit_code}: "
                              f"{outcome.then.command}")
    outcome.seconds = round(time.perf_counter() - started, 3)
    return outcome


def identity(path: Path) -> tuple[tuple[str, int, int, int, int], ...]:
    """Every file under ``path`` (or ``path`` itself) as ``(name, size, mtime_ns, inode,
    ctime_ns)``, sorted by name: a file rewritten, replaced or renamed over shows, whatever
    times a writer sets. Names and ``stat`` only."""
    paths = [(path.name, path)] if path.is_file() else [
        (Path(r, n).relative_to(path).as_posix(), Path(r, n))
        for r, _, names in os.walk(path) for n in names]
    found = []
    for name, p in paths:
        try:
            st = p.stat()
        except OSError:  # gone meanwhile (a writer's temporary file)
            continue
        found.append((name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns))
    return tuple(sorted(found))


# A checkpoint whose files are missing or short against its own metadata is being copied or
# saved while a file of it changed this recently; after that, it is damaged.
STALE_SECONDS = 3600.0
_INCOMPLETE = ("missing-file", "truncated-file")


def incomplete(path: Path, *, now: float | None = None) -> str | None:
    """Why the checkpoint at ``path`` is not all there yet (a file its metadata names is
    missing or short) while it is still changing (a file changed, by ``ctime``, which a copy
    that keeps modification times still moves, within :data:`STALE_SECONDS`); None when it
    is whole, or has been left so for longer (damaged: a failure)."""
    from ckpttool.core.checkpoint import structure

    files = identity(path)
    now = time.time() if now is None else now
    if not files or now - max(f[4] for f in files) / 1e9 > STALE_SECONDS:
        return None
    try:
        info = discover(path).info
    except CkptError:
        return None
    if info is None:
        return None
    found = [p for p in structure.check(info, {}) if p.code in _INCOMPLETE]
    if not found:
        return None
    return (f"{len(found)} file(s) its metadata names are missing or short, e.g. "
            f"{found[0].location.file or found[0].message}: still being copied or saved; "
            "merged once it is whole")


@section
class Then(Section):
    """``--then``: the command run (as given: values reach it as environment variables) and
    its exit status."""

    command: str
    exit_code: int


# --then: what each value is called in the command's environment.
THEN_VARIABLES = {"out": "CKPTTOOL_OUT", "src": "CKPTTOOL_SRC", "step": "CKPTTOOL_STEP",
                  "name": "CKPTTOOL_NAME"}
_PLACEHOLDER = re.compile(r"\{(" + "|".join(THEN_VARIABLES) + r")\}")


def check_then(template: str) -> None:
    """Refuse ``{out}``-style placeholders in a ``--then`` command: spliced into shell text,
    a checkpoint named ``checkpoint-7$(touch x)`` would run as code wherever the command puts
    the placeholder inside double quotes (quoting cannot be right in every shell context).
    The values come as environment variables instead.

    Raises:
        UsageError: (exit 2) naming the variable to use instead.
    """
    m = _PLACEHOLDER.search(template)
    if m is None:
        return
    var = THEN_VARIABLES[m.group(1)]
    raise UsageError(
        f"--then {template!r}: {m.group()} is not replaced (a checkpoint's name would be "
        f"spliced into shell code); the command gets the values as environment variables: "
        f'write "${var}" (and "$CKPTTOOL_SRC", "$CKPTTOOL_STEP", "$CKPTTOOL_NAME"), in '
        "double quotes")


def then_environment(f: Found, out: Path) -> dict[str, str]:
    """The variables ``--then`` gets for checkpoint ``f`` written to ``out``."""
    values = {"out": str(out), "src": str(f.path),
              "step": "" if f.step is None else str(f.step), "name": f.name}
    return {THEN_VARIABLES[k]: v for k, v in values.items()}


def run_then(template: str, f: Found, out: Path) -> Then:
    """Run ``template`` through the shell, exactly as given, with ``CKPTTOOL_OUT``,
    ``CKPTTOOL_SRC``, ``CKPTTOOL_STEP`` and ``CKPTTOOL_NAME`` in its environment (never
    spliced into its text); its output goes to stderr (stdout is the report)."""
    env = {**os.environ, **then_environment(f, out)}
    try:  # sys.stderr may be no file (a notebook's, a test runner's): then descriptor 2
        sys.stderr.fileno()
        stderr: Any = sys.stderr
    except (AttributeError, OSError, ValueError):
        stderr = 2
    try:
        code = subprocess.run(template, shell=True, stdout=stderr, env=env,
                              check=False).returncode
    except OSError:  # no shell to run it: as the shell says of a command it cannot find
        code = 127
    return Then(template, code)
