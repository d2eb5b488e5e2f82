"""Issue 20 (trust, round 3) through the CLI: no exit 0 with a wrong or mixed output from
local inputs, hostile content or files that change under a running command."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.storage.store import LOCAL, Stores


def run(*args: str | Path, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


# --------------------------------------------------------------------------------------------
# 1. A loose *.safetensors file in a training directory is never taken as the model


def _training_dir(llama_ckpt: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "checkpoint-500"
    shutil.copytree(llama_ckpt, ckpt)
    return ckpt


def test_loose_safetensors_beside_dcp_is_a_candidate(llama_ckpt: Path, tmp_path: Path) -> None:
    ckpt = _training_dir(llama_ckpt, tmp_path)
    save_file({"w": torch.ones(2)}, ckpt / "ref.safetensors")
    save_file({"step": torch.zeros(())}, ckpt / "ref_optimizer.safetensors")
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert r.stderr == (
        f"ckpttool: error: {ckpt}: holds 2 model checkpoints (pytorch_model_fsdp_0, "
        f"ref.safetensors); pass one of them, e.g. ckpttool merge "
        f"{ckpt / 'pytorch_model_fsdp_0'} OUT\n")
    assert not (tmp_path / "out").exists()
    r = run("inspect", ckpt, "--json")
    parts = {p["path"]: p for p in json.loads(r.stdout)["parts"]}
    assert parts["ref.safetensors"]["kind"] == "model"
    assert parts["ref_optimizer.safetensors"]["kind"] == "optimizer"


def test_two_dcp_models_and_a_loose_file_exit_3(llama_ckpt: Path, tmp_path: Path) -> None:
    ckpt = _training_dir(llama_ckpt, tmp_path)
    shutil.copytree(ckpt / "pytorch_model_fsdp_0", ckpt / "pytorch_model_fsdp_1")
    save_file({"w": torch.ones(2)}, ckpt / "x.safetensors")
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert "holds 3 model checkpoints (pytorch_model_fsdp_0, pytorch_model_fsdp_1, " \
           "x.safetensors)" in r.stderr


def test_adapter_file_beside_dcp_model_merges_the_model(llama_ckpt: Path,
                                                          tmp_path: Path) -> None:
    ckpt = _training_dir(llama_ckpt, tmp_path)
    save_file({"base_model.model.x.lora_A.weight": torch.ones(2, 2)},
              ckpt / "adapter_model.safetensors")
    r = run("merge", "--weights-only", ckpt, tmp_path / "out", "--dtype", "keep")
    assert r.exit_code == 0, r.output
    assert "used pytorch_model_fsdp_0" in r.stdout
    assert run("merge", llama_ckpt, tmp_path / "ref", "--dtype", "keep").exit_code == 0
    got, want = load_file(tmp_path / "out/model.safetensors"), load_file(
        tmp_path / "ref/model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_directory_of_one_safetensors_file_still_merges(tmp_path: Path) -> None:
    src = tmp_path / "weights"
    src.mkdir()
    save_file({"a": torch.arange(4.0)}, src / "weights.safetensors")
    r = run("merge", "--weights-only", src, tmp_path / "out", "--dtype", "keep")
    assert r.exit_code == 0, r.output
    assert torch.equal(load_file(tmp_path / "out/model.safetensors")["a"], torch.arange(4.0))


@pytest.mark.parametrize("loose", ["x.safetensors", "model-00001-of-00003.safetensors"])
def test_shard_set_ignores_unrelated_files(tmp_path: Path, loose: str) -> None:
    src = tmp_path / "shards"
    src.mkdir()
    save_file({"a": torch.ones(2)}, src / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(2)}, src / "model-00002-of-00002.safetensors")
    save_file({"c": torch.ones(2)}, src / loose)
    r = run("merge", "--weights-only", src, tmp_path / "out", "--dtype", "keep")
    assert r.exit_code == 3, r.output


# --------------------------------------------------------------------------------------------
# 6. config.json records the dtype actually written, as save_pretrained does


@pytest.mark.parametrize(("flag", "want"), [("fp32", "float32"), ("fp16", "float16"),
                                            ("keep", "float32"), ("auto", "bfloat16")])
def test_config_dtype_is_the_written_dtype(llama_ckpt: Path, tmp_path: Path, flag: str,
                                           want: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "out"
    r = run("merge", llama_ckpt, out, "--dtype", flag, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (f"dtype: bfloat16 -> {want}" in doc["config_changes"]) == (want != "bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == want
    assert str(AutoConfig.from_pretrained(out).dtype).removeprefix("torch.") == want
    # What save_pretrained writes for the model loaded from OUT says the same dtype.
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert str(model.dtype).removeprefix("torch.") == want
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved/config.json").read_text())["dtype"] == want


def test_config_dtype_change_is_reported(llama_ckpt: Path, tmp_path: Path) -> None:
    r = run("merge", llama_ckpt, tmp_path / "out", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    assert "config.json: dtype: bfloat16 -> float32" in r.stdout


# --------------------------------------------------------------------------------------------
# 7. A URL scheme ckpttool does not read is exit 4, never a local path


@pytest.mark.parametrize("url", ["hf://org/model", "https://host/x", "HTTP://host/x",
                                 "file://x/y"])
def test_unsupported_scheme_as_output_is_exit_4(tiny_dcp: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 url: str) -> None:
    monkeypatch.chdir(tmp_path)
    for cmd in (["merge", tiny_dcp, url], ["reshard", tiny_dcp, url, "--ranks", "1"]):
        r = run(*cmd)
        assert r.exit_code == 4, r.output
        scheme = url.split(":")[0]
        assert r.stderr == (f"ckpttool: error: {url}: {scheme}:// is not a storage ckpttool "
                            "reads or writes (as output); supported: local paths, s3://, "
                            "gs://, az://, abfs://, abfss://\n")
    assert list(tmp_path.iterdir()) == []  # no "hf:" directory


@pytest.mark.parametrize("cmd", ["inspect", "verify", "merge"])
def test_unsupported_scheme_as_source_is_exit_4(tmp_path: Path, cmd: str) -> None:
    args = [cmd, "hf://org/ckpt"] + ([tmp_path / "out"] if cmd == "merge" else [])
    r = run(*args)
    assert r.exit_code == 4, r.output
    assert r.stderr == ("ckpttool: error: hf://org/ckpt: hf:// is not a storage ckpttool "
                        "reads or writes (as source); supported: local paths, s3://, gs://, "
                        "az://, abfs://, abfss://\n")


def test_url_for_a_local_only_option_is_exit_4(tiny_dcp: Path, tmp_path: Path) -> None:
    r = run("merge", "--weights-only", tiny_dcp, tmp_path / "out", "--config", "s3://b/config.json")
    assert r.exit_code == 4, r.output
    assert "s3://b/config.json: --config takes a local path, not a s3:// URL" in r.stderr
    r = run("verify", tiny_dcp, "--against", "https://x/y")
    assert r.exit_code == 4 and "(as source)" in r.stderr


# --------------------------------------------------------------------------------------------
# 4. safetensors header offsets must tile the data area exactly


def shift_tensor(file: Path, by: int = 2) -> str:
    """Move the first tensor of a safetensors file by ``by`` bytes in its header (the same
    header length): it overlaps its neighbour and leaves a gap. Returns its name."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = min((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][0])
    header[name]["data_offsets"] = [o + by for o in header[name]["data_offsets"]]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    file.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n:])
    return name


def test_hf_storage_shard_with_a_shifted_tensor_is_refused(hf_ckpt: Path,
                                                           tmp_path: Path) -> None:
    import safetensors

    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_ckpt, ckpt)
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    name = shift_tensor(shard)
    with pytest.raises(safetensors.SafetensorError):  # the library refuses it too
        load_file(shard)
    r = run("merge", "--weights-only", ckpt, tmp_path / "out", "--dtype", "keep")
    assert r.exit_code == 3, r.output
    assert r.stderr.startswith(f"ckpttool: error: {shard}: tensor ")
    assert "corrupt header (the safetensors library refuses this file too)" in r.stderr
    assert not (tmp_path / "out").exists()
    r = run("verify", ckpt)
    assert r.exit_code in (1, 3) and "corrupt header" in r.output, r.output
    assert name


@pytest.mark.parametrize("edit", ["shift", "trailing"])
def test_safetensors_file_that_does_not_tile_fails_verify(tmp_path: Path, edit: str) -> None:
    src = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(4.0), "b": torch.arange(8.0)}, src)
    if edit == "shift":
        shift_tensor(src)
    else:
        src.write_bytes(src.read_bytes() + b"\0" * 8)
    r = run("verify", src)
    assert r.exit_code == 1, r.output
    assert "corrupt header" in r.output
    r = run("merge", "--weights-only", src, tmp_path / "out")
    assert r.exit_code == 3, r.output


# --------------------------------------------------------------------------------------------
# 5. Manifests hold across the tie de-duplication merge does


def test_manifest_holds_across_a_deduplicated_tie(llama_ckpt: Path, tmp_path: Path) -> None:
    src_manifest, out_manifest = tmp_path / "src.json", tmp_path / "out.json"
    out = tmp_path / "out"
    assert run("verify", llama_ckpt, "--write-manifest", src_manifest).exit_code == 0
    assert run("merge", llama_ckpt, out, "--dtype", "keep", "-q").exit_code == 0
    r = run("verify", out, "--check-manifest", src_manifest, "--json")
    assert r.exit_code == 0, r.output
    codes = [p["code"] for p in json.loads(r.stdout)["problems"]]
    assert "tie-deduplicated" in codes and "manifest-missing" not in codes
    # The other way round: a manifest of the merged output checked against the source.
    assert run("verify", out, "--write-manifest", out_manifest).exit_code == 0
    r = run("verify", llama_ckpt, "--check-manifest", out_manifest)
    assert r.exit_code == 0, r.output
    # A recorded copy that is not identical to its partner is still missing.
    doc = json.loads(src_manifest.read_text())
    doc["tensors"]["lm_head.weight"]["sha256"] = "0" * 64
    src_manifest.write_text(json.dumps(doc))
    r = run("verify", out, "--check-manifest", src_manifest)
    assert r.exit_code == 1
    assert "manifest-missing" in r.output or "not in the checkpoint" in r.output


# --------------------------------------------------------------------------------------------
# 12. Control and bidi characters are escaped in human output; JSON stays exact

HOSTILE = "w\x1b[2J\x1b]0;owned\x07\r\nverify OK\u202e"


def test_hostile_names_are_escaped_for_humans(tmp_path: Path) -> None:
    src = tmp_path / "model.safetensors"
    save_file({HOSTILE: torch.ones(2)}, src)
    shown = "w\\x1b[2J\\x1b]0;owned\\x07\\r\\nverify OK\\u202e"
    for args in (["inspect", src], ["verify", src],
                 ["merge", src, tmp_path / "out", "--weights-only"],
                 ["merge", src, tmp_path / "dry", "--dry-run", "--weights-only"]):
        r = run(*args)
        assert r.exit_code == 0, r.output
        assert shown in r.output or not (args[0] == "inspect" or "--dry-run" in args), args
        assert not any(c in r.output for c in "\x1b\x07\r\u202e"), args
        assert "\nverify OK" not in r.output
    r = run("verify", src, "--expect-dtype", "bf16")  # a problem naming the tensor
    assert r.exit_code == 1 and shown in r.output and "\x1b" not in r.output
    r = run("inspect", src, "--json")
    assert HOSTILE in [t["name"] for t in json.loads(r.stdout)["tensors"]]
    assert load_file(tmp_path / "out/model.safetensors").keys() == {HOSTILE}


def test_hostile_names_are_escaped_in_errors(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"a": torch.ones(2)}, ckpt / "a\x1b[31m.safetensors")
    save_file({"b": torch.ones(2)}, ckpt / "b\u202e.safetensors")
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert "a\\x1b[31m.safetensors" in r.stderr and "b\\u202e.safetensors" in r.stderr
    assert r.stderr.count("\n") == 1 and "\x1b" not in r.stderr


# --------------------------------------------------------------------------------------------
# 8. Files that change under a running command: checked on the opened descriptor


@pytest.fixture(scope="module")
def unflattened(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.all_in_one import write_unflattened

    return write_unflattened(tmp_path_factory.mktemp("unflattened"))


def _swap_after_discovery(monkeypatch: pytest.MonkeyPatch, swap) -> None:  # noqa: ANN001
    """Run ``swap()`` right after the side files are found (discovery), before merge reads
    them: the race an attacker with write access to the checkpoint wins 1 time in 4."""
    from ckpttool.core.checkpoint import hf

    found = hf.find_hf_files

    def then_swap(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        files = found(*args, **kwargs)
        swap()
        return files

    monkeypatch.setattr(hf, "find_hf_files", then_swap)


@pytest.mark.parametrize("swap_to", ["link-out", "fifo", "huge"])
def test_side_file_swapped_after_discovery_is_refused(llama_ckpt: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      swap_to: str) -> None:
    ckpt = _training_dir(llama_ckpt, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    side = ckpt / "tokenizer_config.json"

    def swap() -> None:
        side.unlink()
        if swap_to == "link-out":
            side.symlink_to(secret)
        elif swap_to == "fifo":
            os.mkfifo(side)
        else:
            with open(side, "wb") as f:
                f.truncate(8 << 30)  # sparse

    _swap_after_discovery(monkeypatch, swap)
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert r.stderr.startswith(f"ckpttool: error: {side}: ")
    assert "it changed since the checkpoint was read" in r.stderr
    assert not (tmp_path / "out").exists()


def test_data_file_swapped_for_a_link_before_open_is_refused(tiny_dcp: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """The link is swapped in after every check by name (here: just as it is opened), so
    only a check of the open descriptor sees it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dcp, ckpt)
    victim = sorted(ckpt.glob("*.distcp"))[0]
    outside = tmp_path / "outside.distcp"
    shutil.copy(victim, outside)
    real_open = os.open

    def swapping_open(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if os.fspath(path) == str(victim) and not victim.is_symlink():
            victim.unlink()
            victim.symlink_to(outside)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", swapping_open)
    r = run("merge", "--weights-only", ckpt, tmp_path / "out", "--dtype", "keep")
    monkeypatch.undo()
    assert r.exit_code == 3, r.output
    assert f"{victim}: a link to {outside}, outside the checkpoint directory" in r.stderr


def test_nested_record_that_links_out_is_refused(unflattened: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "plain"
    shutil.copytree(unflattened / "plain", ckpt)
    victim = sorted(ckpt.glob("*.distcp"))[0]
    outside = tmp_path / "outside.distcp"
    shutil.move(victim, outside)
    victim.symlink_to(outside)
    for cmd in (["inspect", ckpt], ["merge", ckpt, tmp_path / "out", "--weights-only"]):
        r = run(*cmd)
        assert r.exit_code == 3, r.output
        assert (f"{victim}: a link to {outside}, outside the checkpoint directory; copy the "
                "file into the checkpoint directory") in r.stderr


# --------------------------------------------------------------------------------------------
# 15. A bounded set of open files: 1,100 ranks under ulimit -n 1024


def _cli(*args: str | Path, nofile: int | None = None, memory: int | None = None
         ) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own (with ``ulimit -n nofile``, ``ulimit -v``)."""

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args)],
                          capture_output=True, text=True, env=env, preexec_fn=limit,
                          timeout=600, check=False)


def test_1100_ranks_merge_and_verify_under_ulimit_1024(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    full = {"w": torch.arange(1100 * 4, dtype=torch.float32).reshape(1100, 4),
            "b": torch.ones(3)}
    save_file(full, src / "model.safetensors")
    ckpt = tmp_path / "ranks"
    r = run("reshard", src, ckpt, "--ranks", "1100", "-q")
    assert r.exit_code == 0, r.output
    assert len(list(ckpt.glob("*.distcp"))) == 1100
    p = _cli("verify", ckpt, nofile=1024)
    assert p.returncode == 0, p.stderr
    p = _cli("merge", "--weights-only", ckpt, tmp_path / "out", "--dtype", "keep", nofile=1024)
    assert p.returncode == 0, p.stderr
    got = load_file(tmp_path / "out/model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in full.items())


# --------------------------------------------------------------------------------------------
# 9. A source cut short under a mapped cast; a killed run's temporary files


@pytest.mark.parametrize("workers", ["1", "2"])
def test_source_cut_short_during_a_mapped_cast_is_one_line(tmp_path: Path, workers: str
                                                          ) -> None:
    """The cast reads on the main thread (1 worker) or on a pool's (2); either way the fault
    becomes the one line from the watchdog (storage.outputs), never exit 135 or a hang."""
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(4 << 20)}, src / "model.safetensors")  # 16 MiB of F32
    out, flag = tmp_path / "out", tmp_path / "mapped"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "CKPTTOOL_TEST_FAULT": f"pause-map:{flag}"}
    proc = subprocess.Popen([sys.executable, "-m", "ckpttool", "merge", str(src), str(out),
                             "--weights-only", "--dtype", "bf16", "--workers", workers], env=env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for _ in range(1200):
        if flag.exists() or proc.poll() is not None:
            break
        time.sleep(0.05)
    assert flag.exists(), proc.communicate()
    os.truncate(src / "model.safetensors", 1 << 20)  # under the mapped window
    flag.unlink()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr  # not 135 (SIGBUS) with no message
    assert stderr == (f"ckpttool: error: {src / 'model.safetensors'}: changed (cut short) "
                      "while it was read; nothing was written. Run again on a checkpoint "
                      "nothing is writing to\n")
    assert not out.exists() or list(out.iterdir()) == []


def test_a_killed_runs_temporary_files_are_named_and_removed(tiny_dcp: Path,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {"CKPTTOOL_TEST_FAULT": "kill:2"}  # killed (-9) after creating its first file
    p = subprocess.run([sys.executable, "-m", "ckpttool", "merge", str(tiny_dcp), str(out),
                        "--weights-only"],
                       env={**os.environ, **env, "PYTHONPATH": str(Path(__file__).resolve()
                                                                   .parents[2])},
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == -9
    left = [q for q in out.iterdir() if q.name.endswith(".ckpttool-tmp")]
    assert left
    p = _cli("merge", "--weights-only", tiny_dcp, out)
    assert p.returncode == 0, p.stderr
    for q in left:
        assert f"ckpttool: warning: {q}: removed a temporary file (" in p.stderr
    assert not [q for q in out.iterdir() if q.name.endswith(".ckpttool-tmp")]


# --------------------------------------------------------------------------------------------
# 14. Dimensions and sizes in .metadata are bounded when parsed


def _metadata_claiming(tiny_dcp: Path, dest: Path, first_dim: int) -> Path:
    """A copy of ``tiny_dcp`` whose .metadata gives its first tensor a first dimension of
    ``first_dim`` (a plain tuple where torch.Size cannot hold it)."""
    import pickle

    shutil.copytree(tiny_dcp, dest)
    md = pickle.loads((dest / ".metadata").read_bytes())  # noqa: S301 - our own fixture
    entry = next(v for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
    rest = tuple(entry.size)[1:]
    entry.size = torch.Size((first_dim, *rest)) if first_dim < 2**63 else (first_dim, *rest)
    (dest / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    return dest


@pytest.mark.parametrize("dim", [10**400, 10**5000, 2**62], ids=["1e400", "1e5000", "2**62"])
def test_huge_dimensions_in_metadata_are_exit_3(tiny_dcp: Path, tmp_path: Path,
                                                dim: int) -> None:
    ckpt = _metadata_claiming(tiny_dcp, tmp_path / "ckpt", dim)
    for args in (["inspect", ckpt], ["inspect", ckpt, "--json"], ["verify", ckpt],
                 ["merge", ckpt, tmp_path / "out", "--weights-only"]):
        r = run(*args)
        assert r.exit_code == 3, (args, r.output)
        assert r.stderr.startswith(f"ckpttool: error: {ckpt / '.metadata'}: ")
        assert r.stderr.endswith("corrupt\n") and r.stderr.count("\n") == 1


# --------------------------------------------------------------------------------------------
# 13. A zstd record that claims far more than its compressed size is refused unread


def test_zstd_record_claiming_a_gibibyte_is_refused_unread(dcp_options: Path,
                                                          tmp_path: Path) -> None:
    import pickle

    ckpt = tmp_path / "zstd"
    shutil.copytree(dcp_options / "zstd", ckpt)
    md = pickle.loads((ckpt / ".metadata").read_bytes())  # noqa: S301 - our own fixture
    entry = md.state_dict_metadata["replicated"]  # one chunk: Replicate()
    claim = torch.Size([1 << 14, 1 << 15])  # bf16: 1 GiB from a few hundred bytes
    entry.size = claim
    entry.chunks[0] = type(entry.chunks[0])(offsets=entry.chunks[0].offsets, sizes=claim)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    for args in (["merge", ckpt, tmp_path / "out", "--weights-only"], ["verify", ckpt]):
        r = run(*args)
        assert r.exit_code in (1, 3), r.output
        assert "refused as a likely decompression bomb" in r.output, r.output
        assert "CKPTTOOL_ZSTD_MAX_RATIO" in r.output
    out = tmp_path / "out"  # no output (hidden files of a resumable run may remain)
    assert not out.exists() or not [p for p in out.iterdir() if not p.name.startswith(".")]


# --------------------------------------------------------------------------------------------
# 16. What a size makes ckpttool allocate is bounded by the file


def test_a_3_5_gib_metadata_is_one_line_under_a_3_gib_limit(tiny_dcp: Path,
                                                           tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dcp, ckpt)
    with open(ckpt / ".metadata", "wb") as f:
        f.truncate(7 << 29)  # sparse; under the 4 GiB cap of a .metadata
    p = _cli("inspect", ckpt, memory=3 << 30)
    assert p.returncode == 3, p.stderr  # not 70 (MemoryError)
    assert p.stderr == (f"ckpttool: error: {ckpt / '.metadata'}: 3,758,096,384 bytes, more "
                        "than this process may hold in memory; a .metadata that large is "
                        "corrupt, or needs a machine with more memory\n")


def test_an_8_gib_metadata_is_refused_by_its_cap_unread(tiny_dcp: Path, tmp_path: Path
                                                        ) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dcp, ckpt)
    with open(ckpt / ".metadata", "wb") as f:
        f.truncate(8 << 30)  # sparse
    p = _cli("inspect", ckpt, memory=3 << 30)
    assert p.returncode == 3, p.stderr
    assert p.stderr == (f"ckpttool: error: {ckpt / '.metadata'}: 8,589,934,592 bytes, more "
                        "than the 4,294,967,296 a DCP .metadata file may hold; it is not the "
                        "writer's file: copy the checkpoint again\n")


def test_a_data_file_name_too_long_for_the_system_is_exit_3(dcp_options: Path,
                                                            tmp_path: Path) -> None:
    """Fuzz campaign 2001, mutant 533: a safetensors-records .metadata naming a 10,000-byte
    file name (ENAMETOOLONG) was exit 70."""
    import dataclasses
    import pickle

    ckpt = tmp_path / "ckpt"
    shutil.copytree(dcp_options / "safetensors", ckpt)
    md = pickle.loads((ckpt / ".metadata").read_bytes())  # noqa: S301 - our own fixture
    idx = next(iter(md.storage_data))
    md.storage_data[idx] = dataclasses.replace(md.storage_data[idx], relative_path="x" * 10000)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    for args, codes in ((["inspect", ckpt], (0, 3)), (["verify", ckpt], (1,)),
                        (["merge", ckpt, tmp_path / "out", "--weights-only"], (3,))):
        r = run(*args)
        assert r.exit_code in codes, (args, r.output)
        assert "Traceback" not in r.output and "internal error" not in r.output


# --------------------------------------------------------------------------------------------
# 3(e). A slice's report lists what that slice wrote; --finish's what it put in place


def _sliced_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.randn(3000, 10), "b": torch.randn(2000, 10), "c": torch.randn(5)},
              src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                 "torch_dtype": "bfloat16"}))
    return src


def test_slice_reports_claim_only_what_each_slice_wrote(tmp_path: Path) -> None:
    src, out = _sliced_source(tmp_path), tmp_path / "out"
    opts = ["--max-shard-size", "100KB", "--dtype", "fp32"]
    shares = []
    for i in range(2):
        r = run("merge", "--weights-only", src, out, "--slice", f"{i}/2", *opts, "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        on_disk = {p.name: p.stat().st_size for p in out.iterdir()}
        # Every file named is one this slice wrote into, and is on disk under that name; no
        # final name (weights, index, config.json) is claimed, nothing is said to be copied.
        assert doc["files"], doc
        for f in doc["files"]:
            assert f["name"] in on_disk and f["name"].endswith(".ckpttool-tmp"), f
        assert not [f for f in doc["files"] if not f["name"].startswith(".")]
        assert doc["copied"] == [] and doc["config_changes"] == []
        shares.append(sum(f["bytes"] - f["header"] for f in doc["files"] if "final" in f))
        assert [f["name"] for f in doc["files"] if "final" not in f] == [
            f".model.s{doc['distributed']['plan']}.{i}-of-2.done.ckpttool-tmp"]
        assert shares[-1] == doc["distributed"]["bytes"][i]
    assert not (out / "model.safetensors.index.json").exists()
    r = run("merge", "--weights-only", src, out, "--finish", *opts, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    names = {f["name"] for f in doc["files"]}
    assert names == {p.name for p in out.iterdir()} - {"config.json"}
    assert doc["copied"] == ["config.json"]
    weights = [f for f in doc["files"] if f["name"].endswith(".safetensors")]
    assert weights and all(f["written_by"] == "slices" for f in weights)
    assert sum(f["bytes"] for f in weights) == sum((out / f["name"]).stat().st_size
                                                   for f in weights)
    # For people: a slice names its temporary files, --finish what it put in place.
    human = tmp_path / "human"
    for i in range(2):
        r = run("merge", "--weights-only", src, human, "--slice", f"{i}/2", *opts)
        assert r.exit_code == 0, r.output
        assert "wrote model-" not in r.stdout and "index.json" not in r.stdout, r.stdout
        assert "copied config.json" not in r.stdout and "config.json:" not in r.stdout
        assert f"wrote .model-00001-of-00002.safetensors.s{doc['distributed']['plan']}" \
            in r.stdout, r.stdout
    r = run("merge", "--weights-only", src, human, "--finish", *opts)
    assert r.exit_code == 0, r.output
    assert "put in place model-00001-of-00002.safetensors" in r.stdout, r.stdout
    assert "wrote model.safetensors.index.json" in r.stdout


# --------------------------------------------------------------------------------------------
# 8, for LoRA: adapter_config.json (and what trainers write instead) is read once, through a
# checked descriptor, and the bytes written are the bytes parsed


def _peft_copy(lora_ckpts: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "peft"
    shutil.copytree(lora_ckpts / "lora", ckpt, ignore=shutil.ignore_patterns("full.pt"))
    return ckpt


def test_adapter_config_swapped_after_it_was_read_is_not_copied(
        lora_ckpts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--lora adapter`` parsed adapter_config.json, then read it again by name to write it:
    a link swapped in between put an outside file into OUT."""
    from ckpttool.core.checkpoint import hf

    ckpt = _peft_copy(lora_ckpts, tmp_path)
    side = ckpt / "adapter_config.json"
    original = side.read_bytes()
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({**json.loads(original), "secret": "outside"}))
    found = hf.find_adapter_config

    def then_swap(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        result = found(*args, **kwargs)
        if not side.is_symlink():
            side.unlink()
            side.symlink_to(secret)
        return result

    monkeypatch.setattr(hf, "find_adapter_config", then_swap)
    r = run("merge", ckpt / "pytorch_model_fsdp_0", tmp_path / "out", "--lora", "adapter")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "adapter_config.json").read_bytes() == original


@pytest.mark.parametrize("swap_to", ["link-out", "fifo", "huge"])
def test_adapter_config_swapped_after_its_check_is_refused(
        lora_ckpts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        swap_to: str) -> None:
    """The check by name said yes; what is opened next is a link out, a FIFO, 8 GB."""
    from ckpttool.core.checkpoint import hf

    ckpt = _peft_copy(lora_ckpts, tmp_path)
    side = ckpt / "adapter_config.json"
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({**json.loads(side.read_bytes()), "secret": "outside"}))
    unsafe = hf._unsafe

    def then_swap(path: Path, roots: list[Path], stores: Stores = LOCAL) -> str | None:
        why = unsafe(path, roots, stores)
        if path == side and why is None and side.is_file() and not side.is_symlink():
            side.unlink()
            if swap_to == "link-out":
                side.symlink_to(secret)
            elif swap_to == "fifo":
                os.mkfifo(side)
            else:
                with open(side, "wb") as f:
                    f.truncate(8 << 30)  # sparse
        return why

    monkeypatch.setattr(hf, "_unsafe", then_swap)
    r = run("merge", ckpt / "pytorch_model_fsdp_0", tmp_path / "out", "--lora", "adapter")
    assert r.exit_code == 3, r.output
    assert r.stderr.startswith(f"ckpttool: error: {side}: "), r.stderr
    assert "it changed since the checkpoint was read" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["adapter_config.json", "lora_train_meta.json"])
def test_trainer_records_read_through_a_checked_descriptor(
        lora_ckpts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A run directory's adapter_config.json (above checkpoint-N) or verl's
    lora_train_meta.json swapped for a link out just as it is opened: refused, as a link
    there always was (never read)."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoint-5"
    shutil.copytree(lora_ckpts / "lora" / "pytorch_model_fsdp_0", ckpt)
    doc = json.loads((lora_ckpts / "lora" / "adapter_config.json").read_text())
    if name == "lora_train_meta.json":
        doc = {"r": doc["r"], "lora_alpha": doc["lora_alpha"], "task_type": "CAUSAL_LM"}
    victim = (run_dir if name == "adapter_config.json" else ckpt) / name
    victim.write_text(json.dumps(doc))
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({**doc, "secret": "outside"}))
    real_open = os.open

    def swapping_open(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if os.fspath(path) == str(victim) and not victim.is_symlink():
            victim.unlink()
            victim.symlink_to(secret)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", swapping_open)
    r = run("merge", ckpt, tmp_path / "out", "--lora", "adapter")
    monkeypatch.undo()
    written = tmp_path / "out" / "adapter_config.json"
    assert not written.exists() or b"secret" not in written.read_bytes(), r.output


# --------------------------------------------------------------------------------------------
# 16. A few bytes edited in a size field: what ckpttool allocates stays bounded by the file


def _baseline_vm_peak(*args: str | Path) -> int:
    """Peak address space of an ordinary run of the CLI (imports, torch included)."""
    code = ("import sys, runpy; sys.argv = ['ckpttool', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('ckpttool', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmPeak')][0])")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                       text=True, env=env, timeout=600, check=False)
    return int(p.stdout.strip().splitlines()[-1].split()[1]) * 1024


def _inflated_torch_save(dest: Path, which: str) -> Path:
    """A torch.save file whose storage's element count (4 bytes in data.pkl), and with
    ``which`` "both" the tensor's shape too, now say 2**31 - 1 (8 GB of float32) where 70,000
    are stored; the archive's CRC-32 fixed to match, so only the sizes lie."""
    import struct
    import zipfile
    import zlib

    dest.mkdir()
    path = dest / "pytorch_model.bin"
    torch.save({"w": torch.ones(70_000), "b": torch.zeros(3)}, path)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    raw = bytearray(path.read_bytes())
    start = raw.index(b"\x80\x02", info.header_offset)  # data.pkl, stored: its PROTO opcode
    field = b"J" + struct.pack("<i", 70_000)
    # The storage's element count comes first (its persistent id), then the shape.
    places = [i for i in range(start, start + info.file_size) if raw.startswith(field, i)]
    assert len(places) == 2
    for at in places[: 2 if which == "both" else 1]:
        raw[at + 1 : at + 5] = struct.pack("<i", 2**31 - 1)
    old_crc = struct.pack("<I", info.CRC)
    new_crc = struct.pack("<I", zlib.crc32(bytes(raw[start : start + info.file_size])))
    assert raw.count(old_crc) == 2  # local header, central directory
    path.write_bytes(bytes(raw).replace(old_crc, new_crc))
    return path


@pytest.mark.parametrize("edit", ["metadata-length", "torch-save-storage", "torch-save-both"])
def test_an_inflated_size_field_stays_under_a_memory_limit(tiny_dcp: Path, tmp_path: Path,
                                                           edit: str) -> None:
    """The "5-byte pickle edit": a record length in .metadata, or a storage's element count
    in a torch.save pickle, made huge. Under an address-space limit 1.5 GB above an ordinary
    run's peak: one line, exit 3 (or 1 from verify), never MemoryError / exit 70."""
    import dataclasses
    import pickle

    if edit == "metadata-length":
        ckpt = tmp_path / "ckpt"
        shutil.copytree(tiny_dcp, ckpt)
        md = pickle.loads((ckpt / ".metadata").read_bytes())  # noqa: S301 - our own fixture
        for idx, info in list(md.storage_data.items()):
            md.storage_data[idx] = dataclasses.replace(info, length=1 << 40)
        (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
        intact = tiny_dcp
    else:
        ckpt = _inflated_torch_save(tmp_path / "ckpt", edit.rsplit("-", 1)[1])
        intact = tmp_path / "intact"
        intact.mkdir()
        torch.save({"w": torch.ones(70_000), "b": torch.zeros(3)}, intact / "pytorch_model.bin")
    limit = _baseline_vm_peak("verify", intact) + (3 << 29)
    assert _cli("verify", intact, memory=limit).returncode == 0  # the limit lets a run work
    for args, codes in ((["inspect", ckpt], (0, 3)), (["verify", ckpt], (1, 3)),
                        (["merge", ckpt, tmp_path / "out", "--weights-only"], (3,))):
        p = _cli(*args, memory=limit)
        assert p.returncode in codes, (args, p.stderr)
        assert "MemoryError" not in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.count("\n") <= 1 or p.returncode == 1, p.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


# --------------------------------------------------------------------------------------------
# 3. Shards put in place without their index (an interrupted --overwrite or --finish) are
# incomplete to verify, never "verify OK"


def test_shards_without_their_index_are_incomplete(tmp_path: Path) -> None:
    src, out = _sliced_source(tmp_path), tmp_path / "out"
    assert run("merge", "--weights-only", src, out, "--max-shard-size", "100KB",
               "-q").exit_code == 0
    (out / "model.safetensors.index.json").unlink()  # what a cut replacement leaves
    r = run("verify", out)
    assert r.exit_code == 1, r.output
    assert "error: index-missing: " in r.output and "2 of 2 shards" in r.output, r.output
    (out / "model-00002-of-00002.safetensors").unlink()
    r = run("verify", out)
    assert r.exit_code == 1, r.output
    assert (f"error: missing-file: {out / 'model-00002-of-00002.safetensors'}: shard 2 of 2 "
            "is missing") in r.output, r.output
    r = run("merge", "--weights-only", out, tmp_path / "again")
    assert r.exit_code == 3 and not (tmp_path / "again").exists(), r.output


def test_two_shard_sets_without_index_say_incomplete_not_many_models(tmp_path: Path) -> None:
    """Shards of two saves (one interrupted before its index) are not "N model checkpoints"
    to pick from: no single shard is a checkpoint. Written by huggingface_hub's own sharded
    save, whose index is then gone as after an interrupted save."""
    from huggingface_hub import save_torch_state_dict

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}
    for shard_size in (2100, 1100):  # 2 shards, then 4 (each save removes the other's)
        save = tmp_path / f"save-{shard_size}"
        save.mkdir()
        save_torch_state_dict(state, save, max_shard_size=shard_size)
        for shard in save.glob("*.safetensors"):
            shutil.copy(shard, ckpt)  # both saves' shards, neither's index
    (ckpt / "model-00004-of-00004.safetensors").unlink()
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert r.stderr.startswith(
        f"ckpttool: error: {ckpt}: holds shards of 2 sets: model-*-of-00002 (2 of 2), "
        "model-*-of-00004 (3 of 4) and no index")
    assert r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()
