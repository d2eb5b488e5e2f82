"""``diff``, ``--write-delta`` and ``apply`` across formats: a DCP checkpoint written by real
FSDP2 ranks against its merge, DeepSpeed ZeRO against its merge, safetensors files changed
sparsely and densely (changes made with torch, the expected figures computed with torch), ties
stored once on one side, statuses of every kind, apply on the right and the wrong base, and
``verify --base``."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpttool
from ckpttool.core.diff import apply as apply_module
from ckpttool.core.diff import delta as delta_module
from ckpttool.core.diff import operation
from ckpttool.errors import InputError, OutputError
from tests import ds_layouts

MODEL = "pytorch_model_fsdp_0"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(bits(a[k]), bits(b[k])), k


@pytest.fixture(scope="session")
def llama_keep(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama DCP checkpoint merged as stored (fp32; lm_head.weight written once)."""
    out = tmp_path_factory.mktemp("diff") / "keep"
    ckpttool.merge(llama_ckpt, out, dtype="keep")
    return out


def write(path: Path, state: dict[str, torch.Tensor], *, tie: bool | None = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    if tie is not None:
        (path / "config.json").write_text(json.dumps({"tie_word_embeddings": tie}))
    return path


def changed_copy(keep: Path, out: Path) -> dict[str, torch.Tensor]:
    """B: the merged llama with one of each kind of change."""
    sd = load_file(keep / "model.safetensors")
    b = {k: v.clone() for k, v in sd.items()}
    b["model.layers.0.self_attn.q_proj.weight"][3, 5] += 0.25  # sparse: one element
    b["model.layers.1.mlp.up_proj.weight"] += 1.0  # dense: every element
    del b["model.layers.1.post_attention_layernorm.weight"]  # removed
    b["extra.bias"] = torch.arange(7, dtype=torch.float32)  # added
    b["model.norm.weight"] = sd["model.norm.weight"].reshape(2, -1).clone()  # reshaped
    b["model.layers.0.input_layernorm.weight"] = sd[
        "model.layers.0.input_layernorm.weight"].to(torch.bfloat16)  # dtype-changed
    write(out, b)
    return b


def rows(report: ckpttool.DiffReport) -> dict[str, operation.TensorDiff]:
    return {t.name: t for t in report.tensors}


# -- identical across formats


def test_dcp_against_its_merge_is_identical_with_the_tie_stored_once(
        llama_ckpt: Path, llama_keep: Path) -> None:
    report = ckpttool.diff(llama_ckpt, llama_keep, workers=2)
    assert report.identical and report.format_a == "dcp" and report.format_b == "safetensors"
    assert report.summary is not None and report.summary.identical == len(report.tensors) == 21
    assert [(t.name, t.partner, t.side) for t in report.tied] == [
        ("lm_head.weight", "model.embed_tokens.weight", "b")]
    assert rows(report)["lm_head.weight"].status == "identical"
    back = ckpttool.diff(llama_keep, llama_ckpt)
    assert back.identical and back.tied[0].side == "a"


def test_a_bf16_merge_is_dtype_changed_everywhere(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    ckpttool.merge(llama_ckpt, out, dtype="bf16")
    report = ckpttool.diff(llama_ckpt, out)
    assert not report.identical
    assert {t.status for t in report.tensors} == {"dtype-changed"}
    assert all(t.changed_elements is None and t.rel_l2 is None for t in report.tensors)


# -- every status, with torch's figures


def test_statuses_counts_and_sizes(llama_ckpt: Path, llama_keep: Path, tmp_path: Path) -> None:
    b = changed_copy(llama_keep, tmp_path / "b")
    a = load_file(llama_keep / "model.safetensors")
    report = ckpttool.diff(llama_ckpt, tmp_path / "b")
    got = rows(report)
    assert not report.identical
    q = "model.layers.0.self_attn.q_proj.weight"
    assert got[q].status == "changed" and got[q].changed_elements == 1
    d = (b[q].double() - a[q].double())
    assert got[q].max_abs_diff == pytest.approx(float(d.abs().max()), rel=1e-12)
    assert got[q].rel_l2 == pytest.approx(float(d.norm() / a[q].double().norm()), rel=2e-6)
    up = "model.layers.1.mlp.up_proj.weight"
    changed = int((bits(b[up]).view(torch.int32) != bits(a[up]).view(torch.int32)).sum())
    assert got[up].changed_elements == changed > a[up].numel() // 2
    d = b[up].double() - a[up].double()
    assert got[up].rel_l2 == pytest.approx(float(d.norm() / a[up].double().norm()), rel=2e-6)
    assert got["model.layers.1.post_attention_layernorm.weight"].status == "removed"
    assert got["extra.bias"].status == "added"
    assert got["model.norm.weight"].status == "reshaped"
    assert got["model.layers.0.input_layernorm.weight"].status == "dtype-changed"
    assert got["lm_head.weight"].status == "identical"  # stored once in both A's merge and B
    s = report.summary
    assert s is not None
    assert (s.changed, s.added, s.removed, s.reshaped, s.dtype_changed) == (2, 1, 1, 1, 1)
    assert s.bytes_changed == (1 + changed) * 4 + 7 * 4 + b["model.norm.weight"].nbytes + \
        b["model.layers.0.input_layernorm.weight"].nbytes
    doc = report.to_json()
    assert doc["command"] == "diff" and doc["schema"] == 1
    assert set(doc["tensors"][0]) == {"name", "status", "changed_elements", "max_abs_diff",
                                      "rel_l2"}
    assert doc["summary"]["dtype-changed"] == 1


def test_filter_compares_only_matching_names(llama_ckpt: Path, llama_keep: Path,
                                             tmp_path: Path) -> None:
    changed_copy(llama_keep, tmp_path / "b")
    report = ckpttool.diff(llama_ckpt, tmp_path / "b", filter="*layers.0.self_attn*")
    assert sorted(rows(report)) == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "koqv"]
    assert report.filter == "*layers.0.self_attn*" and not report.identical
    with pytest.raises(InputError, match="leave out one of --filter and --write-delta"):
        ckpttool.diff(llama_ckpt, tmp_path / "b", filter="*", write_delta=tmp_path / "d")


def test_identity_is_bitwise_nan_payloads_and_negative_zero(tmp_path: Path) -> None:
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0])
    b = a.clone()
    b[0] = -0.0  # equal as numbers
    b.view(torch.int32)[2] ^= 1  # another NaN
    write(tmp_path / "a", {"w": a}, tie=None)
    write(tmp_path / "b", {"w": b}, tie=None)
    r = rows(ckpttool.diff(tmp_path / "a", tmp_path / "b"))["w"]
    assert (r.status, r.changed_elements, r.max_abs_diff, r.rel_l2) == ("changed", 2, 0.0, 0.0)


def test_changes_found_in_any_block_with_a_norm_over_all_of_a(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks of 64 bytes: the first change in the fifth block, A's norm over all eight.
    # (float32 sums: the norm to about 1e-6)
    monkeypatch.setattr(operation, "BLOCK_BYTES", 64)
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int32,
                  torch.float8_e4m3fn):
        a = (torch.randn(128, generator=g) * 4).to(dtype)
        b = a.clone()
        b[70] = (a[70].float() + 1).to(dtype)
        b[127] = (a[127].float() - 2).to(dtype)
        write(tmp_path / "a", {"w": a}, tie=None)
        write(tmp_path / "b", {"w": b}, tie=None)
        r = rows(ckpttool.diff(tmp_path / "a", tmp_path / "b"))["w"]
        d = b.double() - a.double()
        assert r.changed_elements == int((d != 0).sum()), dtype
        assert r.max_abs_diff == pytest.approx(float(d.abs().max())), dtype
        assert r.rel_l2 == pytest.approx(float(d.norm() / a.double().norm()), rel=2e-6), dtype


def test_a_tie_against_an_untied_config_is_removed(tmp_path: Path) -> None:
    e = torch.randn(8, 4)
    write(tmp_path / "a", {"lm_head.weight": e.clone(), "model.embed_tokens.weight": e})
    write(tmp_path / "b", {"model.embed_tokens.weight": e}, tie=False)
    got = rows(ckpttool.diff(tmp_path / "a", tmp_path / "b"))
    assert got["lm_head.weight"].status == "removed"
    write(tmp_path / "c", {"model.embed_tokens.weight": e}, tie=True)
    report = ckpttool.diff(tmp_path / "a", tmp_path / "c")
    assert report.identical and len(report.tied) == 1
    # A's lm_head differs from its own embedding: B's tie makes it B's embedding, a change.
    write(tmp_path / "d", {"lm_head.weight": e + 1, "model.embed_tokens.weight": e})
    assert rows(ckpttool.diff(tmp_path / "d", tmp_path / "c"))["lm_head.weight"] \
        .changed_elements == e.numel()


# -- deltas and apply


def test_delta_rebuilds_b_from_the_dcp_bit_for_bit(llama_ckpt: Path, llama_keep: Path,
                                                   tmp_path: Path) -> None:
    b = changed_copy(llama_keep, tmp_path / "b")
    d = tmp_path / "delta"
    report = ckpttool.diff(llama_ckpt, tmp_path / "b", write_delta=d)
    doc = json.loads((d / "delta.json").read_text())
    how = {k: v["how"] for k, v in doc["tensors"].items()}
    assert how["model.layers.0.self_attn.q_proj.weight"] == "sparse"
    assert how["model.layers.1.mlp.up_proj.weight"] == "whole"
    assert how["extra.bias"] == how["model.norm.weight"] == "whole"
    assert how["model.embed_tokens.weight"] == "base"
    assert "lm_head.weight" not in how  # B stores it once
    assert doc["a"]["kind"] == doc["b"]["kind"] == "ckpttool-manifest"
    assert "lm_head.weight" in doc["a"]["tensors"]  # A (the DCP) stores both
    assert sorted(doc["files"]) == ["config.json"] and (d / "config.json").is_file()
    delta = load_file(d / "delta.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert delta[q + ":indices"].tolist() == [3 * 32 + 5]
    assert torch.equal(delta[q + ":values"], b[q].flatten()[[3 * 32 + 5]])
    assert report.delta is not None and report.delta.sparse == 1
    # The manifests are verify's: B checks against its record.
    (tmp_path / "b.manifest.json").write_text(json.dumps(doc["b"]))
    assert ckpttool.verify(tmp_path / "b", manifest=tmp_path / "b.manifest.json",
                           manifest_action="check").ok

    for base in (llama_ckpt, llama_keep):  # the DCP itself, or its merge: the same tensors
        out = tmp_path / f"out-{base.name}"
        applied = ckpttool.apply(base, d, out)
        same_bits(load_file(out / "model.safetensors"), b)
        assert applied.sparse == 1 and (out / "config.json").read_bytes() == (
            tmp_path / "b" / "config.json").read_bytes()
        assert ckpttool.diff(tmp_path / "b", out).identical


def test_apply_on_the_wrong_base_names_the_first_tensor(llama_keep: Path,
                                                        tmp_path: Path) -> None:
    changed_copy(llama_keep, tmp_path / "b")
    ckpttool.diff(llama_keep, tmp_path / "b", write_delta=tmp_path / "d")
    sd = load_file(llama_keep / "model.safetensors")
    sd["model.layers.1.self_attn.k_proj.weight"][0, 0] += 1
    sd["model.norm.weight"][0] += 1
    write(tmp_path / "wrong", sd)
    with pytest.raises(InputError, match=r"is not the checkpoint the delta was made from "
                       r"\(tensor 'model.layers.1.self_attn.k_proj.weight': SHA-256"):
        ckpttool.apply(tmp_path / "wrong", tmp_path / "d", tmp_path / "out")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    with pytest.raises(InputError, match="is not the checkpoint the delta was made from"):
        ckpttool.apply(tmp_path / "b", tmp_path / "d", tmp_path / "out")


def test_a_damaged_delta_publishes_nothing(llama_keep: Path, tmp_path: Path) -> None:
    changed_copy(llama_keep, tmp_path / "b")
    ckpttool.diff(llama_keep, tmp_path / "b", write_delta=tmp_path / "d")
    data = tmp_path / "d" / "delta.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # the last tensor's last byte
    data.write_bytes(bytes(raw))
    with pytest.raises(InputError, match="does not match the SHA-256 the delta records for B"):
        ckpttool.apply(llama_keep, tmp_path / "d", tmp_path / "out")
    assert not list((tmp_path / "out").glob("*"))
    (tmp_path / "d" / "delta.json").write_text("{}")
    with pytest.raises(InputError, match="not a ckpttool delta"):
        ckpttool.apply(llama_keep, tmp_path / "d", tmp_path / "out")


def test_delta_and_apply_in_small_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    # Blocks of 40 elements and patches read 3 at a time: changes cross both.
    for module, name, value in ((operation, "BLOCK_BYTES", 160), (delta_module, "BLOCK_BYTES",
                                160), (apply_module, "BLOCK_BYTES", 160),
                                (apply_module, "PATCH_STEP", 3)):
        monkeypatch.setattr(module, name, value)
    a = torch.randn(1000, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    b = a.clone()
    where = [0, 39, 40, 41, 79, 500, 501, 998, 999]
    b[where] += 1
    write(tmp_path / "a", {"w": a, "same": a[:10].clone()}, tie=None)
    write(tmp_path / "b", {"w": b, "same": a[:10].clone()}, tie=None)
    ckpttool.diff(tmp_path / "a", tmp_path / "b", write_delta=tmp_path / "d")
    assert load_file(tmp_path / "d" / "delta.safetensors")["w:indices"].tolist() == where
    ckpttool.apply(tmp_path / "a", tmp_path / "d", tmp_path / "out", max_shard_size=1000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert ckpttool.diff(tmp_path / "b", tmp_path / "out").identical


def test_delta_output_rules(llama_keep: Path, tmp_path: Path) -> None:
    changed_copy(llama_keep, tmp_path / "b")
    d = tmp_path / "d"
    ckpttool.diff(llama_keep, tmp_path / "b", write_delta=d)
    first = (d / "delta.json").read_bytes()
    with pytest.raises(OutputError, match="already holds config.json; pass --overwrite"):
        ckpttool.diff(llama_keep, tmp_path / "b", write_delta=d)
    ckpttool.diff(llama_keep, tmp_path / "b", write_delta=d, overwrite=True)
    assert (d / "delta.json").read_bytes() == first
    assert not [p for p in d.iterdir() if "tmp" in p.name]
    with pytest.raises(OutputError, match="choose an output directory outside it"):
        ckpttool.diff(llama_keep, tmp_path / "b", write_delta=tmp_path / "b" / "d")
    out = tmp_path / "out"
    ckpttool.apply(llama_keep, d, out)
    with pytest.raises(OutputError, match="already holds"):
        ckpttool.apply(llama_keep, d, out)
    ckpttool.apply(llama_keep, d, out, overwrite=True)


# -- DeepSpeed


@pytest.fixture(scope="module")
def zero2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not ds_layouts.DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    return ds_layouts.write_zero(tmp_path_factory.mktemp("diff-zero2") / "ckpt", 2, 2)


def test_deepspeed_against_hf_and_a_delta_applied_to_it(zero2: Path, tmp_path: Path) -> None:
    merged = tmp_path / "merged"
    ckpttool.merge(zero2, merged, dtype="keep")
    assert ckpttool.diff(zero2, merged).identical
    sd = load_file(merged / "model.safetensors")
    b = {k: v.clone() for k, v in sd.items()}
    name = next(k for k, v in b.items() if v.is_floating_point() and v.numel() > 20)
    b[name].view(-1)[7] += 1
    write(tmp_path / "b", b, tie=None)
    shutil.copy(merged / "config.json", tmp_path / "b" / "config.json")
    report = ckpttool.diff(zero2, tmp_path / "b", write_delta=tmp_path / "d")
    assert [t.name for t in report.tensors if t.status != "identical"] == [name]
    assert rows(report)[name].changed_elements == 1
    ckpttool.apply(zero2, tmp_path / "d", tmp_path / "out")
    same_bits(load_file(tmp_path / "out" / "model.safetensors"), b)


# -- verify --base


def test_verify_base_warns_when_the_merge_changed_nothing(llama_ckpt: Path, llama_keep: Path,
                                                           tmp_path: Path) -> None:
    report = ckpttool.verify(llama_keep, base=llama_ckpt)
    assert "base" in report.checks and report.ok
    found = [p for p in report.problems if p.code == "identical-to-base"]
    assert len(found) == 1 and found[0].severity == "warning"
    changed_copy(llama_keep, tmp_path / "b")
    report = ckpttool.verify(tmp_path / "b", base=llama_ckpt)
    assert not [p for p in report.problems if p.code == "identical-to-base"]
    note = next(p for p in report.problems if p.code == "differs-from-base")
    assert note.severity == "info" and note.message.startswith("6 of 22 tensors differ")
    assert math.isfinite(report.seconds)


# -- Megatron-Core


@pytest.fixture(scope="module")
def megatron_run(megatron_runs: Path) -> Path:
    """One Megatron-Core run written by megatron-core (llama, TP=2, 2 gloo ranks), of the
    session's runs (tests/conftest.py)."""
    return megatron_runs / "llama-tp2"


def test_megatron_run_against_its_merge_and_a_delta_applied_to_the_run(
        megatron_run: Path, tmp_path: Path) -> None:
    merged = tmp_path / "merged"
    ckpttool.merge(megatron_run, merged, dtype="keep")
    report = ckpttool.diff(megatron_run, merged)
    assert report.identical, [t for t in report.tensors if t.status != "identical"]
    assert report.format_a == "megatron" and len(report.tensors) == len(
        load_file(merged / "model.safetensors"))
    sd = load_file(merged / "model.safetensors")
    b = {k: v.clone() for k, v in sd.items()}
    q = "model.layers.1.self_attn.q_proj.weight"  # a slice of the fused, stacked QKV
    b[q][2, 3] += 1
    write(tmp_path / "b", b, tie=None)
    shutil.copy(merged / "config.json", tmp_path / "b" / "config.json")
    report = ckpttool.diff(megatron_run, tmp_path / "b", write_delta=tmp_path / "d")
    assert [(t.name, t.changed_elements) for t in report.tensors
            if t.status != "identical"] == [(q, 1)]
    ckpttool.apply(megatron_run, tmp_path / "d", tmp_path / "out")
    same_bits(load_file(tmp_path / "out" / "model.safetensors"), b)
    # The run is the delta's A; its merge holds the same tensors: a base as good.
    ckpttool.apply(merged, tmp_path / "d", tmp_path / "out2")
    same_bits(load_file(tmp_path / "out2" / "model.safetensors"), b)
