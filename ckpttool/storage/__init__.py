"""Bytes: local files, object stores, atomic outputs. Names no format (the URL schemes a
command takes are listed once, in ``ckpttool.storage.places.SCHEMES``)."""
