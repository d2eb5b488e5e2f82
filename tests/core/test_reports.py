"""Every report is one JSON document, and the same noun has the same shape in every report."""

from __future__ import annotations

import json
from pathlib import Path

import ckpttool


def test_every_report_dumps_and_parts_share_one_shape(llama_ckpt: Path, tmp_path: Path) -> None:
    docs = {
        "merge": ckpttool.merge(llama_ckpt, tmp_path / "out").to_json(),
        "inspect": ckpttool.inspect(llama_ckpt).to_json(),
        "verify": ckpttool.verify(llama_ckpt).to_json(),
        "reshard": ckpttool.reshard(tmp_path / "out", tmp_path / "dcp").to_json(),
    }
    for command, doc in docs.items():
        again = json.loads(json.dumps(doc))
        assert again["schema"] == 1 and again["command"] == command
    shapes = {command: {tuple(sorted(p)) for p in docs[command]["parts"]}
              for command in ("merge", "inspect", "verify")}
    assert shapes["merge"] == shapes["inspect"] == shapes["verify"] == {
        ("format", "kind", "note", "path")}
    assert {p["path"] for p in docs["verify"]["parts"]} == {"optimizer_0"}
    assert "optimizer_0" in {p["path"] for p in docs["inspect"]["parts"]}
