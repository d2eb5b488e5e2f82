"""merge, checked bit for bit against PyTorch's own DCP loader on real checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from safetensors import safe_open

import ckpttool
from ckpttool.core.merge import engine as merge_mod
from ckpttool.errors import InputError, OutputError
from ckpttool.formats.dcp import reader as dcp
from ckpttool.storage import outputs as fileio
from tests.helpers import assert_bit_exact, expected, load_out
from tests.reference import reference_state_dict

KINDS = ("llama", "uneven", "wrappers", "mixed", "placements")


@pytest.mark.parametrize("kind", KINDS)
def test_keep_is_bit_exact(kind: str, make_checkpoint, tmp_path: Path) -> None:
    ckpt = make_checkpoint(kind)
    report = ckpttool.merge(ckpt, tmp_path / "out", dtype="keep", keep_tied=True, weights_only=True)
    dcp_dir = Path(report.checkpoint)
    assert_bit_exact(load_out(tmp_path / "out"), expected(dcp_dir, None))
    assert report.num_tensors == len(dcp.read_info(dcp_dir).tensors)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", ["bf16", "fp16", "fp32"])
def test_cast_is_bit_exact_and_spares_float8_and_integers(
    kind: str, target: str, make_checkpoint, tmp_path: Path
) -> None:
    ckpt = make_checkpoint(kind)
    report = ckpttool.merge(ckpt, tmp_path / "out", dtype=target, keep_tied=True, workers=2,
                            weights_only=True)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[target]
    assert_bit_exact(load_out(tmp_path / "out"), expected(Path(report.checkpoint), torch_dtype),
                     cast=True)


def test_mixed_has_every_dtype_and_reports_non_tensor_entries(mixed_ckpt: Path,
                                                              tmp_path: Path) -> None:
    report = ckpttool.merge(mixed_ckpt, tmp_path / "out", dtype="bf16", weights_only=True)
    got = load_out(tmp_path / "out")
    dtypes_seen = {t.dtype for t in got.values()}
    assert {torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.int64} <= dtypes_seen
    assert torch.float32 not in dtypes_seen and torch.float64 not in dtypes_seen
    entries = {o.name: o for o in report.non_tensor}
    assert entries["step"].to_json() == {"name": "step", "readable": True, "value": 500,
                                        "part": "train_state"}
    assert entries["meta.run"].value == "demo"
    opaque = entries["opaque"]
    assert not opaque.readable
    assert "OpaqueThing" in opaque.note and "not executed" in opaque.note
    assert report.bytes_before["F32"] > 0 and "F32" not in report.bytes_after
    assert report.bytes_after["F8_E4M3"] == report.bytes_before["F8_E4M3"]


def test_llama_auto_dedupes_tie_casts_and_copies_hf_files(llama_ckpt: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = ckpttool.merge(llama_ckpt, out)
    assert report.checkpoint == str(llama_ckpt / "pytorch_model_fsdp_0")
    assert [(s.path, s.kind) for s in report.skipped] == [(str(llama_ckpt / "optimizer_0"),
                                                            "optimizer")]
    assert report.dtype.target == "BF16" and "bfloat16" in report.dtype.source
    assert report.tie is not None and report.tie.action == "deduplicated"
    got = load_out(out)
    want = expected(llama_ckpt / "pytorch_model_fsdp_0", torch.bfloat16)
    del want["lm_head.weight"]
    assert_bit_exact(got, want)
    assert "config.json" in report.copied and "tokenizer_config.json" in report.copied
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert report.config_changes == ["architectures: FSDPLlamaForCausalLM -> LlamaForCausalLM"]
    assert not any(p.name.endswith(fileio.TMP_SUFFIX) for p in out.iterdir())


def test_a_config_given_under_any_name_is_the_one_written(llama_ckpt: Path,
                                                         tmp_path: Path) -> None:
    # --config names a file not called config.json, while a config.json lies beside the
    # checkpoint: the output's config.json is the one given (used for the checks too).
    found = ckpttool.merge(llama_ckpt, tmp_path / "first", dry_run=True).config
    assert found is not None
    given = json.loads(Path(found.path).read_text()) | {"ckpttool_test_marker": 7}
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "elsewhere" / "llama-7b.json"
    path.write_text(json.dumps(given))
    out = tmp_path / "out"
    report = ckpttool.merge(llama_ckpt, out, config=path)
    assert "config.json" in report.copied and "llama-7b.json" not in report.copied
    assert not (out / "llama-7b.json").exists()
    assert json.loads((out / "config.json").read_text())["ckpttool_test_marker"] == 7


def test_llama_loads_in_transformers_with_the_same_logits(llama_ckpt: Path,
                                                          tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ckpttool.merge(llama_ckpt, tmp_path / "out")
    reference = torch.load(llama_ckpt / "reference.pt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    # Weights were saved as bf16 values in fp32, so the bf16 output loses nothing.
    assert torch.equal(logits, reference["logits"])


def test_keep_tied_writes_both(llama_ckpt: Path, tmp_path: Path) -> None:
    report = ckpttool.merge(llama_ckpt, tmp_path / "out", keep_tied=True)
    assert "lm_head.weight" in load_out(tmp_path / "out")
    assert report.tie is not None and report.tie.identical is True


def test_broken_tie_writes_both_and_warns(llama_ckpt: Path, tmp_path: Path) -> None:
    src = llama_ckpt / "pytorch_model_fsdp_0"
    state = reference_state_dict(src)
    state["model.lm_head.weight"] = state["model.lm_head.weight"] + 1  # the tie broke in training
    broken = tmp_path / "broken"
    model_sd = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    torch_dcp.save({"model": model_sd}, checkpoint_id=broken / "pytorch_model_fsdp_0")
    shutil.copy(llama_ckpt / "config.json", broken / "config.json")
    report = ckpttool.merge(broken, tmp_path / "out")
    assert report.tie is not None and report.tie.identical is False
    assert report.tie.action == "both written"
    assert any(w.startswith("tie broken") for w in report.warnings)
    got = load_out(tmp_path / "out")
    assert torch.equal(got["lm_head.weight"], state["model.lm_head.weight"].to(torch.bfloat16))


def test_wrapper_segments_are_removed_and_reported(wrappers_ckpt: Path, tmp_path: Path) -> None:
    report = ckpttool.merge(wrappers_ckpt, tmp_path / "out", weights_only=True)
    names = set(load_out(tmp_path / "out"))
    assert not any(seg in n for n in names
                   for seg in ("_orig_mod", "_checkpoint_wrapped_module", "model."))
    froms = {r.stored for r in report.renames}
    assert any("_orig_mod." in f for f in froms)
    assert any("._checkpoint_wrapped_module" in f for f in froms)


def test_flat_checkpoint_keeps_model_prefix(placements_ckpt: Path, tmp_path: Path) -> None:
    report = ckpttool.merge(placements_ckpt, tmp_path / "out", weights_only=True)
    names = set(load_out(tmp_path / "out"))
    assert names and all(n.startswith("model.") for n in names)
    assert report.renames == []


def test_sharded_output_has_index_and_loads(llama_ckpt: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    report = ckpttool.merge(llama_ckpt, out, max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    got = load_out(out)
    assert set(index["weight_map"]) == set(got)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in got.values())
    assert report.files[-1].name == "model.safetensors.index.json"
    AutoModelForCausalLM.from_pretrained(out)


def test_output_permissions_follow_umask(uneven_ckpt: Path, tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        ckpttool.merge(uneven_ckpt, tmp_path / "out", weights_only=True)
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "out" / "model.safetensors").stat().st_mode)
    assert mode == 0o640


def test_existing_output_needs_overwrite_and_stale_shards_go(llama_ckpt: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckpttool.merge(llama_ckpt, out, max_shard_size="20KB")
    before = (out / "model.safetensors.index.json").read_bytes()
    with pytest.raises(OutputError, match="already holds"):
        ckpttool.merge(llama_ckpt, out)
    assert (out / "model.safetensors.index.json").read_bytes() == before
    ckpttool.merge(llama_ckpt, out, overwrite=True)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


@pytest.mark.parametrize("windows", [False, True])
def test_interrupted_merge_leaves_nothing_that_looks_finished(
    windows: bool, uneven_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def interrupted(*args: object) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(*args)  # type: ignore[arg-type]

    if windows:  # small tensors made whole in memory, written with pwrite
        real = merge_mod.pwrite_all
        monkeypatch.setattr("ckpttool.core.merge.engine.pwrite_all", interrupted)
    else:  # every chunk its own copy, in the kernel
        monkeypatch.setattr("ckpttool.core.merge.engine.WINDOW_TENSOR", 0)
        real = fileio.copy_range
        monkeypatch.setattr("ckpttool.storage.outputs.copy_range", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(uneven_ckpt, out, workers=1, weights_only=True)
    assert list(out.iterdir()) == []


def test_chunk_missing_from_storage_is_an_input_error(uneven_ckpt: Path, tmp_path: Path) -> None:
    src = uneven_ckpt / "pytorch_model_fsdp_0"
    damaged = tmp_path / "damaged"
    shutil.copytree(src, damaged)
    # Drop the file of the last rank: its chunks are gone.
    victim = sorted(damaged.glob("*.distcp"))[-1]
    victim.unlink()
    with pytest.raises(InputError, match=f"{victim.name}: data file is missing"):
        ckpttool.merge(damaged, tmp_path / "out", weights_only=True)
    assert not (tmp_path / "out").exists()


# Mapped: every range cast straight from the page cache, in windows that start anywhere in a
# page (the fixtures' ranges are all below the size that is mapped by default).
@pytest.mark.parametrize(("windows", "mapped"), [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("kind", ["llama", "mixed"])
def test_cast_in_many_small_blocks_is_exact(kind: str, windows: bool, mapped: bool,
                                            make_checkpoint, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckpttool.core.merge.engine.CAST_BLOCK", 64)  # 8 to 64 elements a block
    if not windows:  # else small tensors are cast whole, in memory
        monkeypatch.setattr("ckpttool.core.merge.engine.WINDOW_TENSOR", 0)
    monkeypatch.setattr("ckpttool.storage.store.MAP_MIN", 0 if mapped else 1 << 62)
    report = ckpttool.merge(make_checkpoint(kind), tmp_path / "out", dtype="bf16",
                            keep_tied=True, workers=3, weights_only=True)
    assert_bit_exact(load_out(tmp_path / "out"), expected(Path(report.checkpoint), torch.bfloat16),
                     cast=True)


def test_tie_check_compares_in_small_blocks(llama_ckpt: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckpttool.core.ties.COMPARE_BLOCK", 40)  # a few elements per block
    report = ckpttool.merge(llama_ckpt, tmp_path / "out")
    assert report.tie is not None and report.tie.action == "deduplicated"


def test_optimizer_state_merges_to_safetensors_and_json(llama_ckpt: Path, tmp_path: Path) -> None:
    src = llama_ckpt / "optimizer_0"
    report = ckpttool.merge(src, tmp_path / "out")
    assert report.kind == "optimizer" and report.dtype.target is None
    assert [f.name for f in report.files] == ["optimizer.safetensors", "optimizer.json"]
    got = load_out_optimizer(tmp_path / "out")
    ref = reference_state_dict(src)
    want = {k.removeprefix("optimizer."): v for k, v in ref.items()
            if isinstance(v, torch.Tensor)}
    assert "state.model.layers.0.mlp.up_proj.weight.exp_avg" in got
    assert_bit_exact(got, want)
    doc = json.loads((tmp_path / "out" / "optimizer.json").read_text())
    group = doc["param_groups"][0]
    assert group["lr"] == ref["optimizer.param_groups.0.lr"]
    assert group["betas"] == list(ref["optimizer.param_groups.0.betas"])
    assert group["params"][0] == "model.embed_tokens.weight"


def load_out_optimizer(out: Path) -> dict[str, torch.Tensor]:
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_interrupt_with_workers_stops_queued_jobs(llama_ckpt: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real_copy_range = fileio.copy_range
    calls = []

    def interrupted(*args: object) -> None:
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        time.sleep(0.05)  # the other worker's chunks take a moment, as real ones do
        real_copy_range(*args)  # type: ignore[arg-type]

    monkeypatch.setattr("ckpttool.storage.outputs.copy_range", interrupted)
    # The fixture's chunks are small, which alone would make the merge single-threaded, and
    # its tensors too, which would put them in windows (whole tensors, written by pwrite).
    monkeypatch.setattr("ckpttool.core.runtime.torch_threads.THREADED_CHUNK", 0)
    monkeypatch.setattr("ckpttool.core.merge.engine.WINDOW_TENSOR", 0)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(llama_ckpt, out, dtype="keep", keep_tied=True, workers=2)
    info = dcp.read_info(llama_ckpt / "pytorch_model_fsdp_0")
    num_jobs = sum(1 for t in info.tensors for c in t.chunks if c.numel)
    assert num_jobs > 20
    assert len(calls) < num_jobs // 2  # the queue was dropped, not drained (num_jobs calls)
    assert list(out.iterdir()) == []


def test_overwrite_only_replaces_files_of_the_same_kind(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckpttool.merge(llama_ckpt / "optimizer_0", out)
    ckpttool.merge(llama_ckpt, out)  # a model beside optimizer state is no conflict
    ckpttool.merge(llama_ckpt, out, overwrite=True, max_shard_size="20KB")
    names = {p.name for p in out.iterdir()}
    assert {"optimizer.safetensors", "optimizer.json", "model.safetensors.index.json"} <= names
    assert "model.safetensors" not in names  # the stale single file went before the index came


def test_overwrite_never_writes_through_a_planted_link(uneven_ckpt: Path, tmp_path: Path) -> None:
    import os

    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (out / f".model.safetensors.{os.getpid()}{fileio.TMP_SUFFIX}").symlink_to(victim)
    ckpttool.merge(uneven_ckpt, out, weights_only=True)
    assert victim.read_bytes() == b"keep me"


def test_a_directory_at_an_output_name_is_refused_even_with_overwrite(
        uneven_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "model.safetensors.index.json").mkdir(parents=True)
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="is not a regular file"):
            ckpttool.merge(uneven_ckpt, out, overwrite=overwrite, weights_only=True)
    assert [p.name for p in out.iterdir()] == ["model.safetensors.index.json"]


def test_concurrent_casting_merges_restore_torch_threads(llama_ckpt: Path, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    before = torch.get_num_threads()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: ckpttool.merge(llama_ckpt, tmp_path / f"o{i}", dtype="fp16"),
                      range(4)))
    assert torch.get_num_threads() == before


def test_a_checkpoint_without_tensors_is_an_error_not_an_empty_model(tmp_path: Path) -> None:
    torch_dcp.save({"step": 5, "note": "no weights"}, checkpoint_id=tmp_path / "ckpt")
    with pytest.raises(InputError, match=r"holds no tensors \(only 2 non-tensor entries\); there "
                       "is no model to merge"):
        ckpttool.merge(tmp_path / "ckpt", tmp_path / "out", weights_only=True)
    assert not (tmp_path / "out").exists()


def test_side_files_that_lead_outside_or_block_are_not_copied(llama_ckpt: Path,
                                                              tmp_path: Path) -> None:
    ckpt = Path(shutil.copytree(llama_ckpt, tmp_path / "ckpt"))
    secret = tmp_path / "secret.txt"
    secret.write_text("TOKEN=hunter2\n")
    (ckpt / "tokenizer.json").symlink_to(secret)
    (ckpt / "vocab.txt").symlink_to("/proc/self/environ")
    os.mkfifo(ckpt / "merges.txt")
    with open(ckpt / "chat_template.jinja", "wb") as f:  # sparse: no disk, 1 GB apparent
        f.truncate(1 << 30)
    inside = ckpt / "pytorch_model_fsdp_0" / "added_tokens.json"
    inside.write_text("{}")
    (ckpt / "added_tokens.json").symlink_to(inside)  # a link inside: fine
    report = ckpttool.merge(ckpt, tmp_path / "out")
    out = tmp_path / "out"
    for name in ("tokenizer.json", "vocab.txt", "merges.txt", "chat_template.jinja"):
        assert not (out / name).exists(), name
        assert any(name in w and "not copied" in w for w in report.warnings), name
    assert (out / "added_tokens.json").read_text() == "{}"
    assert "hunter2" not in "".join(p.read_text(errors="replace") for p in out.iterdir()
                                    if p.suffix != ".safetensors")


@pytest.mark.parametrize(("name", "why"), [("__metadata__", "the header's metadata key"),
                                           ("w\ud800", "not valid Unicode")])
def test_names_a_safetensors_file_cannot_carry_are_refused(name: str, why: str,
                                                            tmp_path: Path) -> None:
    torch_dcp.save({name: torch.ones(2), "ok": torch.zeros(2)}, checkpoint_id=tmp_path / "ckpt",
                   no_dist=True)
    with pytest.raises(InputError, match=why):
        ckpttool.merge(tmp_path / "ckpt", tmp_path / "out", dtype="keep", weights_only=True)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_casting_needs_no_numpy(uneven_ckpt: Path, tmp_path: Path) -> None:
    """torch without numpy (a user's own torch install) still casts."""
    code = ("import sys\nsys.modules['numpy'] = None  # import numpy fails, as without it\n"
            "import ckpttool\n"
            f"ckpttool.merge({str(uneven_ckpt)!r}, {str(tmp_path / 'a')!r}, dtype='bf16', "
            "weights_only=True)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    ckpttool.merge(uneven_ckpt, tmp_path / "b", dtype="bf16", weights_only=True)
    assert ((tmp_path / "a" / "model.safetensors").read_bytes()
            == (tmp_path / "b" / "model.safetensors").read_bytes())


def test_side_files_reached_through_a_linked_directory_or_up_the_tree(llama_ckpt: Path,
                                                                      tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text("aws_secret=1")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "tokenizer.json").write_text('{"stolen": true}')
    ckpt = Path(shutil.copytree(llama_ckpt, home / "ckpt"))
    (ckpt / "tokenizer.model").symlink_to("../.aws/credentials")
    (ckpt / "pytorch_model_fsdp_0" / "huggingface").symlink_to(outside)
    report = ckpttool.merge(ckpt / "pytorch_model_fsdp_0", tmp_path / "out")
    assert not (tmp_path / "out" / "tokenizer.model").exists()
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert sum("not copied" in w for w in report.warnings) == 2


def test_written_bytes_are_synced_as_they_go(uneven_ckpt: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Early syncs every few bytes (fileio.write_behind) leave the output as it would be."""
    monkeypatch.setattr("ckpttool.storage.outputs.WRITE_BEHIND", 64)
    monkeypatch.delenv("CKPTTOOL_FSYNC", raising=False)
    for dtype in ("keep", "bf16"):
        report = ckpttool.merge(uneven_ckpt, tmp_path / dtype, dtype=dtype, workers=2,
                                weights_only=True)
        cast = torch.bfloat16 if dtype == "bf16" else None
        assert_bit_exact(load_out(tmp_path / dtype), expected(Path(report.checkpoint), cast),
                         cast=cast is not None)


def test_a_failed_early_sync_is_an_output_error(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of a sync made while writing is reported (a later fsync of the same file
    might not report it again), never swallowed."""
    monkeypatch.delenv("CKPTTOOL_FSYNC", raising=False)
    read, write = os.pipe()  # fdatasync of a pipe fails (EINVAL)
    try:
        with pytest.raises(OutputError, match="writing the output failed"), \
                fileio.write_behind([write], lambda n: None) as report:
            report(fileio.WRITE_BEHIND)  # asks for a sync, made before the block ends
    finally:
        os.close(read)
        os.close(write)
