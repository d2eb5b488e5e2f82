"""One commit protocol for every output layout (finding 4 of issue 34): a merge killed
(``kill -9``) at every publishing step of an ``--overwrite`` that changes the layout (one
``model.safetensors`` <-> an index and shards) or replaces a single file by another (a
``--dtype`` change: another ``config.json``) leaves the previous output, the new one, or no
complete model; never a complete model beside the other run's ``config.json``."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from tests.helpers import fault_merge

INDEX = "model.safetensors.index.json"

LAYOUTS = {"single": ("--dtype", "fp32"), "single-bf16": ("--dtype", "bf16"),
           "sharded": ("--dtype", "fp32", "--max-shard-size", "20KB")}


def model_and_config(out: Path) -> tuple[dict[str, bytes], bytes | None] | None:
    """The files of the complete model OUT holds (an index and every shard it names, or
    model.safetensors alone) and the config.json beside it; None where nothing reads as a
    complete model."""
    index, single = out / INDEX, out / "model.safetensors"
    if index.exists():
        assert not single.exists(), "model.safetensors beside an index"
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        assert all((out / s).is_file() for s in shards), "the index names a missing shard"
        state = {n: (out / n).read_bytes() for n in (INDEX, *shards)}
    elif single.exists():
        state = {single.name: single.read_bytes()}
    else:
        return None
    config = out / "config.json"
    return state, config.read_bytes() if config.exists() else None


def _merge_layout(src: Path, out: Path, layout: str, *args: str, fault: str | None = None):
    # fault_merge passes --dtype keep first; the layout's --dtype comes after and wins.
    return fault_merge(src, out, *LAYOUTS[layout], *args, fault=fault)


@pytest.mark.parametrize(("old", "new"), [("single", "single-bf16"), ("sharded", "single"),
                                          ("single", "sharded"), ("single-bf16", "sharded")])
@pytest.mark.slow
def test_kill_at_every_step_of_a_layout_change(llama_ckpt: Path, tmp_path: Path, old: str,
                                               new: str) -> None:
    refs = {}
    for layout in (old, new):
        done = _merge_layout(llama_ckpt, tmp_path / "ref" / layout, layout)
        assert done.returncode == 0, done.stderr
        refs[layout] = model_and_config(tmp_path / "ref" / layout)
    assert refs[old] is not None and refs[new] is not None
    assert refs[old][1] != refs[new][1] or refs[old][0] != refs[new][0]
    out = tmp_path / "out"
    kills = 0
    for k in range(1, 80):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(tmp_path / "ref" / old, out)
        done = _merge_layout(llama_ckpt, out, new, "--overwrite", fault=f"kill:{k}")
        found = model_and_config(out)
        if done.returncode == 0:
            assert found == refs[new]
            break
        assert done.returncode == -signal.SIGKILL, done.stderr
        kills += 1
        assert found is None or found in (refs[old], refs[new]), (
            f"step {k}: a complete model beside another run's config.json")
    else:
        raise AssertionError("the merge never finished")
    assert kills >= 4
