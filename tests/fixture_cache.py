"""What the fixture writers write, kept on disk between test sessions.

A writer (real gloo ranks calling ``dcp.save``, Megatron-Core, PEFT under FSDP2...) costs
seconds to a minute; what it writes depends only on its source and on the packages it runs.
:func:`cached` runs a writer once into ``.cache/fixtures/<name>-<key>/`` (git-ignored; or
``$CKPTTOOL_TEST_FIXTURES``), where ``key`` hashes the Python version, the versions of
:data:`PACKAGES` and the text of the writers' source files (:data:`WRITERS`), and hands each
session a fresh copy of it in that session's temporary directory: a test may change its copy
as it likes, and a changed writer or package is a new key, so a stale entry is never read.
:func:`on_disk` does the same for a writer function ``write(out, ...)`` of tests/, per call.

Entries are made whole or not at all (written beside, then renamed), one writer at a time
per key across processes (a lock file), so parallel workers (``pytest -n``) share one run of
each writer. ``CKPTTOOL_TEST_FIXTURES=off`` runs every writer afresh, as before; so does a
writer called outside pytest. Entries of older keys stay until ``rm -rf .cache/fixtures``.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]

# The packages whose code runs in some writer: a new version of any of them is a new key.
PACKAGES = ("torch", "numpy", "safetensors", "transformers", "accelerate", "peft",
            "megatron-core", "deepspeed", "lightning", "torchtitan", "zstandard")

# The writers' source, hashed into every key: the example's writer and every module of tests/
# that is not a test module (the writers import one another; a change to any of them makes
# every writer run again once, which is never wrong).
WRITERS = ("examples/fsdp2_checkpoint.py",
           *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("*.py")
                   if not p.name.startswith("test_")))


def cache_dir() -> Path | None:
    """Where entries live; None where the cache is turned off, and outside a test (a
    benchmark that calls a writer gets a fresh run, and no copy of a large output here)."""
    where = os.environ.get("CKPTTOOL_TEST_FIXTURES", "")
    if where.lower() in ("off", "0", "no") or "PYTEST_CURRENT_TEST" not in os.environ:
        return None
    return Path(where) if where else ROOT / ".cache" / "fixtures"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def key(name: str, sources: Iterable[str] = ()) -> str:
    """``name`` and a hash of the Python version, :data:`PACKAGES`' versions and the text of
    :data:`WRITERS` and ``sources`` (paths relative to the repository root)."""
    h = hashlib.sha256(sys.version.encode())
    for dist in PACKAGES:
        h.update(f"\0{dist}={_version(dist)}".encode())
    for rel in sorted({*WRITERS, *sources}):
        h.update(f"\0{rel}\0".encode())
        h.update((ROOT / rel).read_bytes())
    return f"{name}-{h.hexdigest()[:16]}"


def _entry(name: str, sources: Iterable[str], write: Callable[[Path], None]) -> Path | None:
    """The entry of :func:`key` ``(name, sources)``, made by ``write(dir)`` where missing;
    None where the cache is off."""
    root = cache_dir()
    if root is None:
        return None
    entry = root / key(name, sources)
    if not entry.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{entry.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be writing this entry
            if not entry.is_dir():
                part = root / f".{entry.name}.{os.getpid()}"
                shutil.rmtree(part, ignore_errors=True)
                part.mkdir()
                write(part)
                part.rename(entry)
    return entry


def cached(name: str, write: Callable[[Path], object], into: Path,
           sources: Iterable[str] = ()) -> Path:
    """Fill the empty or missing directory ``into`` with what ``write(dir)`` writes into a
    fresh ``dir``: from the entry of :func:`key` ``(name, sources)``, made by ``write`` on
    the first call. Returns ``into``."""
    def make(d: Path) -> None:
        write(d)

    entry = _entry(name, sources, make)
    if entry is None:
        into.mkdir(parents=True, exist_ok=True)
        write(into)
    else:
        shutil.copytree(entry, into, symlinks=True, dirs_exist_ok=True)
    return into


R = TypeVar("R")

# What an :func:`on_disk` entry calls the writer's ``out``: the name it is given is not kept.
OUT = "out"


def on_disk(*sources: str) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """A writer ``write(out, *args, **kwargs)`` that writes ``out`` (and nothing outside
    ``out``'s parent), kept on disk per ``args`` and ``kwargs``, whatever ``out`` is called
    (``tmp_path_factory.mktemp`` numbers its names per worker, and two tests that ask for the
    same checkpoint under different names share one run of the writer): the entry holds
    ``out`` as :data:`OUT`, and a later call copies it to ``out`` and the writer's other new
    entries beside it, and returns what ``write`` returned, a path under ``out``'s parent or
    a JSON value.
    ``sources``: the files besides :data:`WRITERS` and the writer's own module that what it
    writes depends on."""

    def wrap(write: Callable[..., R]) -> Callable[..., R]:
        module = Path(inspect.getfile(write)).resolve().relative_to(ROOT).as_posix()

        @functools.wraps(write)
        def cached_write(out: Path | str, *args: Any, **kwargs: Any) -> R:
            out = Path(out)
            call = f"{write.__qualname__}({args!r}, {sorted(kwargs.items())!r})"

            def make(d: Path) -> None:
                got = write(d / "files" / OUT, *args, **kwargs)
                if isinstance(got, Path):
                    value: object = {"path": got.resolve().relative_to(d.resolve() / "files")
                                     .as_posix()}
                else:
                    value = {"value": got}
                (d / "result.json").write_text(json.dumps(value))

            name = f"{write.__name__}-{hashlib.sha256(call.encode()).hexdigest()[:8]}"
            entry = _entry(name, (module, *sources), make)
            if entry is None:
                return write(out, *args, **kwargs)
            out.parent.mkdir(parents=True, exist_ok=True)
            for made in (entry / "files").iterdir():
                to = out if made.name == OUT else out.parent / made.name
                if made.is_dir() and not made.is_symlink():
                    shutil.copytree(made, to, symlinks=True, dirs_exist_ok=True)
                else:
                    shutil.copy2(made, to, follow_symlinks=False)
            result = json.loads((entry / "result.json").read_text())
            if "path" in result:
                first, *rest = Path(result["path"]).parts or (".",)
                path = (out if first == OUT else out.parent / first).joinpath(*rest)
                return path  # type: ignore[return-value]
            return result["value"]  # type: ignore[no-any-return]

        return cached_write

    return wrap
