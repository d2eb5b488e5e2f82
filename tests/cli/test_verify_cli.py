"""`ckpttool verify` through the CLI: exit codes 0 / 1 / 3, pinned messages, --json."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.formats.dcp import reader as dcp
from tests.helpers import write_malicious

KINDS = ("llama", "uneven", "wrappers", "mixed", "placements")


def run(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args])


def copy_dcp(ckpt: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(ckpt / "pytorch_model_fsdp_0", out)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_undamaged_exit_0(kind: str, make_checkpoint) -> None:
    ckpt = make_checkpoint(kind)
    r = run("verify", ckpt)
    assert r.exit_code == 0, r.output
    last = r.stdout.splitlines()[-1]
    also = " (and optimizer_0)" if kind == "llama" else ""
    assert last.startswith(f"verify OK: {ckpt}/pytorch_model_fsdp_0{also}: 0 errors, ")


def test_llama_report(llama_ckpt: Path) -> None:
    r = run("verify", llama_ckpt)
    assert r.exit_code == 0
    assert r.stdout.splitlines()[:3] == [
        "info: tie-ok: 'lm_head.weight' is identical to 'model.embed_tokens.weight', as "
        "config.json ties them",
        f"warning: fsdp-prefix: {llama_ckpt}/config.json: architectures names "
        "FSDPLlamaForCausalLM, a class no library defines (vLLM picks the model class from it); "
        "ckpttool merge writes LlamaForCausalLM",
        "info: dtype-differs-from-config: floating tensors are F32 but config.json "
        "dtype=bfloat16; ckpttool merge --dtype auto casts them (check with --expect-dtype "
        "auto)",
    ]


def test_flipped_byte_exit_1(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    info = dcp.read_info(damaged)
    entry = info.tensor("model.c")
    c = entry.chunks[0]
    with dcp.open_reader(info) as reader:
        rec = reader.payload(entry, c)
    with open(damaged / c.file, "r+b") as f:
        f.seek(rec.storage_offset)
        byte = f.read(1)
        f.seek(rec.storage_offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = run("verify", damaged, "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["counts"]["error"] == 1
    (p,) = [p for p in doc["problems"] if p["severity"] == "error"]
    assert p["code"] == "crc-mismatch"
    assert p["location"] == {"file": c.file, "tensor": "c", "offset": rec.storage_offset}
    r = run("verify", damaged, "-q")
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(
        f"error: crc-mismatch: {damaged}/{c.file} at byte {rec.storage_offset} (tensor 'c', chunk "
        "at offsets [0, 0]): CRC-32 of the stored bytes is ")
    assert lines[0].endswith("the bytes changed after they were written (bit rot, a bad copy). "
                             "Copy the checkpoint again from a good source")
    assert lines[1].startswith(f"verify FAILED: {damaged}: 1 error, 0 warnings, 0 notes; ")


def test_truncated_and_missing_distcp_exit_1(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    victim = damaged / "__1_0.distcp"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 100)
    (damaged / "__2_0.distcp").unlink()
    r = run("verify", damaged)
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"error: truncated-file: {victim}: truncated: .metadata places ")
    assert lines[0].endswith(f"but the file has {size - 100} bytes; copy the checkpoint again")
    assert lines[1].startswith(f"error: missing-file: {damaged}/__2_0.distcp: data file is "
                               "missing; .metadata references it (")
    assert lines[-1].startswith(f"verify FAILED: {damaged}: 2 errors")


def test_truncated_metadata_exit_3(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    data = (damaged / ".metadata").read_bytes()
    (damaged / ".metadata").write_bytes(data[: len(data) // 2])
    r = run("verify", damaged)
    assert r.exit_code == 3
    assert r.stderr.startswith(f"ckpttool: error: {damaged}/.metadata: truncated or corrupt "
                               ".metadata (")
    assert r.stderr.endswith("); copy it again from the source\n")
    assert r.stdout == ""


def test_malicious_metadata_exit_3_nothing_runs(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    ckpt = write_malicious(tmp_path / "evil", sentinel)
    r = run("verify", ckpt)
    assert r.exit_code == 3
    assert r.stderr == (
        f"ckpttool: error: {ckpt}/.metadata: refused to load: the pickle asks for "
        f"'{os.system.__module__}.system', which a DCP .metadata never contains; the file may be "
        "malicious (nothing was executed)\n")
    assert not sentinel.exists()


def test_storage_path_outside_exit_3(uneven_ckpt: Path, tmp_path: Path) -> None:
    damaged = copy_dcp(uneven_ckpt, tmp_path)
    data = (damaged / ".metadata").read_bytes()
    (damaged / ".metadata").write_bytes(data.replace(b"__0_0.distcp", b"../0_0.distc", 1))
    r = run("verify", damaged)
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {damaged}/.metadata: storage path '../0_0.distc' "
                        "points outside the checkpoint directory; refusing to read it\n")


def test_expect_dtype_exit_1(llama_ckpt: Path) -> None:
    r = run("verify", llama_ckpt, "--expect-dtype", "bf16", "-q")
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert lines[0] == (
        "error: dtype-upcast: tensor 'model.embed_tokens.weight' is F32, wider than the expected "
        "BF16 (--expect-dtype bf16): mixed precision's fp32 copy? ckpttool merge --dtype bf16 "
        "casts it")
    assert lines[10] == "... and 11 more dtype-upcast (all in --json)"
    assert lines[-1].startswith(f"verify FAILED: {llama_ckpt}/pytorch_model_fsdp_0 (and "
                                "optimizer_0): 21 errors")


def test_against_merge_output(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("merge", llama_ckpt, out, "-q").exit_code == 0
    r = run("verify", llama_ckpt, "--against", out)
    assert r.exit_code == 1
    assert "dtype-differs" in r.stdout
    r = run("verify", llama_ckpt, "--against", out, "--allow-cast", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["against"] == {"path": str(out), "checkpoint": str(out), "format": "safetensors"}
    assert [p["code"] for p in doc["problems"] if p["severity"] == "info"][-1] == \
        "tie-deduplicated"
    # One changed byte of the output.
    target = out / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(data)
    r = run("verify", llama_ckpt, "--against", out, "--allow-cast", "-q")
    assert r.exit_code == 1
    assert r.stdout.splitlines()[0].startswith(
        f"error: data-differs: tensor 'model.norm.weight' differs between {llama_ckpt}/"
        f"pytorch_model_fsdp_0 and {out} after casting F32 to BF16: first at element ")


def test_manifest_written_then_checked(uneven_ckpt: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "m.json"
    r = run("verify", uneven_ckpt, "--write-manifest", manifest)
    assert r.exit_code == 0
    assert r.stdout.splitlines()[-1].endswith(f"; manifest written: {manifest}")
    r = run("verify", uneven_ckpt, "--check-manifest", manifest)
    assert r.exit_code == 0
    assert r.stdout.splitlines()[-1].endswith(f"; manifest checked: {manifest}")
    (tmp_path / "junk.json").write_text("{}")
    r = run("verify", uneven_ckpt, "--check-manifest", tmp_path / "junk.json")
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {tmp_path / 'junk.json'}: not a ckpttool manifest; "
                        "pass a file that verify --write-manifest wrote\n")


def test_a_manifest_to_check_must_exist_and_one_to_write_must_not(uneven_ckpt: Path,
                                                                  tmp_path: Path) -> None:
    typo = tmp_path / "typo.json"
    r = run("verify", uneven_ckpt, "--check-manifest", typo)
    assert r.exit_code == 3
    assert r.stderr == (f"ckpttool: error: {typo}: no such manifest to check "
                        "(--check-manifest); write one first with --write-manifest\n")
    assert not typo.exists()
    typo.write_text("precious")
    r = run("verify", uneven_ckpt, "--write-manifest", typo)
    assert r.exit_code == 3 and typo.read_text() == "precious"
    r = run("verify", uneven_ckpt, "--write-manifest", typo, "--check-manifest", typo)
    assert r.exit_code == 2


def test_usage_errors_exit_2(uneven_ckpt: Path, tmp_path: Path) -> None:
    assert run("verify", uneven_ckpt, "--dtype", "bf16").exit_code == 2
    assert run("verify", uneven_ckpt, "--allow-cast").exit_code == 2
    assert run("verify", uneven_ckpt, "--expect-dtype", "keep").exit_code == 2
    assert run("verify").exit_code == 2


def test_missing_path_exit_3(tmp_path: Path) -> None:
    r = run("verify", tmp_path / "nope")
    assert r.exit_code == 3
    assert r.stderr == f"ckpttool: error: {tmp_path / 'nope'}: no such file or directory\n"
