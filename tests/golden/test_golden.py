"""The ``--json`` documents of all four commands, pinned on real fixtures.

A restructuring must leave every document byte-identical; a change that means to alter one
regenerates the files and shows the difference in review:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/golden

Paths are written relative to a placeholder (``<SRC>``, ``<OUT>``) and wall-clock fields are
zeroed, so the documents do not depend on where or how fast the fixtures were written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app

GOLDEN = Path(__file__).parent / "data"
VOLATILE = {"seconds"}


def _scrub(value: Any, subs: list[tuple[str, str]]) -> Any:
    if isinstance(value, dict):
        # A written .metadata pickles its own directory's path: its size follows the path's.
        volatile = VOLATILE | ({"bytes"} if value.get("name") == ".metadata" else set())
        return {k: (0 if k in volatile else _scrub(v, subs)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, subs) for v in value]
    if isinstance(value, str):
        for old, new in subs:
            value = value.replace(old, new)
        return value
    return value


def _run(args: list[str], subs: list[tuple[str, str]]) -> str:
    r = CliRunner().invoke(app, args, env={"CKPTTOOL_FSYNC": "0"})
    assert r.exit_code in (0, 1), r.output
    doc = json.loads(r.stdout)
    return json.dumps(_scrub(doc, subs), indent=1, sort_keys=True) + "\n"


def _check(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no golden {path.name}: run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name}: --json differs from {path}"


CASES = ["llama", "wrappers", "mixed", "placements", "hf"]


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest) -> tuple[str, Path]:
    name = request.param
    if name == "hf":
        return name, request.getfixturevalue("hf_ckpt")
    return name, request.getfixturevalue(f"{name}_ckpt")


def test_json_documents(case: tuple[str, Path], tmp_path: Path) -> None:
    name, src = case
    out = tmp_path / "out"
    # The run directory above SRC is named where merge looks for a config.json.
    subs = [(str(out), "<OUT>"), (str(src), "<SRC>"), (str(src.parent), "<RUN>"),
            (str(tmp_path), "<TMP>")]
    _check(f"{name}-inspect", _run(["inspect", str(src), "--json"], subs))
    _check(f"{name}-verify", _run(["verify", str(src), "--json", "--workers", "2"], subs))
    # Only llama is a transformers model with its config.json; the others are weights only.
    weights = [] if name == "llama" else ["--weights-only"]
    _check(f"{name}-merge-dry", _run(
        ["merge", str(src), str(out), "--json", "--dry-run", "--workers", "2", *weights], subs))
    _check(f"{name}-merge", _run(["merge", str(src), str(out), "--json", "--workers", "2",
                                  *weights], subs))
    _check(f"{name}-verify-out", _run(
        ["verify", str(out), "--json", "--workers", "2", "--against", str(src)], subs))
    _check(f"{name}-reshard", _run(
        ["reshard", str(src), str(tmp_path / "re"), "--ranks", "2", "--json"],
        subs + [(str(tmp_path / "re"), "<RE>")]))


def test_diff_and_apply_documents(llama_ckpt: Path, tmp_path: Path) -> None:
    """``diff --json`` (every status, a tie stored once, a delta) and ``apply --json`` on the
    llama fixture against a changed copy of its merge."""
    from safetensors.torch import load_file, save_file

    keep, b, delta, out = (tmp_path / n for n in ("keep", "b", "delta", "out"))
    r = CliRunner().invoke(app, ["merge", str(llama_ckpt), str(keep), "--dtype", "keep", "-q"],
                           env={"CKPTTOOL_FSYNC": "0"})
    assert r.exit_code == 0, r.output
    sd = load_file(keep / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.weight"][3, 5] += 0.25
    sd["model.layers.1.mlp.up_proj.weight"] *= 2
    del sd["model.layers.1.post_attention_layernorm.weight"]
    sd["extra.bias"] = sd["model.norm.weight"][:7].clone()
    sd["model.norm.weight"] = sd["model.norm.weight"].reshape(2, -1).clone()
    sd["model.layers.0.input_layernorm.weight"] = sd[
        "model.layers.0.input_layernorm.weight"].bfloat16()
    b.mkdir()
    save_file(sd, b / "model.safetensors")
    (b / "config.json").write_bytes((keep / "config.json").read_bytes())
    subs = [(str(delta), "<DELTA>"), (str(out), "<OUT>"), (str(b), "<B>"),
            (str(llama_ckpt), "<SRC>"), (str(tmp_path), "<TMP>")]
    _check("llama-diff", _run(["diff", str(llama_ckpt), str(b), "--json", "--workers", "2",
                               "--write-delta", str(delta)], subs))
    _check("llama-apply", _run(["apply", str(llama_ckpt), str(delta), str(out), "--json"], subs))
