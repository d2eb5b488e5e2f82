"""Merges that several processes share, on one host or many, writing to one shared directory.

The plan is made by every process from the metadata alone (the same inputs give the same plan)
and split by bytes (:func:`ckpttool.core.merge.partition.split`): each process writes a disjoint set
of byte ranges of the same output files, so a single ``model.safetensors`` is shared as evenly
as many shards. Under torchrun (:class:`Team`):

1. rank 0 does what reads tensor data before the plan (the tie check, copies that must agree)
   and sends the decision to the others; it picks a run id, which names the temporary files
   (``.model.safetensors.<run id>.ckpttool-tmp``), creates each at its full size and writes its
   header; every process says whether that worked;
2. every process opens the files and writes its ranges, with no messages at all while copying;
3. every process says whether it succeeded. If any failed (or is gone: its connection closes,
   which gloo reports at once; a hung one is caught by the group's timeout), every process
   exits non-zero and the temporary files are removed. Otherwise rank 0 reads every header
   back and checks it, writes the index and the side files, and renames everything into place,
   the index last; then it tells the others, which end with the same outcome.

Without a launcher (:class:`Slice`, :class:`Finish`: array jobs on a scheduler), each
``--slice I/N`` writes its share into the same temporary files and leaves a marker saying so;
``--finish`` checks that every slice's marker is there and commits as rank 0 does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool import errors, settings
from ckpttool.core.merge import partition
from ckpttool.core.merge.distributed import Group
from ckpttool.core.merge.engine import commit_outputs, execute_share
from ckpttool.core.merge.plan import MergePlan, OutputFile
from ckpttool.core.merge.sharing import Sharing
from ckpttool.core.runtime.report import Progress
from ckpttool.core.runtime.torch_threads import default_workers
from ckpttool.errors import InputError, OutputError, UsageError
from ckpttool.formats import safetensors
from ckpttool.formats.base import Reader
from ckpttool.storage.outputs import TMP_SUFFIX, AtomicOutputs, existing_outputs, pwrite_all

if TYPE_CHECKING:
    from ckpttool.core.merge.options import ShareOptions, WriteOptions

__all__ = ["FAIL_ENV", "Finish", "Sharing", "Slice", "Team", "check_headers", "parse_slice",
           "team_from_env"]

# Tests only: "R" makes rank (or slice) R fail after its first bytes are written, "R:kill"
# kills it there (SIGKILL), to prove that the others notice and nothing looks finished.
FAIL_ENV = "CKPTTOOL_TEST_FAIL_RANK"


def _preview(mode: str, merge_plan: MergePlan, shares: list[list[partition.Unit]],
             index: int, **more: Any) -> Sharing:
    mine = sorted({(u.file, u.tensor) for u in shares[index]})
    names = [merge_plan.files[f].tensors[t].name for f, t in mine]
    return _describe(mode, shares, tensors=names, **more)


def check_headers(plan: MergePlan, temps: dict[str, Path]) -> None:
    """Read every output file's header back and check it is the planned one, and the file its
    planned size: what another process wrote to a shared filesystem is what was meant.

    Raises:
        OutputError: naming the file.
    """
    for f in plan.files:
        path = temps[f.name]
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(f.layout.header))
            size = path.stat().st_size
            meta, slots = safetensors.read_layout(path)
        except (OSError, InputError) as e:
            raise OutputError(f"{path}: cannot read the output back ({e}); nothing was put in "
                              "place") from e
        if (head != f.layout.header or size != f.size or meta != {"format": "pt"}
                or slots != tuple(sorted(f.layout.slots, key=lambda s: s.begin))):
            raise OutputError(f"{path}: does not read back as written (header or size "
                              "differs); the output filesystem lost writes? nothing was put "
                              "in place")


def _open_shared(path: Path, size: int, *, create: bool = False) -> int:
    """A writable descriptor on a temporary file another process may share, checked to be a
    regular file (never written through a link) of ``size`` bytes; ``create`` makes it, at
    that size, where it is missing (idempotent: any process of a set may come first)."""
    flags = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        raise OutputError(f"{path}: cannot open the shared output file: {e.strerror}") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OutputError(f"{path}: is not a regular file; remove it and run again")
        if create and info.st_size != size:
            os.ftruncate(fd, size)
        elif info.st_size != size:
            raise OutputError(f"{path}: is {info.st_size} bytes where {size} were made; another "
                              "run is using this directory? run again")
    except OSError as e:
        os.close(fd)
        raise OutputError(f"{path}: cannot size the shared output file: {e.strerror}") from e
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_share(plan: MergePlan, share: list[partition.Unit], reader: Reader,
                 fds: dict[int, int], paths: dict[int, Path], *, workers: int,
                 progress: Progress | None, who: str, create: bool = False) -> None:
    """Open the files this share writes in (beyond ``fds``), write the share, close them."""
    mine: list[int] = []
    try:
        for i in sorted({u.file for u in share} - fds.keys()):
            fds[i] = _open_shared(paths[i], plan.files[i].size, create=create)
            mine.append(i)
        execute_share(plan, share, reader, fds, workers=workers, progress=_fault(progress, who))
    finally:
        for i in mine:
            with contextlib.suppress(OSError):
                os.close(fds.pop(i))


def _fault(progress: Progress | None, who: str) -> Progress | None:
    spec = settings.test_fail_rank()
    if not spec:
        return progress
    target, _, how = spec.partition(":")
    if target != who:
        return progress

    def hook(n: int) -> None:
        if progress is not None:
            progress(n)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OutputError(f"process {who}: failing on purpose ({FAIL_ENV}={spec})")

    return hook


def _local_workers(workers: int | None) -> int:
    """Threads per process: as asked, else this host's CPUs shared by its processes."""
    if workers:
        return workers
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, default_workers() // max(1, local))


def _describe(mode: str, shares: list[list[partition.Unit]], **more: Any) -> Sharing:
    return Sharing(mode, len(shares), partition.rank_bytes(shares),
                   round(partition.balance(shares), 4), **more)


# --------------------------------------------------------------------------------------------
# torchrun


def _status(error: BaseException | None) -> dict[str, Any] | None:
    return None if error is None else dict(errors.to_wire(error))


def _raise_from(status: dict[str, Any], rank: int, what: str) -> None:
    context = f"rank {rank} failed {what}: "
    raise errors.from_wire(status, context) or OutputError(f"{context}{status['error']}")


class Team:
    commits_slices = False
    """One process of a torchrun job (:class:`~ckpttool.core.merge.distributed.Group`)."""

    def __init__(self, group: Group) -> None:
        self.group = group

    @classmethod
    def join(cls, timeout: float | None = None) -> Team:
        return cls(Group.join(timeout))

    def close(self) -> None:
        self.group.close()

    def __enter__(self) -> Team:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def first(self) -> bool:
        return self.group.rank == 0

    def once(self, decide: Callable[[], Any]) -> Any:
        return self.on_first(decide, "before the copy")

    def on_first(self, run: Callable[[], Any], what: str) -> Any:
        """``run()`` (JSON-able) on rank 0, its result on every process; an error raised
        there is raised on every process (on the others as rank 0's, failing ``what``)."""
        result: dict[str, Any] | None = None
        failure: BaseException | None = None
        if self.first:
            try:
                result = {"value": run()}
            except Exception as e:  # noqa: BLE001 - sent to the others, then raised here
                failure = e
                result = _status(e)
        result = self.group.broadcast(result)
        if failure is not None:
            raise failure
        assert result is not None
        if "error" in result:
            _raise_from(result, 0, what)
        return result["value"]

    def _agree(self, failure: BaseException | None, what: str) -> None:
        """Every process's outcome of a step, exchanged: raise this one's own error, or the
        first other process's."""
        statuses = self.group.gather(_status(failure))
        if failure is not None:
            raise failure
        for rank, status in enumerate(statuses):
            if status is not None:
                _raise_from(status, rank, what)

    def preview(self, plan: MergePlan) -> Sharing | None:
        return _preview("torchrun", plan, partition.split(plan, self.group.size),
                        self.group.rank)

    def write(self, plan: MergePlan, reader: Reader, out: Path, extra: list[tuple[str, bytes]],
              stem: str, writing: WriteOptions, share: ShareOptions, *,
              progress: Progress | None, on_start: Callable[[int], None] | None) -> Sharing:
        rank = self.group.rank
        shares = partition.split(plan, self.group.size)
        mine = shares[rank]
        run_id = self.group.broadcast(f"r{secrets.token_hex(6)}" if self.first else None)
        paths = {i: out / f".{f.name}.{run_id}{TMP_SUFFIX}" for i, f in enumerate(plan.files)}
        if on_start is not None:
            on_start(sum(u.nbytes for u in mine))
        try:
            # The first process holds OUT's lock for the group; the others write into its files.
            with AtomicOutputs(out, lock=self.first) as outputs:
                fds: dict[int, int] = {}
                failure: BaseException | None = None
                if self.first:
                    try:
                        for i, f in enumerate(plan.files):
                            fds[i] = outputs.create(f.name, f.size, tag=run_id)
                            pwrite_all(fds[i], f.layout.header, 0)
                    except Exception as e:  # noqa: BLE001 - told to the others, then raised
                        failure = e
                self._agree(failure, "creating the output files")
                try:
                    _write_share(plan, mine, reader, fds, paths,
                                 workers=_local_workers(share.workers),
                                 progress=progress, who=str(rank))
                except Exception as e:  # noqa: BLE001 - told to the others, then raised
                    failure = e
                self._agree(failure, "copying its share")

                def commit() -> None:
                    check_headers(plan, {f.name: paths[i] for i, f in enumerate(plan.files)})
                    commit_outputs(outputs, plan, extra, overwrite=writing.overwrite, stem=stem)

                self.on_first(commit, "putting the output in place")
        except BaseException:
            # Rank 0 removes what it made (AtomicOutputs); the others too, in case rank 0 is
            # the one that is gone: the names are known to all.
            for path in paths.values():
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
        return _describe("torchrun", shares, rank=rank)


def team_from_env() -> Team | None:
    """A :class:`Team` when a launcher started this process as one of several (joined now: a
    collective), else None."""
    from ckpttool.core.merge.distributed import launched

    return Team.join() if launched() else None


# --------------------------------------------------------------------------------------------
# Without a launcher: --slice I/N, then --finish


def slices_done(found: Iterable[tuple[int, int]], where: object, key: str) -> int:
    """N, from the (I, N) of every finished slice's record a ``--finish`` found at ``where``
    (a shared directory or an object-store prefix), once every slice of one N is there.

    Raises:
        OutputError: none found, several N, or slices missing (the first named, to run).
    """
    found = set(found)
    if not found:
        raise OutputError(f"{where}: no finished slice of this merge (plan {key}); run "
                          "ckpttool merge SRC OUT --slice I/N for every I first, with the "
                          "same options")
    counts = {n for _, n in found}
    if len(counts) > 1:
        raise OutputError(f"{where}: slices of this merge were run with different N "
                          f"({', '.join(map(str, sorted(counts)))}); run them again with one")
    (count,) = counts
    missing = [i for i in range(count) if (i, count) not in found]
    if missing:
        shown = ", ".join(f"{i}/{count}" for i in missing[:8])
        raise OutputError(f"{where}: {len(missing)} of {count} slices are not done ({shown}"
                          f"{' ...' if len(missing) > 8 else ''}); run them with "
                          f"ckpttool merge SRC OUT --slice {missing[0]}/{count}, then "
                          "--finish again")
    return count


def parse_slice(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N), 0 <= I < N.

    Raises:
        UsageError: anything else.
    """
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None or not int(m[2]) or int(m[1]) >= int(m[2]):
        raise UsageError(f"--slice {text!r}: expected I/N with 0 <= I < N, e.g. --slice 0/8")
    return int(m[1]), int(m[2])


def plan_key(plan: MergePlan) -> str:
    """A digest of everything a plan writes where (file names, headers, sizes): slices of one
    merge agree on it, and a slice run with other options (another --dtype) does not."""
    h = hashlib.sha256()
    for f in plan.files:
        h.update(json.dumps([f.name, f.size]).encode())
        h.update(f.layout.header)
    h.update(plan.index or b"")
    return h.hexdigest()[:16]


def _slice_paths(plan: MergePlan, out: Path, key: str) -> dict[int, Path]:
    return {i: out / f".{f.name}.s{key}{TMP_SUFFIX}" for i, f in enumerate(plan.files)}


def _marker(out: Path, stem: str, key: str, index: int, count: int) -> Path:
    return out / f".{stem}.s{key}.{index}-of-{count}.done{TMP_SUFFIX}"


class _Alone:
    first = True
    commits_slices = False

    def once(self, decide: Callable[[], Any]) -> Any:
        return decide()

    def preview(self, plan: MergePlan) -> Sharing | None:
        return None


class Slice(_Alone):
    """``--slice I/N``: one of N processes started without a launcher; writes its share and a
    marker, commits nothing."""

    def __init__(self, index: int, count: int) -> None:
        self.index, self.count = index, count

    def preview(self, plan: MergePlan) -> Sharing | None:
        return _preview("slice", plan, partition.split(plan, self.count), self.index,
                        slice=self.index, plan=plan_key(plan))

    def write(self, plan: MergePlan, reader: Reader, out: Path, extra: list[tuple[str, bytes]],
              stem: str, writing: WriteOptions, share: ShareOptions, *,
              progress: Progress | None, on_start: Callable[[int], None] | None) -> Sharing:
        shares = partition.split(plan, self.count)
        mine = shares[self.index]
        key = plan_key(plan)
        paths = _slice_paths(plan, out, key)
        if on_start is not None:
            on_start(sum(u.nbytes for u in mine))
        fds: dict[int, int] = {}
        inodes: dict[str, int] = {}
        try:
            # Every slice makes every file (at its full size: idempotent) and writes the
            # headers (the same bytes), so that no slice depends on another having started.
            for i, f in enumerate(plan.files):
                fds[i] = _open_shared(paths[i], f.size, create=True)
                pwrite_all(fds[i], f.layout.header, 0)
                inodes[f.name] = os.fstat(fds[i]).st_ino
            _write_share(plan, mine, reader, fds, paths, workers=_local_workers(share.workers),
                         progress=progress, who=str(self.index))
            for fd in fds.values():
                os.fsync(fd)  # before the marker says so: another host will commit
        except OSError as e:
            raise OutputError(f"{out}: slice {self.index}/{self.count} failed: {e.strerror}; "
                              "run it again") from e
        finally:
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
        marker = _marker(out, stem, key, self.index, self.count)
        tmp = marker.with_name(marker.name + f".{os.getpid()}")
        tmp.write_text(json.dumps({"slice": self.index, "of": self.count, "plan": key,
                                   "inodes": inodes}))
        os.replace(tmp, marker)
        return _describe("slice", shares, slice=self.index, plan=key,
                         files=_share_files(plan, mine, paths) + [
                             OutputFile(marker.name, marker.stat().st_size, 0)])


def _share_files(plan: MergePlan, share: list[partition.Unit], paths: dict[int, Path]
                 ) -> list[OutputFile]:
    """What a slice wrote, file by file: the header of every file (each slice writes it,
    the same bytes) and the bytes and tensors of its share, under the temporary names."""
    nbytes = dict.fromkeys(range(len(plan.files)), 0)
    tensors: dict[int, set[int]] = {i: set() for i in range(len(plan.files))}
    for u in share:
        nbytes[u.file] += u.nbytes
        tensors[u.file].add(u.tensor)
    return [OutputFile(paths[i].name, len(f.layout.header) + nbytes[i], len(tensors[i]),
                       final=f.name, header=len(f.layout.header))
            for i, f in enumerate(plan.files)]


class Finish(_Alone):
    """``--finish``: after every ``--slice I/N`` of the same merge, check and commit. Run
    again after a finish that failed, was interrupted or killed, it commits the same output
    (the slices' files stay until they are in place)."""

    commits_slices = True

    def write(self, plan: MergePlan, reader: Reader, out: Path, extra: list[tuple[str, bytes]],
              stem: str, writing: WriteOptions, share: ShareOptions, *,
              progress: Progress | None, on_start: Callable[[int], None] | None) -> Sharing:
        key = plan_key(plan)
        paths = _slice_paths(plan, out, key)
        pattern = re.compile(rf"\.{re.escape(stem)}\.s{key}\.(\d+)-of-(\d+)\.done"
                             rf"{re.escape(TMP_SUFFIX)}")
        found = {(int(m[1]), int(m[2])): p for p in out.iterdir()
                 if (m := pattern.fullmatch(p.name))} if out.is_dir() else {}
        count = slices_done(found, out, key)
        placed = _placed(plan, out, paths, found, count)
        _check_existing(out, plan, placed, [n for n, _ in extra], overwrite=writing.overwrite,
                        stem=stem)
        shares = partition.split(plan, count)
        check_headers(plan, {f.name: paths[i] if i not in placed else out / f.name
                             for i, f in enumerate(plan.files)})
        with AtomicOutputs(out) as outputs:
            for i, f in enumerate(plan.files):
                if i not in placed:
                    outputs.adopt(f.name, paths[i])
            commit_outputs(outputs, plan, extra, overwrite=writing.overwrite, stem=stem)
            for marker in found.values():
                with contextlib.suppress(OSError):
                    marker.unlink()
            removed = _remove_abandoned(out, key)  # with OUT's lock held
        return _describe("slices", shares, plan=key,
                         committed=[f.name for i, f in enumerate(plan.files) if i not in placed],
                         placed_before=[plan.files[i].name for i in sorted(placed)],
                         removed_temporary=removed or None)


def _placed(plan: MergePlan, out: Path, paths: dict[int, Path],
            found: dict[tuple[int, int], Path], count: int) -> set[int]:
    """The files of the plan that a previous ``--finish`` renamed into place before it was
    killed (the same inode every slice wrote into, now under its final name); raises when a
    file is neither there nor in place.

    Raises:
        OutputError: a marker is unreadable, or a file is not the one the slices wrote.
    """
    placed: set[int] = set()
    for (i, _), marker in sorted(found.items()):
        try:
            done = json.loads(marker.read_text())
        except (OSError, ValueError) as err:
            raise OutputError(f"{marker}: unreadable slice marker; run slice {i}/{count} "
                              "again") from err
        for fi, f in enumerate(plan.files):
            want = done.get("inodes", {}).get(f.name)
            if _inode(paths[fi]) == want:
                continue
            if want is not None and _inode(out / f.name) == want:
                placed.add(fi)  # committed by a --finish that did not complete
                continue
            # The file was made again after this slice wrote into it.
            raise OutputError(f"{paths[fi]}: is not the file slice {i}/{count} wrote "
                              f"into; run every slice again")
    return placed


def _check_existing(out: Path, plan: MergePlan, placed: set[int], extra: list[str], *,
                    overwrite: bool, stem: str) -> None:
    """OUT holds no weights (nor the files written beside them) but those a finish of this
    plan put in place before it stopped, unless ``overwrite``.

    Raises:
        OutputError: as a merge alone says it.
    """
    ours = {plan.files[i].name for i in placed} | (set(extra) if placed else set())
    index = out / plan.index_name
    if placed and plan.index is not None and index.is_file() and not index.is_symlink() \
            and index.read_bytes() == plan.index:
        ours.add(plan.index_name)  # a finish stopped after its last rename
    existing = [n for n in existing_outputs(
        out, lambda name: safetensors.is_weight_file(name, stem) or name in extra) if n not in ours]
    if existing and not overwrite:
        raise OutputError(f"{out}: already holds {', '.join(existing[:3])}"
                          f"{' and more' if len(existing) > 3 else ''}; pass --overwrite to "
                          "replace them or choose an empty directory")


def _inode(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except OSError:
        return None


# Temporary files and markers of slices (any plan): ``.NAME.sKEY[.I-of-N.done].ckpttool-tmp``.
_SLICE_TEMP = re.compile(rf"\..+\.s([0-9a-f]{{16}})(\.\d+-of-\d+\.done)?"
                         rf"{re.escape(TMP_SUFFIX)}(\.\d+)?")
# Temporary files of a process that held OUT's lock (AtomicOutputs: ``.NAME.PID.ckpttool-tmp``).
_LOCKED_TEMP = re.compile(rf"\..+\.\d+{re.escape(TMP_SUFFIX)}")


def _remove_abandoned(out: Path, key: str) -> list[str]:
    """Remove, once this plan's output is in place and while OUT's lock is held, the slices'
    temporary files of other plans (a slice run with other options, or abandoned) and the
    temporary files of runs that held the lock before (a killed ``--finish``: provably
    abandoned, as the lock is ours); returns their names, for the report."""
    removed = []
    for p in sorted(out.iterdir()):
        m = _SLICE_TEMP.fullmatch(p.name)
        other = m is not None and m[1] != key
        if (other or (m is None and _LOCKED_TEMP.fullmatch(p.name))) and p.is_file() \
                and not p.is_symlink():
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p.name)
    return removed
