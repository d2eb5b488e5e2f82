"""The files around a remote checkpoint's weights (config.json, tokenizer files) come from the
object store alone (issue 37, item 5): nothing of the checkpoint is on the local disk, the
merge copies them into its output as a local merge does, and one over 64 MB (once refused,
exit 4) is read by ranged GETs. On the in-memory backend (no server)."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import ckpttool
from ckpttool.storage import memory
from ckpttool.storage.objtree import ObjectTree
from tests.helpers import same_files
from tests.storage.objects import upload_tree

BUCKET = "sides"
_prefixes = itertools.count()
TOKENIZER = b'{"version": "1.0", "model": {"type": "BPE"}}\n'


def _upload(local: Path) -> str:
    return upload_tree(local, f"s3://{BUCKET}/run/{next(_prefixes)}")


def _merged_both_ways(llama_ckpt: Path, tmp_path: Path, tokenizer: bytes) -> tuple[Path, Path]:
    """``llama_ckpt`` with ``tokenizer`` as its tokenizer.json, merged from its local copy and
    from the object store; the object tree's directory stays empty all along."""
    src = tmp_path / "checkpoint-500"
    shutil.copytree(llama_ckpt, src)
    (src / "tokenizer.json").write_bytes(tokenizer)
    url = _upload(src)
    local, remote = tmp_path / "local", tmp_path / "remote"
    ckpttool.merge(src, local, weights_only=True)
    with ObjectTree(url, backend=memory) as tree:
        ckpttool.merge(tree.local, remote, weights_only=True, stores=tree)
        assert list(tree.tmp.iterdir()) == []  # no local file stood for a remote one
    return local, remote


def test_config_and_tokenizer_come_from_the_object_store(llama_ckpt: Path,
                                                         tmp_path: Path) -> None:
    local, remote = _merged_both_ways(llama_ckpt, tmp_path, TOKENIZER)
    same_files(remote, local)
    names = {p.name for p in remote.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names
    assert (remote / "tokenizer.json").read_bytes() == TOKENIZER
    assert (remote / "tokenizer_config.json").read_bytes() == (
        llama_ckpt / "tokenizer_config.json").read_bytes()


def test_a_side_file_over_64_mb_is_read_by_ranged_gets(llama_ckpt: Path,
                                                       tmp_path: Path) -> None:
    """A tokenizer.json of 64 MB and more (a large vocabulary) was refused with exit 4; it is
    read where it lies and copied whole."""
    big = b'{"model": {"vocab": "' + b"a" * ((64 << 20) + 1) + b'"}}\n'
    local, remote = _merged_both_ways(llama_ckpt, tmp_path, big)
    same_files(remote, local)
    assert (remote / "tokenizer.json").read_bytes() == big


def test_a_remote_output_is_verified_against_its_receipt(llama_ckpt: Path,
                                                         tmp_path: Path) -> None:
    """``verify`` of a ``merge --all`` output in object storage reads the receipt beside it
    through the object store, and finds a flipped byte against it."""
    from ckpttool.core.merge import sweep
    from ckpttool.core.merge.options import MergeOptions
    from ckpttool.core.verify import receipt

    shutil.copytree(llama_ckpt, tmp_path / "run" / "checkpoint-500")
    out = tmp_path / "merged"
    sweep.sweep(tmp_path / "run", out, settle=0, options=MergeOptions.of(weights_only=True))
    merged = out / "checkpoint-500"
    assert (merged / receipt.RECEIPT_NAME).is_file()
    url = _upload(merged)
    with ObjectTree(url, backend=memory) as tree:
        ok = ckpttool.verify(tree.local, stores=tree)
    assert ok.ok and "receipt" in ok.checks
    weights = memory.parse(f"{url}/model.safetensors")
    data = bytearray((merged / "model.safetensors").read_bytes())
    data[-5] ^= 0x40
    memory.put(weights, bytes(data))
    with ObjectTree(url, backend=memory) as tree:
        bad = ckpttool.verify(tree.local, stores=tree)
    assert "receipt" in bad.checks
    assert {p.code for p in bad.problems if p.severity == "error"} == {"manifest-mismatch"}


def test_a_remote_adapter_config_is_found_and_written(lora_ckpts: Path, tmp_path: Path) -> None:
    """A PEFT checkpoint in object storage: ``--lora adapter`` finds its adapter_config.json
    through the object store and writes those very bytes, as from a local copy."""
    src = tmp_path / "peft"
    shutil.copytree(lora_ckpts / "lora", src, ignore=shutil.ignore_patterns("full.pt"))
    url = _upload(src)
    local, remote = tmp_path / "local", tmp_path / "remote"
    ckpttool.merge(src / "pytorch_model_fsdp_0", local, lora="adapter")
    with ObjectTree(url, backend=memory) as tree:
        ckpttool.merge(tree.local / "pytorch_model_fsdp_0", remote, lora="adapter", stores=tree)
    same_files(remote, local)
    assert (remote / "adapter_config.json").read_bytes() == (
        src / "adapter_config.json").read_bytes()
