"""Atomic outputs, shared by every operation that writes files (the positional I/O they use,
``copy_range`` and ``pwrite_all``, lives with the input side in :mod:`ckpttool.formats.store`).

Outputs are created under a hidden temporary name in the output directory, filled at known
offsets, and renamed to their real names only when everything is complete. Anything that stops
the run early (an error, Ctrl-C) removes the temporary files, and a killed process leaves only
names ending in ``.ckpttool-tmp``, which never look like a finished checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ckpttool.errors import OutputError
from ckpttool.formats.store import copy_range, output_error, pwrite_all

__all__ = ["TMP_SUFFIX", "AtomicOutputs", "check_space", "copy_range", "existing_outputs",
           "output_error", "pwrite_all", "remove_stale"]

TMP_SUFFIX = ".ckpttool-tmp"


def existing_outputs(out_dir: Path, taken: Callable[[str], bool]) -> list[str]:
    """Names already in ``out_dir`` that the output would take (``taken``), sorted; nothing
    is created. Whether they may be replaced (--overwrite) is the caller's to say.

    Raises:
        OutputError: ``out_dir`` is not a directory, or such a name is not a regular file (a
            directory or a link, which not even --overwrite replaces).
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: exists and is not a directory; choose another output path")
    if not out_dir.is_dir():
        return []
    existing = sorted(p.name for p in out_dir.iterdir() if taken(p.name))
    for name in existing:
        path = out_dir / name
        if path.is_symlink() or not path.is_file():
            raise OutputError(f"{path}: is not a regular file, and the output needs this name; "
                              "move it away first")
    return existing


def check_apart(out_dir: Path, *sources: Path) -> None:
    """OUT is neither a source nor inside one (a merge into its own checkpoint directory would
    write weights, config and tokenizer among the files it reads).

    Raises:
        OutputError: naming the source.
    """
    out = out_dir.resolve()
    for src in sources:
        if src.is_dir():
            s = src.resolve()
            inside = out.is_relative_to(s)
        else:  # a file checkpoint: its own directory is off limits, a subdirectory is fine
            s = src.resolve().parent
            inside = out == s
        if inside:
            where = "is" if out == s else "is inside"
            raise OutputError(f"{out_dir}: {where} the checkpoint directory {s}; choose an "
                              "output directory outside it")


def check_space(out_dir: Path, need: int) -> None:
    """Create ``out_dir`` and check it can take ``need`` bytes, before any is written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out_dir}: cannot create output directory: {e.strerror}") from None
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise OutputError(
            f"{out_dir}: not enough free space: the output takes about {need:,} bytes and "
            f"{free:,} are free; free some space or choose another output directory"
        )


def remove_stale(out_dir: Path, keep: set[str], belongs: Callable[[str], bool]) -> None:
    """With --overwrite: remove a previous output's files (regular files whose name
    ``belongs`` to this kind of output) that the new output does not have."""
    for p in out_dir.iterdir():
        if belongs(p.name) and p.name not in keep and p.is_file() and not p.is_symlink():
            p.unlink()


class AtomicOutputs:
    """Files written under temporary names and renamed into place together by :meth:`commit`.

    Use as a context manager: leaving it without ``commit()`` removes every temporary file.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._pending: list[tuple[Path, Path]] = []  # (temporary, final)
        self._fds: list[int] = []

    def __enter__(self) -> AtomicOutputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def create(self, name: str, size: int | None = None, *, tag: str | None = None) -> int:
        """Open a new temporary file for ``name``; returns a writable descriptor. ``tag``
        names it instead of the process id (a run id other processes write into too)."""
        final = self.out_dir / name
        tmp = self.out_dir / f".{name}.{tag or os.getpid()}{TMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # a killed run's leftover, or a planted link: never written through
            # 0o666 so the umask decides the permissions, as for any file a tool creates.
            fd = os.open(tmp, flags, 0o666)
        except OSError as e:
            raise OutputError(f"{tmp}: cannot create output file: {e.strerror}") from None
        self._pending.append((tmp, final))
        self._fds.append(fd)
        if size is not None:
            try:
                os.ftruncate(fd, size)
            except OSError as e:
                raise output_error(e) from None
        return fd

    def adopt(self, name: str, tmp: Path) -> None:
        """Take ``tmp``, a complete temporary file made elsewhere (by the processes of a
        shared merge), as ``name``'s: renamed by :meth:`commit`, removed by :meth:`abort`."""
        self._pending.append((tmp, self.out_dir / name))

    def write_bytes(self, name: str, data: bytes) -> None:
        fd = self.create(name)
        pwrite_all(fd, data, 0)

    def commit(self, last: tuple[str, ...] = (),
               before_last: Callable[[], None] | None = None) -> list[Path]:
        """Close and rename every file into place.

        Args:
            last: names renamed after the rest (an index file, so that its presence means the
                shards it names are complete).
            before_last: run between the two (removing a previous output's stale files, so
                that they never stand beside a complete new index).
        """
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        ordered = sorted(self._pending, key=lambda p: p[1].name in last)
        try:
            for i, (tmp, final) in enumerate(ordered):
                if before_last is not None and (final.name in last or i == len(ordered) - 1):
                    before_last()
                    before_last = None
                os.replace(tmp, final)
                self._pending.remove((tmp, final))
            if before_last is not None:
                before_last()
        except OSError as e:
            # What was not renamed is removed by abort(); say which name failed.
            raise OutputError(f"{e.filename or self.out_dir}: cannot put the output in place: "
                              f"{e.strerror}; check the output directory") from None
        return [final for _, final in ordered]

    def abort(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        for tmp, _ in self._pending:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self._pending.clear()
