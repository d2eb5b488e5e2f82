"""The formats that describe a checkpoint through the Stores they are given alone (issue 37,
item 5): recognised and described from the object listing and ranged reads only (the path that
stands for the remote checkpoint names no local file), exactly as their local copy is. A
format that still read a local path would find nothing there. On the in-memory backend (no
server)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from ckpttool.core.checkpoint import discover
from ckpttool.formats import registry
from ckpttool.formats.base import CheckpointInfo
from ckpttool.storage import memory
from ckpttool.storage.objtree import ObjectTree
from tests.storage.objects import upload_tree

BUCKET = "described"
_prefixes = itertools.count()


def _upload(local: Path) -> str:
    url = upload_tree(local if local.is_dir() else local.parent,
                      f"s3://{BUCKET}/ckpt/{next(_prefixes)}")
    return url + ("" if local.is_dir() else f"/{local.name}")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    embed = torch.randn(16, 8, generator=g)
    return {"model.embed_tokens.weight": embed, "lm_head.weight": embed,
            "model.layers.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.ones(8)}


def _sharded(tmp: Path, safe: bool) -> Path:
    out = tmp / ("st" if safe else "bin")
    out.mkdir()
    save_torch_state_dict(_state(), out, safe_serialization=safe, max_shard_size=300)
    return out


def _single_pt(tmp: Path) -> Path:
    out = tmp / "pt"
    out.mkdir()
    torch.save({k: v.clone() for k, v in _state().items()}, out / "weights.pt")
    return out / "weights.pt"


def _zero3(tmp: Path) -> Path:
    """DeepSpeed's own ZeRO-3 save, 2 ranks (``latest`` beside the tag directory)."""
    from tests import ds_layouts

    if not ds_layouts.DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    return ds_layouts.write_zero(tmp / "zero3", 3, 2)


def _fsdp2_rank_files(tmp: Path) -> Path:
    """FSDP2's per-rank DTensor state dicts, 2 ranks, with a verl optimizer set beside them
    (:func:`tests.layouts.write_fsdp2`)."""
    from tests import layouts

    return layouts.write_fsdp2(tmp, 2, extras=True) / layouts.CKPT_DIR


WRITERS: dict[str, Callable[[pytest.FixtureRequest, Path], Path]] = {
    "dcp": lambda req, tmp: req.getfixturevalue("tiny_dcp"),
    "dcp-safetensors": lambda req, tmp: req.getfixturevalue("hf_ckpt"),
    "safetensors": lambda req, tmp: _sharded(tmp, True),
    "torch-save-sharded": lambda req, tmp: _sharded(tmp, False),
    "torch-save": lambda req, tmp: _single_pt(tmp),
    "deepspeed": lambda req, tmp: _zero3(tmp),
    "rank-files": lambda req, tmp: _fsdp2_rank_files(tmp),
    # A run directory (tracker beside iter_*/), as Megatron-LM wrote it (committed).
    "megatron": lambda req, tmp: MEGATRON_RUN,
}
MEGATRON_RUN = Path(__file__).parents[1] / "data" / "megatron_lm" / "llama-release"


def _same(remote: CheckpointInfo, local: CheckpointInfo) -> None:
    assert remote.format == local.format
    assert remote.tensors == local.tensors
    assert [(o.name, o.file, o.offset) for o in remote.objects] == \
        [(o.name, o.file, o.offset) for o in local.objects]
    assert remote.files == local.files
    assert [p.code for p in remote.problems] == [p.code for p in local.problems]
    assert remote.stray == local.stray


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_described_with_no_local_file(fmt: str, request: pytest.FixtureRequest,
                                      tmp_path: Path) -> None:
    local = WRITERS[fmt](request, tmp_path)
    url = _upload(local)
    with ObjectTree(url, backend=memory) as tree:
        assert not tree.dir.exists()  # nothing on the local disk: the store alone answers
        found = registry.detect(tree.local, tree)
        assert found is not None and fmt == found.NAME
        remote = found.read_info(tree.local, stores=tree)
        assert not tree.dir.exists()
    mine = found.read_info(local)
    _same(remote, mine)
    # Where its file names are relative to, said without the local file system.
    assert remote.base.relative_to(tree.dir) == mine.base.relative_to(
        local if local.is_dir() else local.parent)


def test_a_training_directory_is_listed_through_the_stores(request: pytest.FixtureRequest
                                                           ) -> None:
    """Discovery lists a training directory's parts (model beside optimizer) and chooses
    one through the Stores, never the local directory."""
    local = request.getfixturevalue("uneven_ckpt")
    url = _upload(local)
    with ObjectTree(url, backend=memory) as tree:
        parts, infos = discover.list_parts(tree.local, tree)
        want_parts, want_infos = discover.list_parts(local)
        assert parts == want_parts
        assert sorted(infos) == sorted(want_infos)
        for name, info in infos.items():
            _same(info, want_infos[name])


def test_a_run_directory_is_named_through_the_stores(llama_ckpt: Path) -> None:
    """A training run given where one checkpoint is expected: its checkpoints are found from
    the listing (the message names the latest and ``merge --all``), as for a local run."""
    from ckpttool.core.checkpoint.runs import run_message

    prefix = f"run/{next(_prefixes)}"
    for step in ("checkpoint-100", "checkpoint-200"):
        upload_tree(llama_ckpt, f"s3://{BUCKET}/{prefix}/{step}")
    with ObjectTree(f"s3://{BUCKET}/{prefix}", backend=memory) as tree:
        said = run_message(tree.local, "merge", tree)
        assert not tree.dir.exists()
    assert said is not None
    assert said.startswith(f"{tree.local}: a training run directory with 2 checkpoints "
                           "(steps 100 to 200), not one checkpoint; the latest is "
                           "checkpoint-200"), said
