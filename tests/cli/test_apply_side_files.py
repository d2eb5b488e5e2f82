"""apply reads the side files a delta names as every other side file is read
(storage/sidefiles.py): a link is refused, never followed out of the delta."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.test_diff_cli import pair, run


def test_a_delta_side_file_that_is_a_link_is_exit_3(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    (Path(b) / "config.json").write_text("{}")
    assert run("diff", a, b, "--write-delta", tmp_path / "d").exit_code == 1
    doc_path = tmp_path / "d" / "delta.json"
    doc = json.loads(doc_path.read_text())
    doc["files"] = ["tokenizer.json"]
    doc_path.write_text(json.dumps(doc))
    secret = tmp_path / "secret"
    secret.write_text("a private key")
    (tmp_path / "d" / "tokenizer.json").symlink_to(secret)
    r = run("apply", a, tmp_path / "d", tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert r.stderr.count("\n") == 1
    assert not (tmp_path / "out" / "tokenizer.json").exists()
