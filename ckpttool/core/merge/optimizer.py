"""Optimizer state beside ``optimizer.safetensors``: its non-tensor part (param groups,
hyper-parameters) as ``optimizer.json``, nested as it was saved."""

from __future__ import annotations

import json
from typing import Any

from ckpttool.core.checkpoint import names, non_tensor
from ckpttool.core.checkpoint.discover import ObjectView

OPTIMIZER_JSON = "optimizer.json"


def optimizer_json(objects: list[tuple[ObjectView, Any]], top: str = "optimizer") -> bytes:
    """Non-tensor optimizer state (param groups, hyper-parameters) nested as it was saved
    (below its top-level key ``top``), with parameter names in canonical form."""
    root: dict[str, Any] = {}
    unreadable = []
    for view, value in objects:
        stored = view.entry.path
        path = stored[1:] if len(stored) > 1 and stored[0] == top else stored
        if isinstance(value, non_tensor.Unreadable):
            unreadable.append(".".join(path))
            continue
        if path[-1] == "params" and isinstance(value, list):
            value = [names.strip_wrappers(v) if isinstance(v, str) else v for v in value]
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = non_tensor.plain_json(value)
    doc = _lists(root)
    if unreadable:
        doc["not_read"] = unreadable
    return (json.dumps(doc, indent=2) + "\n").encode()


def _lists(node: Any) -> Any:
    """Dicts keyed "0", "1"... (flattened lists) back into lists."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node) and sorted(map(int, node)) == list(
            range(len(node))):
        return [node[str(i)] for i in range(len(node))]
    return node
