"""`ckpttool inspect` through the CLI: output, --json, --filter, --stats, exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

from ckpttool.cli import app
from tests.helpers import write_malicious


def run(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_training_directory(llama_ckpt: Path) -> None:
    r = run("inspect", llama_ckpt)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == (f"dcp checkpoint {llama_ckpt}/pytorch_model_fsdp_0 (model), found in "
                        f"{llama_ckpt}")
    assert "    optimizer_0: optimizer (dcp; 60 tensors, 2 files)" in lines
    assert "    random_states_0.pkl: other (pickle; not unpickled)" in lines
    assert "  2 ranks, 2 files; 21 tensors, 26,784 parameters, 107.14 KB (F32 107.14 KB)" in lines
    assert ("  tie candidates: lm_head.weight / model.embed_tokens.weight (config ties them)"
            in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("name "))
    assert lines[header].split() == ["name", "shape", "dtype", "size", "chunks", "placement",
                                     "files"]
    assert lines[header + 1].split() == ["model.embed_tokens.weight", "128x32", "F32",
                                         "16.38", "KB", "2", "Shard(0)", "x2", "2", "files"]
    assert len(lines) == header + 22


def test_json_shape_is_the_same_for_every_format(uneven_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("merge", "--weights-only", uneven_ckpt, out, "-q").exit_code == 0
    bin_path = tmp_path / "w.bin"
    torch.save({"a": torch.ones(2, 3)}, bin_path)
    docs = []
    for path in (uneven_ckpt, out, out / "model.safetensors", bin_path):
        r = run("inspect", path, "--json")
        assert r.exit_code == 0, r.output
        docs.append(json.loads(r.stdout))
    for doc in docs:
        assert doc["schema"] == 1 and doc["command"] == "inspect"
        assert set(doc) == set(docs[0])
        assert set(doc["summary"]) == set(docs[0]["summary"])
        for t in doc["tensors"]:
            assert set(t) == {"name", "stored_name", "part", "shape", "dtype", "bytes",
                              "chunks", "placement", "files", "stats"}
    assert [d["format"] for d in docs] == ["dcp", "safetensors", "safetensors", "torch-save"]


def test_filter_and_stats(mixed_ckpt: Path) -> None:
    r = run("inspect", mixed_ckpt, "--filter", "int*", "--stats", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [t["name"] for t in doc["tensors"]] == ["int8", "int16", "int32", "int64",
                                                   "int_scalar"]
    scalar = doc["tensors"][-1]["stats"]
    assert scalar == {"min": 7, "max": 7, "mean": 7.0, "abs_max": 7, "nan": 0, "inf": 0,
                      "all_zero": False}
    r = run("inspect", mixed_ckpt, "--filter", "nothing*")
    assert r.exit_code == 0 and "  no tensor matches --filter 'nothing*'" in r.stdout


def test_missing_path_exit_3(tmp_path: Path) -> None:
    r = run("inspect", tmp_path / "nope")
    assert r.exit_code == 3
    assert r.stderr == f"ckpttool: error: {tmp_path / 'nope'}: no such file or directory\n"


def test_empty_directory_exit_3(tmp_path: Path) -> None:
    r = run("inspect", tmp_path)
    assert r.exit_code == 3
    assert r.stderr == (
        f"ckpttool: error: {tmp_path}: no checkpoint here (no .metadata, *.safetensors or "
        "torch.save file, here or in a subdirectory); pass the directory training saved, e.g. "
        "checkpoint-500/pytorch_model_fsdp_0\n")


def test_malicious_metadata_exit_3_nothing_runs(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    ckpt = write_malicious(tmp_path / "evil", sentinel)
    r = run("inspect", ckpt)
    assert r.exit_code == 3
    assert r.stderr == (
        f"ckpttool: error: {ckpt}/.metadata: refused to load: the pickle asks for "
        f"'{os.system.__module__}.system', which a DCP .metadata never contains; the file may be "
        "malicious (nothing was executed)\n")
    assert not sentinel.exists()


def test_pickle_file_exit_3(llama_ckpt: Path) -> None:
    path = llama_ckpt / "random_states_0.pkl"
    r = run("inspect", path)
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {path}: a Python pickle, not a checkpoint; ckpttool "
                        "never unpickles arbitrary pickles\n")


def test_missing_data_file_is_a_note(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "ckpt"
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", damaged)
    (damaged / "__1_0.distcp").unlink()
    r = run("inspect", damaged)
    assert r.exit_code == 0
    assert (f"  note: 1 data files are missing (__1_0.distcp); run ckpttool verify {damaged}"
            in r.stdout.splitlines())


def test_inspect_and_help_do_not_import_torch(uneven_ckpt: Path) -> None:
    code = ("import sys\nfrom ckpttool.cli import app\nfrom typer.testing import CliRunner\n"
            "for args in (['inspect', '--help'], ['verify', '--help'], "
            f"['inspect', {str(uneven_ckpt)!r}, '--json']):\n"
            "    r = CliRunner().invoke(app, args)\n    assert r.exit_code == 0, r.output\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unreadable_safetensors_header_exit_3(uneven_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("merge", "--weights-only", uneven_ckpt, out, "-q").exit_code == 0
    target = out / "model.safetensors"
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    r = run("inspect", out)
    assert r.exit_code == 3
    assert r.stderr.startswith(f"ckpttool: error: {target}: tensor '")
    assert r.stderr.endswith(f"but the file has {len(data) // 2} bytes; truncated; ckpttool "
                             f"verify {out} lists every problem\n")
    r = run("verify", out)
    assert r.exit_code == 1 and r.stdout.startswith(f"error: header-corrupt: {target}: tensor '")
