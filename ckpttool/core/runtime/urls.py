"""Remote URLs (``s3://``, ``gs://``, ``az://``, ``abfss://``) wherever a command takes a
checkpoint or output path.

One decorator, :func:`urls`, wraps each command (merge, inspect, verify, reshard): a source URL
is replaced by a local path that stands for it and names no local file
(:class:`ckpttool.storage.objtree.ObjectTree`: the object listing, every byte read in place
by ranged GETs), and the command is handed the tree as its ``stores`` (every read of a source
goes through it); an output URL by a private staging
directory under TMPDIR, written by the command exactly as a local output (``AtomicOutputs``:
free space checked, index last) and then uploaded (:class:`ckpttool.storage.s3.Upload`:
data files first, index last, every multipart upload aborted on failure or Ctrl-C). Errors and
reports name the URLs, never the temporary paths. The commands themselves never see a URL, so
local paths take exactly the path they always took.

Staging the output keeps every output rule (temporary names, ``--overwrite``, the index
renamed last) in one place, at the cost of local disk for one copy of the output; a
streaming upload (parts sent as the merge writes them) would need none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from ckpttool.errors import CkptError
from ckpttool.storage import places
from ckpttool.storage.remote import backend, parts

P = ParamSpec("P")
R = TypeVar("R")


# Parameters that name local files only (a config, an adapter, a manifest): a URL there is
# refused, never taken for a relative path.
_LOCAL_ONLY = ("config", "adapter", "adapter_config", "manifest")


def is_url(value: object) -> bool:
    """True for an object-store URL (``s3://``, ``gs://``, ``az://``...): the scheme test of
    :mod:`ckpttool.storage.places`, without importing the remote module (and so boto3) for
    local paths."""
    return places.is_remote(value)


def check_location(value: object, *, what: str, remote_ok: bool = True) -> None:
    """Refuse what :func:`ckpttool.storage.places.classify` refuses (``-``, a scheme not
    served, a URL where only a local path is taken) before it can become a local path named
    ``gs:/...`` or ``./-/``; None (an option not given) passes.

    Raises:
        UsageError: ``-`` (exit 2).
        UnsupportedError: (exit 4) naming the schemes that are supported.
    """
    if isinstance(value, str | os.PathLike):
        places.classify(value, what=what, remote_ok=remote_ok)


# What storage is told about formats (it names none): which objects an output replaces, and
# which makes an output look complete (uploaded last).
_REPLACED_SUFFIXES = (".safetensors", ".safetensors.index.json", ".distcp")
_LAST_SUFFIXES = (".index.json",)
_METADATA = ".metadata"


def _replaced(name: str) -> bool:
    return name.endswith(_REPLACED_SUFFIXES) or name == _METADATA


def _last(name: str) -> bool:
    return name.endswith(_LAST_SUFFIXES) or name == _METADATA


def urls(*, sources: tuple[str, ...], output: str | None = None
         ) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Let the parameters ``sources`` (checkpoints read) and ``output`` (a directory written)
    of the decorated command be object-storage URLs."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            bound = signature.bind(*args, **kwargs)
            given = bound.arguments
            names = [n for n in (*sources, output) if n is not None]
            values = {n: os.fspath(given[n]) if isinstance(given.get(n), os.PathLike)
                      else given.get(n) for n in names}
            for n, v in values.items():
                check_location(v, what="output" if n == output else "source")
            for n in _LOCAL_ONLY:
                if n in given and n not in values:
                    check_location(given[n], what=f"--{n.replace('_', '-')}", remote_ok=False)
            if not any(is_url(v) for v in values.values()):
                return fn(*args, **kwargs)
            return _remote(fn, bound, values, output)

        return run

    return wrap


def _remote(fn: Callable[..., R], bound: inspect.BoundArguments, values: dict[str, Any],
            output: str | None) -> R:
    from ckpttool.storage.objtree import Mounts, ObjectTree

    renames: list[tuple[str, str]] = []  # (local path, URL) for messages and reports
    with contextlib.ExitStack() as stack:
        try:
            out_url = None
            if output is not None and is_url(values[output]):
                overwrite = bool(bound.arguments.get("overwrite", False))
                shared = bound.arguments.get("shared")
                if shared is not None:
                    # Each process uploads its parts straight into the output's uploads
                    # (core/merge/multihost_objects.py); --finish (rank 0) locks and commits.
                    bound.arguments["shared"] = shared_into(shared, values[output])
                    tmp = backend(values[output]).staging_dir()
                    stack.callback(shutil.rmtree, tmp, ignore_errors=True)
                    bound.arguments[output] = str(tmp / "out")  # nothing is written there
                    renames.append((str(tmp / "out"), str(values[output])))
                else:
                    out_url = stack.enter_context(claimed(values[output],
                                                          overwrite=overwrite))
            mounted = []
            for name, value in values.items():
                if name != output and is_url(value):
                    tree = stack.enter_context(ObjectTree(value))
                    mounted.append(tree)
                    bound.arguments[name] = str(tree.local)
                    renames.append((str(tree.dir), str(tree.base_url)))
            if mounted:  # the command reads its sources through the trees
                bound.arguments["stores"] = Mounts(mounted)
            staged = None
            if out_url is not None:
                tmp = backend(out_url).staging_dir()
                stack.callback(shutil.rmtree, tmp, ignore_errors=True)
                staged = tmp / (out_url.name or "out")
                assert output is not None
                bound.arguments[output] = str(staged)
                renames.append((str(staged), str(out_url)))
            result = fn(*bound.args, **bound.kwargs)
            if out_url is not None and staged is not None:
                upload(out_url, staged, overwrite=bool(bound.arguments.get("overwrite", False)))
        except CkptError as e:
            e.args = tuple(_rename(a, renames) if isinstance(a, str) else a for a in e.args)
            raise
        renamed: R = _renamed(result, renames)
        return renamed


def shared_into(shared: Any, value: str) -> Any:
    """A shared merge's process (slice, finish, torchrun rank) writing into the output URL
    ``value`` (:mod:`ckpttool.core.merge.multihost_objects`)."""
    from ckpttool.core.merge import multihost_objects

    remote = backend(value)
    url = remote.parse(value)
    target = multihost_objects.Target(url=url, parts=parts(value), lock=remote.Lock,
                                      upload=remote.Upload, names=output_names())
    return multihost_objects.into_store(shared, target)


def output_names() -> Any:
    """What storage is told about an output's objects (``s3.OutputNames``)."""
    from ckpttool.storage import s3

    return s3.OutputNames(replaces=_replaced, last=_last)


@contextlib.contextmanager
def claimed(value: str, *, overwrite: bool) -> Iterator[Any]:
    """The output URL checked (weights there need ``overwrite``) and locked for this run
    while the block runs (:class:`~ckpttool.storage.s3.Lock`), before any work."""
    remote = backend(value)
    url = remote.check_output(value, overwrite=overwrite, names=output_names())
    lock = remote.Lock(url)
    lock.acquire()
    try:
        yield url
    finally:
        lock.release()


def upload(url: Any, staged: Path, *, overwrite: bool) -> None:
    """Upload the finished local output ``staged`` to ``url`` (index last; see
    :class:`~ckpttool.storage.s3.Upload`)."""
    remote = backend(url)
    with remote.errors(url, "uploading"):
        remote.Upload(url, overwrite=overwrite, names=output_names()).run(staged)


def _rename(text: str, renames: list[tuple[str, str]]) -> str:
    for local, url in renames:
        text = text.replace(local, url)
    return text


def _renamed(value: Any, renames: list[tuple[str, str]]) -> Any:
    """``value`` (a report) with the temporary paths in its strings written as URLs."""
    if isinstance(value, str):
        return _rename(value, renames)
    if isinstance(value, Path):
        return _rename(str(value), renames)
    if isinstance(value, list):
        return [_renamed(v, renames) for v in value]
    if isinstance(value, tuple):
        return tuple(_renamed(v, renames) for v in value)
    if isinstance(value, dict):
        return {_renamed(k, renames): _renamed(v, renames) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            with contextlib.suppress(dataclasses.FrozenInstanceError, AttributeError):
                object.__setattr__(value, f.name, _renamed(getattr(value, f.name), renames))
        return value
    return value
