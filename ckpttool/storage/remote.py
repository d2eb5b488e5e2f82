"""Which module serves an object-storage URL, by its scheme: :mod:`ckpttool.storage.s3` for
``s3://`` (boto3), :mod:`ckpttool.storage.objstore` for ``gs://``, ``az://`` and
``abfs[s]://`` (obstore). Both are a :class:`ckpttool.storage.objects.Backend` (as is
:mod:`ckpttool.storage.memory`, which serves no scheme: it is handed over explicitly);
importing either imports no client library."""

from __future__ import annotations

from typing import Any

from ckpttool.storage import objects, places

# Every scheme served, in the order messages list them (classified in storage/places.py).
SCHEMES = places.SCHEMES


def scheme(value: object) -> str:
    """The scheme of the URL ``value`` (a str or a parsed URL); "" for anything else."""
    return places.scheme_of(str(value)) or ""


def backend(value: object) -> objects.Backend:
    """The module that serves the URL ``value`` (a str or a parsed URL): its
    :class:`~ckpttool.storage.objects.Backend`.

    Raises:
        ValueError: not a URL of a scheme in :data:`SCHEMES` (callers classify first:
            :func:`ckpttool.storage.places.classify`).
    """
    which = scheme(value)
    if which == "s3":
        from ckpttool.storage import s3

        return s3
    if which in SCHEMES:
        from ckpttool.storage import objstore

        return objstore
    raise ValueError(f"{value}: not an object-storage URL")


def parts(value: object) -> Any:
    """The shared-upload primitives (:class:`ckpttool.storage.objects.Parts`) of the store
    that serves the URL ``value``."""
    which = scheme(value)
    if which == "s3":
        from ckpttool.storage import s3

        return s3.Parts()
    from ckpttool.storage import objparts

    return objparts.parts(backend(value).parse(str(value)))
