"""``verify --write-manifest`` / ``--check-manifest``: a SHA-256 of every tensor's bytes in C
order under canonical names (so a manifest holds across formats), written once and checked
later. Pure, but for the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ckpttool.core import ties
from ckpttool.core.checkpoint import hf
from ckpttool.core.checkpoint.discover import Checkpoint
from ckpttool.core.runtime.report import SCHEMA, Section, section
from ckpttool.errors import InputError, OutputError
from ckpttool.formats.base import Problem, error, info
from ckpttool.storage.outputs import AtomicOutputs

MANIFEST_KIND = "ckpttool-manifest"



@section
class ManifestUse(Section):
    """verify's ``manifest``: the file, what was done with it (``written``, ``checked``,
    ``receipt checked``) and the tensors it holds."""

    path: str
    action: str
    tensors: int


def document(ckpt: Checkpoint, digests: dict[str, str]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "kind": MANIFEST_KIND,
        "algorithm": "sha256",
        "about": "SHA-256 of each tensor's bytes in C order, under canonical names; any format",
        "tensors": {t.name: {"dtype": t.dtype.name, "shape": list(t.shape),
                             "sha256": digests[t.name]}
                    for t in sorted(ckpt.tensors, key=lambda t: t.name) if t.name in digests},
    }


def read(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors of a manifest written by ``verify --write-manifest``.

    Raises:
        InputError: not a ckpttool manifest.
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"{path}: cannot read the manifest ({e}); pass a file that "
                         "verify --write-manifest wrote") from e
    if not isinstance(doc, dict) or doc.get("kind") != MANIFEST_KIND or not isinstance(
            doc.get("tensors"), dict):
        raise InputError(f"{path}: not a ckpttool manifest; pass a file that verify "
                         "--write-manifest wrote")
    tensors: dict[str, dict[str, Any]] = doc["tensors"]
    return tensors


def check(ckpt: Checkpoint, expected: dict[str, dict[str, Any]],
                   digests: dict[str, str], unreadable: set[str], manifest: Path
                   ) -> list[Problem]:
    """Each tensor's dtype, shape and SHA-256 against the manifest. Pure.

    A tied copy stored once on one side (merge writes ``lm_head.weight`` once when it equals
    the input embedding) is no difference, as with ``verify --against``: the copy missing on
    one side must record the same dtype, shape and SHA-256 as its partner, and the partner
    must match."""
    problems = []
    have = ckpt.by_name()
    unties = hf.ties_word_embeddings(ckpt.hf.config) is False
    recorded = {n: _Recorded(w) for n, w in expected.items()}
    for name, want in expected.items():
        t = have.get(name)
        if t is None:
            partner = _partner(recorded, name)
            if (partner is not None and not unties and partner in have
                    and _same(want, expected[partner])
                    and digests.get(partner) == expected[partner].get("sha256")):
                problems.append(info("tie-deduplicated", f"'{name}' is in {manifest} but not "
                                     f"in the checkpoint, where it is identical to '{partner}' "
                                     "in both: a tied copy stored once", tensor=name))
                continue
            problems.append(error("manifest-missing", f"tensor '{name}' is in {manifest} but "
                                   "not in the checkpoint", tensor=name))
        elif (want.get("dtype"), want.get("shape")) != (t.dtype.name, list(t.shape)):
            problems.append(error("manifest-mismatch", f"tensor '{name}' is {t.dtype.name} "
                                   f"{list(t.shape)} but {manifest} recorded {want.get('dtype')} "
                                   f"{want.get('shape')}", tensor=name))
        elif name not in unreadable and digests.get(name) != want.get("sha256"):
            problems.append(error("manifest-mismatch", f"tensor '{name}': SHA-256 "
                                   f"{digests.get(name)} differs from {want.get('sha256')} in "
                                   f"{manifest}; the data changed since the manifest was "
                                   "written", tensor=name, file=t.files[0]))
    for name, t in have.items():
        if name not in expected:
            partner = _partner(have, name)
            if (partner is not None and not unties and partner in expected
                    and name not in unreadable and digests.get(name) is not None
                    and digests.get(name) == digests.get(partner)
                    and t.dtype == have[partner].dtype):
                problems.append(info("tie-deduplicated", f"'{name}' is not in {manifest}, but "
                                     f"it is identical to '{partner}' here: a tied copy the "
                                     "manifest's checkpoint stored once", tensor=name))
                continue
            problems.append(error("manifest-extra", f"tensor '{name}' is not in {manifest}",
                                   tensor=name))
    return problems


class _Recorded:
    """A manifest entry's shape, for :func:`ckpttool.core.ties.find_pair`."""

    def __init__(self, entry: dict[str, Any]) -> None:
        shape = entry.get("shape")
        self.shape = tuple(shape) if isinstance(shape, list) else ()


def _partner(entries: Any, name: str) -> str | None:
    """The tie partner of ``name`` among ``entries`` (names with a ``shape``), or None."""
    pair = ties.find_pair(entries)
    if pair is None or name not in pair:
        return None
    return pair[1] if name == pair[0] else pair[0]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) and a.get(k) is not None for k in ("dtype", "shape", "sha256"))


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with AtomicOutputs(path.parent) as out:
        out.write_bytes(path.name, (json.dumps(doc, indent=2) + "\n").encode())
        out.commit()


def prepare(manifest: str | os.PathLike[str] | None, action: str | None
            ) -> tuple[Path | None, dict[str, dict[str, Any]] | None]:
    """The manifest's path and, when it is to be checked, what it expects; checked before any
    data is read.

    Args:
        action: ``"write"`` (the file must not exist), ``"check"`` (it must), or None: check
            when it exists, else write.

    Raises:
        InputError: a bad action, or no manifest to check.
        OutputError: a manifest to write exists already.
    """
    if action not in (None, "write", "check"):
        raise InputError(f"manifest_action must be 'write' or 'check', not {action!r}")
    if manifest is None:
        return None, None
    path = Path(manifest)
    if action == "check" and not path.exists():
        raise InputError(f"{path}: no such manifest to check (--check-manifest); "
                         "write one first with --write-manifest")
    if action == "write" and os.path.lexists(path):
        raise OutputError(f"{path}: exists already; check it with --check-manifest, "
                          "or remove it to write a new one")
    return path, (read(path) if path.exists() and action != "write" else None)


def finish(ckpt: Checkpoint, path: Path, expected: dict[str, dict[str, Any]] | None,
           digests: dict[str, str]) -> tuple[list[Problem], ManifestUse | None]:
    """After the data pass: check the digests against ``expected``, or write the manifest
    (only when every tensor was read). Problems, and the report's ``manifest`` section."""
    unreadable = {t.name for t in ckpt.tensors} - set(digests)
    if expected is not None:
        return (check(ckpt, expected, digests, unreadable, path),
                ManifestUse(str(path), "checked", len(expected)))
    if unreadable:
        return [error("manifest-incomplete", f"{path}: not written: "
                      f"{len(unreadable)} tensors could not be read")], None
    write(path, document(ckpt, digests))
    return [], ManifestUse(str(path), "written", len(digests))
