"""The remote half of one commit protocol (finding 4 of issue 34): an ``--overwrite`` upload
that changes the output's layout (one ``model.safetensors`` <-> an index and shards) or
replaces a single file by another (a ``--dtype`` change: another ``config.json``), killed at
every step against moto's S3 server, leaves the previous output, the new one, or no complete
model; never a complete model beside the other run's ``config.json``."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.storage import s3 as remote
from tests.helpers import s3_contents, s3_publish, s3_put_all
from tests.remote.conftest import BUCKET, S3

INDEX = "model.safetensors.index.json"
LAYOUTS = {"single": ["--dtype", "fp32"], "single-bf16": ["--dtype", "bf16"],
           "sharded": ["--dtype", "fp32", "--max-shard-size", "20KB"]}


def model_and_config(found: dict[str, bytes]) -> tuple[dict[str, bytes], bytes | None] | None:
    found = {k: v for k, v in found.items() if k != remote.LOCK_NAME}
    if INDEX in found:
        assert "model.safetensors" not in found, "model.safetensors beside an index"
        shards = sorted(set(json.loads(found[INDEX])["weight_map"].values()))
        assert all(s in found for s in shards), "the index names a missing shard"
        state = {n: found[n] for n in (INDEX, *shards)}
    elif "model.safetensors" in found:
        state = {"model.safetensors": found["model.safetensors"]}
    else:
        return None
    return state, found.get("config.json")


@pytest.fixture(scope="module")
def staged(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("layouts")
    for layout, args in LAYOUTS.items():
        r = CliRunner().invoke(app, ["merge", str(llama_ckpt), str(tmp / layout), "-q", *args])
        assert r.exit_code == 0, r.output
    return {layout: tmp / layout for layout in LAYOUTS}


@pytest.mark.parametrize(("old", "new"), [("single", "single-bf16"), ("sharded", "single"),
                                          ("single", "sharded")])
@pytest.mark.slow
def test_upload_killed_at_every_step_of_a_layout_change(s3: S3, staged: dict[str, Path],
                                                        old: str, new: str) -> None:
    files = {k: {p.name: p.read_bytes() for p in staged[k].iterdir()} for k in (old, new)}
    refs = {k: model_and_config(files[k]) for k in (old, new)}
    prefix = f"layouts/{old}-{new}"
    url = f"s3://{BUCKET}/{prefix}"
    kills = 0
    for step in range(1, 40):
        s3_put_all(s3, prefix, files[old])
        p = s3_publish(s3, staged[new], url, hook=f"kill:{step}")
        _, err = p.communicate(timeout=300)
        found = model_and_config(s3_contents(s3, prefix))
        if p.returncode == 0:
            assert found == refs[new]
            break
        assert p.returncode == -signal.SIGKILL, err
        kills += 1
        assert found is None or found in (refs[old], refs[new]), (
            f"step {step}: a complete model beside another run's config.json")
    else:
        raise AssertionError("the upload never finished")
    assert kills >= 3
