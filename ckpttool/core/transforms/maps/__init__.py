"""Every name map (``merge --names``), one module of data per framework: the registry.

:mod:`.rules` holds the vocabulary they share; :mod:`ckpttool.core.transforms.namemaps`
applies a map. A new framework is one module here and one line below.
"""

from __future__ import annotations

from ckpttool.core.transforms.maps import megatron, torchtitan, torchtune
from ckpttool.core.transforms.maps.rules import NameMap

MAPS: dict[str, NameMap] = {m.name: m for m in (*megatron.MAPS, *torchtitan.MAPS,
                                                *torchtune.MAPS)}
NAMES = tuple(MAPS)
KEEP = "none"  # --names none: the stored names, even where a map is implied
