"""``ckpttool diff`` and ``ckpttool apply`` through the CLI: exit codes as cmp's (0 / 1 / 3),
usage errors (2), pinned messages, --json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckpttool.cli import app
from tests.helpers import diff_pair


def run(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args], env={"CKPTTOOL_FSYNC": "0"})


def test_exit_codes_as_cmp(tmp_path: Path) -> None:
    a, b = diff_pair(tmp_path)
    r = run("diff", a, a)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"diff identical: {a} -> {a}: 2 tensors (2 identical); 0 B "
                               "changed; ")
    r = run("diff", a, b)
    assert r.exit_code == 1, r.output
    assert r.stdout.splitlines()[0] == ("changed       model.norm.weight: 1 element, "
                                        "max |B-A| 1, rel L2 0.5")
    r = run("diff", a, tmp_path / "missing")
    assert r.exit_code == 3 and r.stderr.startswith("ckpttool: error: ")
    assert "Traceback" not in r.output


def test_json_document(tmp_path: Path) -> None:
    a, b = diff_pair(tmp_path)
    r = run("diff", a, b, "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["schema"] == 1 and doc["command"] == "diff" and doc["identical"] is False
    assert doc["tensors"] == [
        {"name": "model.embed_tokens.weight", "status": "identical", "changed_elements": 0,
         "max_abs_diff": 0.0, "rel_l2": 0.0},
        {"name": "model.norm.weight", "status": "changed", "changed_elements": 1,
         "max_abs_diff": 1.0, "rel_l2": 0.5}]
    assert doc["summary"] == {"identical": 1, "changed": 1, "added": 0, "removed": 0,
                              "reshaped": 0, "dtype-changed": 0, "bytes_compared": 272,
                              "bytes_changed": 4}
    assert doc["delta"] is None and doc["tied"] == []


def test_usage_errors(tmp_path: Path) -> None:
    a, b = diff_pair(tmp_path)
    r = run("diff", a, b, "--filter", "*", "--write-delta", tmp_path / "d")
    assert r.exit_code == 2 and "a delta rebuilds all of B; leave out --filter" in r.output
    r = run("diff", a, b, "--overwrite")
    assert r.exit_code == 2 and "needs --write-delta DIR" in r.output
    r = run("apply", a, tmp_path / "d", tmp_path / "o", "--max-shard-size", "lots")
    assert r.exit_code == 2


def test_delta_then_apply(tmp_path: Path) -> None:
    a, b = diff_pair(tmp_path)
    r = run("diff", a, b, "--write-delta", tmp_path / "d", "-q")
    assert r.exit_code == 1, r.output
    assert r.stdout.splitlines()[-1].startswith(f"delta written: {tmp_path / 'd'} (")
    r = run("apply", a, tmp_path / "d", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["command"] == "apply" and doc["files"] == ["model.safetensors"]
    assert (doc["from_base"], doc["sparse"], doc["whole"]) == (1, 1, 0)
    got, want = load_file(tmp_path / "out" / "model.safetensors"), load_file(
        b / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()
    r = run("apply", b, tmp_path / "d", tmp_path / "out2")
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {b}: is not the checkpoint the delta was made from "
                        "(tensor 'model.norm.weight': SHA-256 "
                        f"{_sha(b)} differs from {_sha(a)} in {tmp_path / 'd' / 'delta.json'}; "
                        "the data changed since the manifest was written); apply it to that "
                        "checkpoint (its A)\n")
    assert not (tmp_path / "out2").exists()
    r = run("apply", a, tmp_path / "d", tmp_path / "out")
    assert r.exit_code == 3 and "already holds model.safetensors; pass --overwrite" in r.stderr


def _sha(path: Path) -> str:
    import hashlib

    t = load_file(path / "model.safetensors")["model.norm.weight"]
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_verify_base_option(tmp_path: Path) -> None:
    a, b = diff_pair(tmp_path)
    r = run("verify", a, "--base", a)
    assert r.exit_code == 0
    assert f"warning: identical-to-base: every tensor of {a} is bit-identical to {a}" in r.stdout
    r = run("verify", b, "--base", a, "--json")
    doc = json.loads(r.stdout)
    assert "base" in doc["checks"]
    assert [p["code"] for p in doc["problems"] if "base" in p["code"]] == ["differs-from-base"]


def test_a_delta_that_lies_is_exit_3(tmp_path: Path) -> None:
    a, b = diff_pair(tmp_path)
    assert run("diff", a, b, "--write-delta", tmp_path / "d").exit_code == 1
    doc_path = tmp_path / "d" / "delta.json"
    doc = json.loads(doc_path.read_text())
    doc["tensors"]["model.norm.weight"]["from"] = "model.embed_tokens.weight"
    doc_path.write_text(json.dumps(doc))
    r = run("apply", a, tmp_path / "d", tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert ("damaged delta: tensor 'model.norm.weight' is made from 'model.embed_tokens.weight', "
            "which is F32 [16, 4], not F32 [4]") in r.stderr
    doc["tensors"]["model.norm.weight"]["from"] = "model.norm.weight"
    doc["files"] = ["../a/model.safetensors"]
    doc_path.write_text(json.dumps(doc))
    r = run("apply", a, tmp_path / "d", tmp_path / "out")
    assert r.exit_code == 3 and "is missing or is no config or tokenizer file" in r.stderr
    assert not (tmp_path / "out").exists()
