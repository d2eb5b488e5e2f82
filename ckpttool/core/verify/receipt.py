"""The receipt a merge of a training run (``merge --all``) leaves in each output directory.

``ckpttool-receipt.json`` says what the output was made from and how: the source checkpoint's
path, every file of it with its size and modification time, the merge options that change the
output, the ckpttool version, the output files with their sizes, and a SHA-256 of every tensor
written (the same per-tensor digests as ``verify --write-manifest``, read back from the output
once it is in place). It is written after the output is complete (the index is in place), so
its presence means the output is whole; it is replaced atomically.

A later sweep compares a receipt with the source as it is now (:func:`compare`, by names,
sizes and modification times: no data read), to skip an output that is done and to notice one
whose source or options changed. ``verify OUT`` checks the output's bytes against it
(:func:`check`).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.core.checkpoint.discover import Checkpoint, discover
from ckpttool.core.runtime.report import SCHEMA
from ckpttool.core.verify import manifest
from ckpttool.errors import InputError
from ckpttool.formats.base import Problem, error
from ckpttool.storage import sidefiles
from ckpttool.storage.outputs import AtomicOutputs
from ckpttool.storage.store import LOCAL, Stores
from ckpttool.version import __version__

RECEIPT_NAME = "ckpttool-receipt.json"
RECEIPT_KIND = "ckpttool-receipt"
# What a receipt may weigh (about 200 bytes a tensor: a million tensors' digests fit).
RECEIPT_FILE = sidefiles.Kind("ckpttool receipt", 1 << 30)


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One file of a source checkpoint, as a receipt records it."""

    name: str  # relative to the source path (the path itself for a single file), "/"-separated
    size: int  # bytes
    mtime_ns: int  # modification time, nanoseconds since the epoch

    def to_json(self) -> list[Any]:
        return [self.name, self.size, self.mtime_ns]


def source_files(path: Path) -> tuple[SourceFile, ...]:
    """Every regular file under ``path`` (or ``path`` itself), sorted by name; links are
    recorded as what they point to. Names and ``stat`` only."""
    if path.is_file():
        st = path.stat()
        return (SourceFile(path.name, st.st_size, st.st_mtime_ns),)
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in files:
            p = Path(root, name)
            try:
                st = p.stat()
            except OSError:  # gone meanwhile (a writer's temporary file)
                continue
            found.append(SourceFile(p.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns))
    return tuple(sorted(found, key=lambda f: f.name))


@dataclass(frozen=True)
class Receipt:
    """What one output was made from, and what it holds."""

    source: str  # the checkpoint merged, as the sweep found it (absolute)
    files: tuple[SourceFile, ...]  # the source's files when it was merged
    options: dict[str, Any]  # merge options that change the output (JSON values)
    version: str  # ckpttool's
    outputs: dict[str, int]  # output file name -> bytes (weights, index, side files)
    tensors: dict[str, dict[str, Any]]  # canonical name -> {"dtype", "shape", "sha256"}

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "kind": RECEIPT_KIND, "ckpttool": self.version,
                "source": {"path": self.source, "files": [f.to_json() for f in self.files]},
                "options": self.options, "outputs": self.outputs, "algorithm": "sha256",
                "tensors": self.tensors}

    @classmethod
    def from_json(cls, doc: Any, where: Path) -> Receipt:
        """Raises:
            InputError: not a receipt ckpttool wrote.
        """
        try:
            if doc.get("kind") != RECEIPT_KIND:
                raise ValueError("not a receipt")
            src = doc["source"]
            files = tuple(SourceFile(str(n), int(s), int(m)) for n, s, m in src["files"])
            return cls(str(src["path"]), files, dict(doc["options"]), str(doc["ckpttool"]),
                       {str(k): int(v) for k, v in doc["outputs"].items()},
                       dict(doc["tensors"]))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: not a ckpttool receipt ({e}); remove it, and merge "
                             "again with --overwrite") from None


def read(out: Path, stores: Stores = LOCAL) -> Receipt | None:
    """The receipt in output directory ``out`` (read through ``stores``); None when there is
    none.

    Raises:
        InputError: a receipt that cannot be read.
    """
    path = out / RECEIPT_NAME
    if stores.file_size(path) is None:
        return None
    try:
        doc = json.loads(stores.read_small(path, RECEIPT_FILE).decode())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"{path}: cannot read the receipt ({e}); remove it, and merge again "
                         "with --overwrite") from None
    return Receipt.from_json(doc, path)


def compare(receipt: Receipt, source: Path, files: tuple[SourceFile, ...],
            options: dict[str, Any], out: Path) -> str | None:
    """Why ``receipt`` does not stand for merging ``source`` (now holding ``files``) with
    ``options`` into ``out``; None when it does (the output is done). No data is read."""
    if receipt.source != str(source):
        return f"made from {receipt.source}"
    if receipt.options != options:
        changed = sorted(k for k in receipt.options.keys() | options.keys()
                         if receipt.options.get(k) != options.get(k))
        return f"made with other options ({', '.join(changed)})"
    if receipt.files != files:
        was = {f.name: f for f in receipt.files}
        now = {f.name: f for f in files}
        diff = sorted(n for n in was.keys() | now.keys() if was.get(n) != now.get(n))
        return f"the source changed since ({diff[0]}{' and more' if len(diff) > 1 else ''})"
    for name, size in receipt.outputs.items():
        p = out / name
        if not p.is_file() or p.stat().st_size != size:
            return f"{name} is missing or changed"
    return None


def make(out: Path, source: Path, files: tuple[SourceFile, ...], options: dict[str, Any], *,
         workers: int | None = None) -> Receipt:
    """The receipt of the complete output in ``out``: reads every tensor back once for its
    SHA-256 (a check that what was written reads back whole).

    Raises:
        InputError: a tensor of the output does not read back whole.
    """
    from ckpttool.core.verify import scan

    ckpt = discover(out, command="verify")
    done = scan.data_pass(ckpt, None, None, {t.name for t in ckpt.tensors}, workers,
                          lambda n: None, skip=set())
    errors = [p for p in done.problems if p.severity == "error"]
    if errors:
        raise InputError(f"{out}: the merged output does not read back whole "
                         f"({errors[0].message}); merge it again with --overwrite")
    tensors = manifest.document(ckpt, done.digests)["tensors"]
    outputs = {p.name: p.stat().st_size for p in sorted(out.iterdir())
               if p.is_file() and not p.name.startswith(".") and p.name != RECEIPT_NAME}
    return Receipt(str(source), files, options, __version__, outputs, tensors)


def write(out: Path, receipt: Receipt) -> None:
    """Put ``receipt`` in ``out``, replacing any (atomically)."""
    with AtomicOutputs(out) as outputs:
        outputs.write_bytes(RECEIPT_NAME, (json.dumps(receipt.to_json(), indent=1) + "\n")
                            .encode())
        outputs.commit()


def remove(out: Path) -> None:
    """Remove ``out``'s receipt (before its output is made again: a receipt never stands
    beside an output it does not describe)."""
    with contextlib.suppress(FileNotFoundError):
        (out / RECEIPT_NAME).unlink()


def check(ckpt: Checkpoint, receipt: Receipt, digests: dict[str, str], unreadable: set[str],
          where: Path) -> list[Problem]:
    """``verify OUT``: the output's files and tensors against its receipt. Pure, given the
    digests of the output's tensors."""
    problems = manifest.check(ckpt, receipt.tensors, digests, unreadable, where)
    for name, size in receipt.outputs.items():
        p = ckpt.root / name if ckpt.stores.is_dir(ckpt.root) else ckpt.root.parent / name
        have = ckpt.stores.file_size(p)
        if have != size:
            state = "missing" if have is None else f"{have:,} bytes"
            problems.append(error("receipt-mismatch", f"{name}: {state}, but {where} recorded "
                                  f"{size:,} bytes; merge it again with ckpttool merge "
                                  f"{receipt.source} {ckpt.root} --overwrite", file=name))
    return problems


def verify(ckpt: Checkpoint, receipt: Receipt, digests: dict[str, str]
           ) -> tuple[list[Problem], manifest.ManifestUse]:
    """verify's receipt check of an output: problems, and the report's ``manifest`` section."""
    where = ckpt.root / RECEIPT_NAME
    unreadable = {t.name for t in ckpt.tensors} - set(digests)
    return (check(ckpt, receipt, digests, unreadable, where),
            manifest.ManifestUse(str(where), "receipt checked", len(receipt.tensors)))
