"""`ckpttool merge` through the CLI: exit codes, messages, --json, -q."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from typer.testing import CliRunner

from ckpttool.cli import app
from tests.helpers import write_malicious


def run(*args: str | Path, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def test_merge_prints_a_report(llama_ckpt: Path, tmp_path: Path) -> None:
    r = run("merge", llama_ckpt, tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert f"used pytorch_model_fsdp_0, found in {llama_ckpt}; skipped optimizer_0" in r.stdout
    assert "wrote model.safetensors" in r.stdout
    assert ("tied: lm_head.weight is identical to model.embed_tokens.weight; written once"
            in r.stdout)
    assert "config.json: architectures: FSDPLlamaForCausalLM -> LlamaForCausalLM" in r.stdout


def test_json_is_one_document(mixed_ckpt: Path, tmp_path: Path) -> None:
    r = run("merge", "--weights-only", mixed_ckpt, tmp_path / "out", "--json", "--dtype", "keep")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema"] == 1 and doc["command"] == "merge"
    assert doc["files"][0]["name"] == "model.safetensors"
    assert {o["name"] for o in doc["non_tensor"]} >= {"step", "opaque"}


def test_quiet_prints_nothing(uneven_ckpt: Path, tmp_path: Path) -> None:
    r = run("merge", "--weights-only", uneven_ckpt, tmp_path / "out", "-q")
    assert r.exit_code == 0 and r.output == ""


def test_malicious_metadata_exit_3_nothing_runs(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    ckpt = write_malicious(tmp_path / "evil", sentinel)
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr == (
        f"ckpttool: error: {ckpt}/.metadata: refused to load: the pickle asks for "
        f"'{os.system.__module__}.system', which a DCP .metadata never contains; the file may be "
        "malicious (nothing was executed)\n"
    )
    assert not sentinel.exists() and not (tmp_path / "out").exists()


def test_truncated_distcp_exit_3(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "ckpt"
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", damaged)
    victim = damaged / "__1_0.distcp"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 100)
    r = run("merge", "--weights-only", damaged, tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr.startswith(f"ckpttool: error: {victim}: truncated: .metadata places ")
    assert r.stderr.endswith(f"but the file has {size - 100} bytes; copy the checkpoint again\n")
    assert "Traceback" not in r.output


def test_missing_distcp_exit_3(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "ckpt"
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", damaged)
    (damaged / "__0_0.distcp").unlink()
    r = run("merge", "--weights-only", damaged, tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {damaged}/__0_0.distcp: data file is missing; "
                        ".metadata references it (7 entries, e.g. tensor 'model.a'). Copy the "
                        "whole checkpoint directory again\n")


def test_missing_metadata_exit_3(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "ckpt"
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", damaged)
    (damaged / ".metadata").unlink()
    r = run("merge", "--weights-only", damaged, tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {damaged}: has .distcp data files but no .metadata; "
                        "the copy is incomplete (copy .metadata too)\n")


def test_two_candidates_exit_3(uneven_ckpt: Path, tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", parent / "a")
    shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", parent / "b")
    r = run("merge", "--weights-only", parent, tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {parent}: holds 2 model checkpoints (a, b); pass one "
                        f"of them, e.g. ckpttool merge {parent}/a OUT\n")


def test_existing_output_exit_3(uneven_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    r = run("merge", "--weights-only", uneven_ckpt, out)
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {out}: already holds model.safetensors; pass "
                        "--overwrite to replace them or choose an empty directory\n")
    assert (out / "model.safetensors").read_bytes() == b"precious"
    assert run("merge", "--weights-only", uneven_ckpt, out, "--overwrite", "-q").exit_code == 0
    assert (out / "model.safetensors").read_bytes() != b"precious"


def test_not_a_checkpoint_exit_3(tmp_path: Path) -> None:
    r = run("merge", "--weights-only", tmp_path, tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr.startswith(f"ckpttool: error: {tmp_path}: no checkpoint here")
    r = run("merge", "--weights-only", tmp_path / "nope", tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr == f"ckpttool: error: {tmp_path / 'nope'}: no such file or directory\n"


def test_only_optimizer_exit_3(llama_ckpt: Path, tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    shutil.copytree(llama_ckpt / "optimizer_0", parent / "optimizer_0")
    r = run("merge", "--weights-only", parent, tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {parent}: holds only optimizer state (optimizer_0), "
                        "no model checkpoint; to merge the optimizer state, pass its directory: "
                        f"ckpttool merge {parent}/optimizer_0 OUT\n")


def test_unsupported_dtype_exit_4(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    torch_dcp.save({"model": {"z": torch.ones(3, dtype=torch.complex128)}}, checkpoint_id=ckpt)
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 4
    assert r.stderr == (f"ckpttool: error: {ckpt}/.metadata: tensor 'model.z' has dtype "
                        "torch.complex128, which ckpttool cannot write to safetensors\n")


def test_usage_errors_exit_2(uneven_ckpt: Path, tmp_path: Path) -> None:
    assert run("merge", "--weights-only", uneven_ckpt, tmp_path / "o", "--dtype",
               "int4").exit_code == 2
    assert run("merge", "--weights-only", uneven_ckpt).exit_code == 2
    assert run("merge", "--weights-only", uneven_ckpt, tmp_path / "o", "--workers",
               "0").exit_code == 2


def test_bad_shard_size_is_a_usage_error(uneven_ckpt: Path, tmp_path: Path) -> None:
    for size in ("huge", "5XB"):
        r = run("merge", "--weights-only", uneven_ckpt, tmp_path / "o", "--max-shard-size", size)
        assert r.exit_code == 2
        assert (f"Invalid value for '--max-shard-size': invalid size '{size}'; write it like "
                "5GB, 500MB or 2GiB") in r.stderr
        assert not (tmp_path / "o").exists()


def test_debug_shows_traceback(tmp_path: Path) -> None:
    r = run("merge", "--weights-only", tmp_path / "nope", tmp_path / "out",
            env={"CKPTTOOL_DEBUG": "1"})
    assert r.exit_code == 3 and "Traceback" in r.stderr


def test_internal_bug_exit_70(uneven_ckpt: Path, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("ckpttool.core.merge.operation.plan_merge", boom)
    r = run("merge", "--weights-only", uneven_ckpt, tmp_path / "out")
    assert r.exit_code == 70
    assert "RuntimeError: boom" in r.stderr
    assert r.stderr.endswith("ckpttool: internal error (a bug in ckpttool); please report it "
                             "with the traceback above\n")


def test_write_failure_is_exit_3_and_leaves_nothing(llama_ckpt: Path, tmp_path: Path) -> None:
    import resource
    import subprocess
    import sys

    out = tmp_path / "out"

    def limit_file_size() -> None:  # as a full disk or quota would
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    r = subprocess.run([sys.executable, "-m", "ckpttool", "merge", str(llama_ckpt), str(out)],
                       preexec_fn=limit_file_size, capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    assert r.stderr == ("ckpttool: error: writing the output failed: File too large; free space "
                        "(or raise the quota or file-size limit) where the output goes, then run "
                        "again\n")
    assert not out.exists()  # nor the directory it created (issue 24)


@pytest.mark.parametrize(("spelling", "want"), [("bfloat16", "BF16"), ("torch.float16", "F16"),
                                                ("FP32", "F32")])
def test_dtype_spelled_as_torch_and_config_spell_it(spelling: str, want: str, uneven_ckpt: Path,
                                                    tmp_path: Path) -> None:
    r = run("merge", "--weights-only", uneven_ckpt, tmp_path / "out", "--dtype", spelling, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dtype"]["target"] == want


def test_out_inside_the_checkpoint_is_refused(uneven_ckpt: Path, tmp_path: Path) -> None:
    ckpt = Path(shutil.copytree(uneven_ckpt, tmp_path / "ck"))
    before = sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").iterdir())
    for out in (ckpt / "pytorch_model_fsdp_0", ckpt / "pytorch_model_fsdp_0" / "hf", ckpt,
                ckpt / "merged"):
        src = ckpt if out.is_relative_to(ckpt) and out != ckpt / "pytorch_model_fsdp_0" \
            else ckpt / "pytorch_model_fsdp_0"
        r = run("merge", "--weights-only", src, out)
        assert r.exit_code == 3, (src, out, r.output)
        assert "choose an output directory outside it" in r.stderr
    assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").iterdir()) == before
    assert not (ckpt / "merged").exists() and not (ckpt / "model.safetensors").exists()


def test_a_broken_pipe_ends_quietly(uneven_ckpt: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ckpttool", "inspect", str(uneven_ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    proc.wait(timeout=60)
    assert proc.returncode in (0, -13), proc.returncode  # -13: SIGPIPE, the shell's 141
    assert proc.stderr.read() == b""


def test_a_data_file_linked_out_of_the_checkpoint_needs_follow_links(uneven_ckpt: Path,
                                                                     tmp_path: Path) -> None:
    ckpt = Path(shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", tmp_path / "ckpt"))
    shared = tmp_path / "shared"
    shared.mkdir()
    (ckpt / "__1_0.distcp").rename(shared / "__1_0.distcp")
    (ckpt / "__1_0.distcp").symlink_to(shared / "__1_0.distcp")
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {ckpt / '__1_0.distcp'}: a link to "
                        f"{shared / '__1_0.distcp'}, outside the checkpoint directory; pass "
                        "--follow-links to read data files through links\n")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert run("verify", ckpt).exit_code == 1
    assert run("merge", "--weights-only", ckpt, tmp_path / "out", "--follow-links",
               "-q").exit_code == 0
    assert run("verify", ckpt, "--follow-links", "--against", tmp_path / "out").exit_code == 0
    inside = Path(shutil.copytree(uneven_ckpt / "pytorch_model_fsdp_0", tmp_path / "in"))
    (inside / "data").mkdir()
    (inside / "__0_0.distcp").rename(inside / "data" / "__0_0.distcp")
    (inside / "__0_0.distcp").symlink_to("data/__0_0.distcp")  # a link inside: fine
    assert run("merge", "--weights-only", inside, tmp_path / "out2", "-q").exit_code == 0

