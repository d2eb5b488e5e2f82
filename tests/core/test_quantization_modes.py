"""Quantized weights through merge's other modes (issue 39, item 4): ``merge --all`` over a
run of checkpoints, ``--slice I/N`` then ``--finish`` into a local directory, and (in
tests/remote/test_quantized_remote.py) an ``s3://`` source: each output byte for byte the
one merge of the same source writes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckpttool import merge
from tests.helpers import QUANT_MODES, invoke, same_model


@pytest.fixture(scope="module")
def wanted(fp8_hf: Path, llama_hf: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, tuple[Path, Path]]:
    """Per mode: its source and what a plain merge of it writes."""
    base = tmp_path_factory.mktemp("q-modes")
    merge(fp8_hf, base / "dequantized", dequantize=True)
    merge(llama_hf, base / "quantized", quantize="fp8-block")
    return {"dequantize": (fp8_hf, base / "dequantized"),
            "quantize": (llama_hf, base / "quantized")}


@pytest.mark.parametrize("mode", list(QUANT_MODES))
def test_merge_all(mode: str, wanted: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    src, want = wanted[mode]
    runs = tmp_path / "run"
    for step in (100, 200):
        shutil.copytree(src, runs / f"checkpoint-{step}")
    r = invoke("merge", runs, tmp_path / "out", "--all", "--settle", "0", *QUANT_MODES[mode])
    assert r.exit_code == 0, r.output
    for step in (100, 200):
        same_model(tmp_path / "out" / f"checkpoint-{step}", want)


@pytest.mark.parametrize("mode", list(QUANT_MODES))
def test_slices_then_finish(mode: str, wanted: dict[str, tuple[Path, Path]],
                            tmp_path: Path) -> None:
    src, want = wanted[mode]
    out = tmp_path / "out"
    for i in (0, 1, 2):
        r = invoke("merge", src, out, "--slice", f"{i}/3", *QUANT_MODES[mode])
        assert r.exit_code == 0, r.output
    r = invoke("merge", src, out, "--finish", *QUANT_MODES[mode])
    assert r.exit_code == 0, r.output
    same_model(out, want)


def test_dequantize_dcp_in_slices(fp8_dcp: Path, fp8_hf: Path, wanted: dict[str, tuple[Path, Path]],
                                  tmp_path: Path) -> None:
    """A DCP training checkpoint's block FP8, decoded in two slices: the model the HF
    directory's merge writes."""
    out = tmp_path / "out"
    for i in (0, 1):
        r = invoke("merge", fp8_dcp, out, "--slice", f"{i}/2", "--dequantize",
                "--config", fp8_hf / "config.json")
        assert r.exit_code == 0, r.output
    r = invoke("merge", fp8_dcp, out, "--finish", "--dequantize", "--config",
               fp8_hf / "config.json")
    assert r.exit_code == 0, r.output
    same_model(out, wanted["dequantize"][1])


MEGATRON = Path(__file__).resolve().parents[1] / "data" / "megatron_lm"


@pytest.mark.parametrize("run_dir", ["llama-tp2", "llama-pp2", "qwen3_moe-ep2"])
def test_quantize_from_megatron(run_dir: str, tmp_path: Path) -> None:
    """Megatron-LM's own checkpoints (tensor, pipeline and expert parallel), whose weights
    are boxes of stored tensors under HF names: --quantize writes what --quantize of their
    plain merge writes."""
    src = MEGATRON / run_dir
    plain = tmp_path / "plain"
    assert invoke("merge", src, plain).exit_code == 0
    want = tmp_path / "want"
    merge(plain, want, quantize="fp8-block")
    r = invoke("merge", src, tmp_path / "out", "--quantize", "fp8-block")
    assert r.exit_code == 0, r.output
    same_model(tmp_path / "out", want)
