"""A local checkpoint's side files (config and tokenizer files, trainer records) that vanish
after discovery and come back as a link out of the checkpoint just after ckpttool looked for
a local entry: a missing local file is never read through the Stores (which follow links),
so the link is refused as it was before the Stores read side files."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpttool.core.checkpoint import hf
from ckpttool.errors import InputError
from ckpttool.storage import memory
from ckpttool.storage.objtree import ObjectTree
from ckpttool.storage.store import LOCAL, Stores
from tests.storage.objects import upload_tree


def _plant_after_look(monkeypatch: pytest.MonkeyPatch, victim: Path,
                      plant: Callable[[], None]) -> None:
    """``plant()`` runs just after ``os.path.lexists(victim)`` found nothing there: the race
    an attacker with write access to the checkpoint may win."""
    real = os.path.lexists

    def lexists(path: str | os.PathLike[str]) -> bool:
        there = real(path)
        if os.fspath(path) == str(victim) and not there:
            plant()
        return there

    monkeypatch.setattr(os.path, "lexists", lexists)


@pytest.fixture(params=["local", "beside-a-remote-source"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    """The Stores a local checkpoint is read through: the local ones, or a command's that
    also reads a remote checkpoint (whose object tree sends every local path to LOCAL)."""
    if request.param == "local":
        yield LOCAL
        return
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text("{}")
    with ObjectTree(upload_tree(remote, "s3://races/remote"), backend=memory) as tree:
        yield tree


def test_side_file_gone_then_linked_out_is_refused(tmp_path: Path, stores: Stores,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "checkpoint-500"
    ckpt.mkdir()
    side = ckpt / "tokenizer_config.json"
    side.write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    files = hf.find_hf_files(ckpt, stores=stores)
    assert side in files.files
    side.unlink()  # gone after discovery...
    _plant_after_look(monkeypatch, side, lambda: side.symlink_to(secret))  # ...then a link
    with pytest.raises(InputError) as e:
        files.read(side)
    assert str(e.value).startswith(f"{side}: ")
    assert "it changed since the checkpoint was read" in str(e.value)


@pytest.mark.parametrize("name", ["adapter_config.json", "lora_train_meta.json"])
def test_trainer_record_linked_out_after_look_is_not_read(
        tmp_path: Path, stores: Stores, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A trainer's record is never read through a link (O_NOFOLLOW); one that appears as a
    link just after the look finds no file there is not read either."""
    victim = tmp_path / name
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"r": 8, "lora_alpha": 16, "secret": "outside"}))
    _plant_after_look(monkeypatch, victim, lambda: victim.symlink_to(secret))
    assert hf.read_record(victim, stores=stores) is None


def test_a_remote_side_file_is_still_read_through_the_object_tree(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "tokenizer_config.json").write_text('{"a": 1}')
    (remote / "lora_train_meta.json").write_text('{"r": 8}')
    with ObjectTree(upload_tree(remote, "s3://races/sides"), backend=memory) as tree:
        files = hf.find_hf_files(tree.local, stores=tree)
        side = tree.local / "tokenizer_config.json"
        assert files.files == (side,)
        assert files.read(side) == b'{"a": 1}'
        found = hf.read_record(tree.local / "lora_train_meta.json", stores=tree)
        assert found is not None and found.doc == {"r": 8}
        assert list(tree.tmp.iterdir()) == []


def test_delta_writes_the_config_it_parsed(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``diff --write-delta`` copies B's config.json as it was read and parsed, never the name
    read again (a second GET of a remote one; a local one rewritten since)."""
    import torch
    from safetensors.torch import save_file

    import ckpttool

    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        save_file({"w": torch.zeros(4) if side == "a" else torch.ones(4)},
                  tmp_path / side / "model.safetensors")
    config = tmp_path / "b" / "config.json"
    config.write_text('{"tie_word_embeddings": false}')
    found = hf.find_hf_files

    def then_rewrite(*args: Any, **kwargs: Any) -> hf.HfFiles:
        files = found(*args, **kwargs)
        if files.config_path == config:
            config.write_text('{"tie_word_embeddings": false, "rewritten": true}')
        return files

    monkeypatch.setattr(hf, "find_hf_files", then_rewrite)
    ckpttool.diff(tmp_path / "a", tmp_path / "b", write_delta=tmp_path / "d")
    assert (tmp_path / "d" / "config.json").read_text() == '{"tie_word_embeddings": false}'


def test_a_remote_side_file_replaced_since_listing_says_so(tmp_path: Path) -> None:
    """A remote tokenizer file replaced after the listing fails in the object store's words
    (the object changed while read), not as a local file that is "no longer a regular file"."""
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "tokenizer_config.json").write_text('{"a": 1}')
    url = upload_tree(remote, "s3://races/replaced")
    with ObjectTree(url, backend=memory) as tree:
        files = hf.find_hf_files(tree.local, stores=tree)
        memory.put(memory.parse(url).child("tokenizer_config.json"), b'{"a": 2}')
        with pytest.raises(InputError) as e:
            files.read(tree.local / "tokenizer_config.json")
        said = tree.to_url(str(e.value))
    assert said == (f"{url}/tokenizer_config.json: the object changed while it was being "
                    "read; run again once it is no longer being written")
