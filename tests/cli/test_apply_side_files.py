"""apply reads the side files a delta names as every other side file is read
(storage/sidefiles.py): a link is refused, never followed out of the delta."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import diff_pair, invoke

NO_FSYNC = {"CKPTTOOL_FSYNC": "0"}


def test_a_delta_side_file_that_is_a_link_is_exit_3(tmp_path: Path) -> None:
    a, b = diff_pair(tmp_path)
    (Path(b) / "config.json").write_text("{}")
    assert invoke("diff", a, b, "--write-delta", tmp_path / "d", env=NO_FSYNC).exit_code == 1
    doc_path = tmp_path / "d" / "delta.json"
    doc = json.loads(doc_path.read_text())
    doc["files"] = ["tokenizer.json"]
    doc_path.write_text(json.dumps(doc))
    secret = tmp_path / "secret"
    secret.write_text("a private key")
    (tmp_path / "d" / "tokenizer.json").symlink_to(secret)
    r = invoke("apply", a, tmp_path / "d", tmp_path / "out", env=NO_FSYNC)
    assert r.exit_code == 3, r.output
    assert r.stderr.count("\n") == 1
    assert not (tmp_path / "out" / "tokenizer.json").exists()
