"""What a loader takes for a config, kept on disk between runs.

Building the consumer costs its imports (transformers with torch: about 6 s of CPU, most of
it torch's compiler and distributed tensors, which transformers imports for its model
classes), paid by every merge with a config. What it yields (names, shapes, ties, the names
ignored on load) is a function of the config and the installed packages' versions only, so
it is kept under the user's cache directory (``$XDG_CACHE_HOME/ckpttool/contract``, else
``~/.cache/ckpttool/contract``), one JSON file per (config, versions), and a later run for
the same config and versions reads it instead of importing anything.

A package that cannot be imported here (uninstalled, or blocked) is never answered from the
cache: the check says it was not made, as without a cache. A file that does not read as
what this module writes is ignored and written again; a cache that cannot be written is
skipped. Nothing in it is executed: it is JSON, checked by the caller field by field.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

# Raised when what is stored changes shape, so that an older file is not read as a newer one.
SCHEMA = 1
# Larger than any model's entry (Mixtral-8x22B's is about 0.2 MB); a larger file is not read.
MAX_BYTES = 64 << 20


def directory() -> Path:
    """Where the entries are kept (the XDG base-directory rule; not a ckpttool knob)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ckpttool" / "contract"


def versions(packages: tuple[str, ...]) -> dict[str, str] | None:
    """The installed version of each package, without importing any; None where one cannot
    be imported here (not installed, or blocked: ``sys.modules[name] = None``)."""
    found = {}
    for name in packages:
        try:
            if importlib.util.find_spec(name) is None:
                return None
            found[name] = importlib.metadata.version(name)
        except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
            return None
    return found


def key(loader: str, config_json: str, packages: tuple[str, ...]) -> str | None:
    """The entry's name for ``config_json`` (sorted JSON) under ``loader`` and the installed
    ``packages``; None where a package is missing (the cache is not used)."""
    found = versions(packages)
    if found is None:
        return None
    text = json.dumps({"schema": SCHEMA, "loader": loader, "versions": found,
                       "config": config_json}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def load(name: str) -> dict[str, Any] | None:
    """The stored document, or None (absent, unreadable, too large, not a JSON object)."""
    path = directory() / f"{name}.json"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_BYTES:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == SCHEMA else None


def store(name: str, doc: dict[str, Any]) -> None:
    """Keep ``doc`` (written whole under a temporary name, then renamed); a cache directory
    that cannot be written is skipped silently (the next run builds the consumer again)."""
    folder = directory()
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({**doc, "schema": SCHEMA}, f)
            os.replace(tmp, folder / f"{name}.json")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
