"""The checkpoint fixtures are real DCP saves and hold what they promise."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

import examples.fsdp2_checkpoint as fx
from tests.reference import reference_skipped_keys, reference_state_dict

REPO = Path(__file__).resolve().parent.parent
DISTCP = re.compile(r"__(\d+)_(\d+)\.distcp")


def _metadata(dcp_dir: Path) -> Metadata:
    return FileSystemReader(dcp_dir).read_metadata()


def _tensor_md(md: Metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _data_files(dcp_dir: Path) -> dict[int, list[int]]:
    """rank -> sorted file indices of ``__<rank>_<i>.distcp``."""
    files: dict[int, list[int]] = {}
    for p in dcp_dir.iterdir():
        m = DISTCP.fullmatch(p.name)
        if m:
            files.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return {r: sorted(v) for r, v in sorted(files.items())}


def _chunks(md: TensorStorageMetadata) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, -0.0 != 0.0), for any dtype incl. float8 and bool."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


# --------------------------------------------------------------------------------------
# every kind
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", fx.KINDS)
def test_layout_and_reference_load(make_checkpoint, kind: str) -> None:
    ckpt = make_checkpoint(kind)
    dcp_dir = ckpt / fx.MODEL_DIR
    assert (dcp_dir / ".metadata").is_file()

    files = _data_files(dcp_dir)
    world = fx.DEFAULT_WORLD_SIZE[kind]
    assert sorted(files) == list(range(world)), files
    per_rank = 2 if kind == "placements" else 1
    assert all(v == list(range(per_rank)) for v in files.values()), files

    md = _metadata(dcp_dir)
    tensors = _tensor_md(md)
    ref = reference_state_dict(dcp_dir)
    assert set(tensors) <= set(ref)
    for key, tmd in tensors.items():
        t = ref[key]
        assert isinstance(t, torch.Tensor) and t.device.type == "cpu", key
        assert t.dtype == tmd.properties.dtype and tuple(t.shape) == tuple(tmd.size), key
        # the chunks tile the tensor exactly (no gaps, no overlaps)
        assert sum(c.sizes.numel() for c in tmd.chunks) == t.numel(), key

    # every storage item points into a file that exists
    for si in md.storage_data.values():
        assert (dcp_dir / si.relative_path).is_file()

    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    assert size < 2 * 1024 * 1024


def test_keys_are_wrapped_in_model_except_placements(make_checkpoint) -> None:
    for kind in fx.KINDS:
        md = _metadata(make_checkpoint(kind) / fx.MODEL_DIR)
        tensor_keys = list(_tensor_md(md))
        if kind == "placements":
            # flat torchtitan-style dict: planner_data paths are 1-tuples, although every
            # key starts with "model." like the wrapped kinds
            assert all(md.planner_data[k] == (k,) for k in md.state_dict_metadata)
            assert all(k.startswith("model.") for k in tensor_keys)
        else:
            assert all(k.startswith("model.") for k in tensor_keys), kind
            assert all(
                md.planner_data[k] == ("model", k.removeprefix("model.")) for k in tensor_keys
            ), kind


# --------------------------------------------------------------------------------------
# llama
# --------------------------------------------------------------------------------------


def test_llama_files(llama_ckpt: Path) -> None:
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "reference.pt",
        "random_states_0.pkl",
        f"{fx.MODEL_DIR}/.metadata",
        f"{fx.OPTIMIZER_DIR}/.metadata",
    ):
        assert (llama_ckpt / name).is_file(), name
    cfg = json.loads((llama_ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["FSDPLlamaForCausalLM"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["tie_word_embeddings"] is True
    assert sorted(_data_files(llama_ckpt / fx.OPTIMIZER_DIR)) == [0, 1]


def test_llama_tied_pair_and_bf16_values(llama_ckpt: Path) -> None:
    dcp_dir = llama_ckpt / fx.MODEL_DIR
    tensors = _tensor_md(_metadata(dcp_dir))
    assert "model.lm_head.weight" in tensors and "model.model.embed_tokens.weight" in tensors
    ref = reference_state_dict(dcp_dir)
    assert torch.equal(ref["model.lm_head.weight"], ref["model.model.embed_tokens.weight"])
    for key, t in ref.items():
        assert t.dtype == torch.float32, key
        assert torch.equal(t.to(torch.bfloat16).to(torch.float32), t), key  # exact bf16


def test_llama_reference_logits_reproduce(llama_ckpt: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    ref = reference_state_dict(llama_ckpt / fx.MODEL_DIR)
    weights = {k.removeprefix("model."): v for k, v in ref.items()}
    config = LlamaConfig.from_pretrained(llama_ckpt)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and not missing, (missing, unexpected)

    saved = torch.load(llama_ckpt / "reference.pt", weights_only=True)
    assert saved["input_ids"].shape == (2, 8) and saved["input_ids"].dtype == torch.int64
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            logits = model(input_ids=saved["input_ids"]).logits
    finally:
        torch.set_num_threads(threads)
    assert logits.dtype == torch.float32 == saved["logits"].dtype
    assert torch.equal(logits, saved["logits"])


def test_llama_optimizer_is_loadable(llama_ckpt: Path) -> None:
    ref = reference_state_dict(llama_ckpt / fx.OPTIMIZER_DIR)
    assert ref["optimizer.param_groups.0.lr"] == pytest.approx(1e-2)
    exp_avg = ref["optimizer.state.model.embed_tokens.weight.exp_avg"]
    assert isinstance(exp_avg, torch.Tensor) and exp_avg.shape == (128, 32)
    assert exp_avg.abs().sum() > 0  # one real step was taken


# --------------------------------------------------------------------------------------
# uneven
# --------------------------------------------------------------------------------------


def test_uneven_has_empty_chunks(uneven_ckpt: Path) -> None:
    tensors = _tensor_md(_metadata(uneven_ckpt / fx.MODEL_DIR))
    chunks = {k: _chunks(v) for k, v in tensors.items()}
    # torch.chunk-style split of dim 0 over 3 ranks; an empty shard is a zero-size chunk
    # whose offset is the dim size.
    assert chunks["model.a"] == [((0, 0), (4, 7)), ((4, 0), (4, 7)), ((8, 0), (2, 7))]
    assert chunks["model.b"] == [((0,), (3,)), ((3,), (3,)), ((6,), (1,))]
    assert chunks["model.c"] == [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (0, 3))]
    assert chunks["model.d"] == [((0, 0), (1, 5)), ((1, 0), (1, 5)), ((2, 0), (0, 5))]
    # ranks 1 and 2 both hold an empty shard of the (1,) tensor: identical chunks, the
    # writer keeps only one of them.
    assert chunks["model.e"] == [((0,), (1,)), ((1,), (0,))]


def test_uneven_values_match_source(uneven_ckpt: Path) -> None:
    torch.manual_seed(fx.SEED)
    source = fx._Uneven().state_dict()
    ref = reference_state_dict(uneven_ckpt / fx.MODEL_DIR)
    assert set(ref) == {f"model.{k}" for k in source}
    for k, v in source.items():
        assert torch.equal(ref[f"model.{k}"], v), k


# --------------------------------------------------------------------------------------
# wrappers
# --------------------------------------------------------------------------------------


def test_wrapper_segments_present(wrappers_ckpt: Path) -> None:
    keys = list(_metadata(wrappers_ckpt / fx.MODEL_DIR).state_dict_metadata)
    assert all(k.startswith("model._orig_mod.") for k in keys), keys
    wrapped = [k for k in keys if "._checkpoint_wrapped_module." in k]
    assert "model._orig_mod.blocks.0._checkpoint_wrapped_module.proj.weight" in wrapped
    assert "model._orig_mod.blocks.1._checkpoint_wrapped_module.scale" in wrapped  # buffer
    assert "model._orig_mod.embed.weight" in keys


# --------------------------------------------------------------------------------------
# mixed
# --------------------------------------------------------------------------------------


def test_mixed_dtypes_and_entries(mixed_ckpt: Path) -> None:
    dcp_dir = mixed_ckpt / fx.MODEL_DIR
    sdm = _metadata(dcp_dir).state_dict_metadata
    for dtype in fx.MIXED_DTYPES:
        md = sdm[f"model.{fx._dtype_name(dtype)}"]
        assert isinstance(md, TensorStorageMetadata) and md.properties.dtype == dtype
        assert len(md.chunks) == 2  # Shard(0) over 2 ranks
    assert {md.properties.dtype for md in _tensor_md(_metadata(dcp_dir)).values()} == set(
        fx.MIXED_DTYPES
    )
    for key in ("model.scalar", "model.int_scalar"):
        assert tuple(sdm[key].size) == ()
    for key in ("step", "meta.run", "meta.lr", "opaque"):
        assert isinstance(sdm[key], BytesStorageMetadata), key

    ref = reference_state_dict(dcp_dir)
    assert ref["step"] == 500 and ref["meta.run"] == "demo" and ref["meta.lr"] == 0.001
    assert "opaque" not in ref  # needs arbitrary unpickling: not loaded weights-only
    assert set(reference_skipped_keys(dcp_dir)) == {"opaque"}
    assert torch.equal(ref["model.scalar"], torch.tensor(3.5))
    assert torch.equal(ref["model.int_scalar"], torch.tensor(7))
    assert torch.equal(ref["model.position_ids"], torch.arange(16).unsqueeze(0))


def test_mixed_values_match_source(mixed_ckpt: Path) -> None:
    ref = reference_state_dict(mixed_ckpt / fx.MODEL_DIR)
    g = torch.Generator().manual_seed(fx.SEED)
    for dtype in fx.MIXED_DTYPES:
        expected = fx._random_tensor(dtype, (6, 3), g)
        assert _bits_equal(ref[f"model.{fx._dtype_name(dtype)}"], expected), dtype
    assert _bits_equal(ref["model.plain"], torch.randn(4, 5, generator=g))
    floats = ref["model.float32"]
    assert floats.isnan().any() and floats.isinf().any()


# --------------------------------------------------------------------------------------
# placements
# --------------------------------------------------------------------------------------


def test_placements_layout(placements_ckpt: Path) -> None:
    dcp_dir = placements_ckpt / fx.MODEL_DIR
    files = _data_files(dcp_dir)
    assert all(len(v) >= 2 for v in files.values())
    assert (dcp_dir / "__1_1.distcp").is_file()
    md = _metadata(dcp_dir)
    used = {si.relative_path for si in md.storage_data.values()}
    assert {f"__{r}_1.distcp" for r in range(4)} <= used
    chunks = {k: _chunks(v) for k, v in _tensor_md(md).items()}
    assert chunks["model.embed_tokens.weight"] == [((4 * r, 0), (4, 8)) for r in range(4)]
    assert chunks["model.layers.0.weight"] == [  # Shard(1), dim 1 = 10 over 4 ranks
        ((0, 0), (8, 3)), ((0, 3), (8, 3)), ((0, 6), (8, 3)), ((0, 9), (8, 1))
    ]
    assert chunks["model.layers.0.bias"] == [((0,), (8,))]  # Replicate(): one chunk
    assert chunks["model.norm.weight"] == [((0,), (8,))]
    assert chunks["model.layers.1.bias"] == [  # (3, 8) Shard(0): rank 3 empty
        ((0, 0), (1, 8)), ((1, 0), (1, 8)), ((2, 0), (1, 8)), ((3, 0), (0, 8))
    ]
    assert chunks["model.lm_head.weight"] == [  # (8, 6) Shard(1): 2, 2, 2, 0
        ((0, 0), (8, 2)), ((0, 2), (8, 2)), ((0, 4), (8, 2)), ((0, 6), (8, 0))
    ]


def test_placements_other_world_size(make_checkpoint) -> None:
    dcp_dir = make_checkpoint("placements", world_size=2) / fx.MODEL_DIR
    assert sorted(_data_files(dcp_dir)) == [0, 1]
    ref2 = reference_state_dict(dcp_dir)
    ref4 = reference_state_dict(make_checkpoint("placements") / fx.MODEL_DIR)
    assert ref2.keys() == ref4.keys()
    for k in ref4:
        assert torch.equal(ref2[k], ref4[k]), k


# --------------------------------------------------------------------------------------
# script
# --------------------------------------------------------------------------------------


def test_main_prints_dcp_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert fx.main([str(tmp_path / "ckpt"), "--kind", "uneven", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert out == f"{(tmp_path / 'ckpt').resolve() / fx.MODEL_DIR}\n"
    assert sorted(_data_files(tmp_path / "ckpt" / fx.MODEL_DIR)) == [0, 1]


@pytest.mark.slow
def test_script_run(tmp_path: Path) -> None:
    """As a script (fresh interpreter, cwd elsewhere): pickles name the package module."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "fsdp2_checkpoint.py"), str(out),
         "--kind", "mixed"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{out.resolve() / fx.MODEL_DIR}\n"
    dcp_dir = out / fx.MODEL_DIR
    md = _metadata(dcp_dir)
    si = md.storage_data[next(i for i in md.storage_data if i.fqn == "opaque")]
    with open(dcp_dir / si.relative_path, "rb") as f:
        f.seek(si.offset)
        raw = f.read(si.length)
    assert b"examples.fsdp2_checkpoint" in raw and b"__mp_main__" not in raw
    assert set(reference_skipped_keys(dcp_dir)) == {"opaque"}
