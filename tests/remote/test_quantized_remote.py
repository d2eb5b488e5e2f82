"""Quantized weights read from an ``s3://`` source (moto's server; issue 39, item 4):
``merge s3://... --dequantize`` and ``--quantize fp8-block`` write, byte for byte, what the
same merge of the local directory writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpttool import merge
from tests.helpers import QUANT_MODES, invoke, same_model
from tests.remote.conftest import BUCKET, S3


@pytest.mark.parametrize("mode", list(QUANT_MODES))
def test_quantized_from_s3(mode: str, s3: S3, fp8_hf: Path, llama_hf: Path,
                           tmp_path: Path) -> None:
    src = fp8_hf if mode == "dequantize" else llama_hf
    url = s3.upload_dir(src, BUCKET, f"quant/{mode}")
    want = tmp_path / "want"
    if mode == "dequantize":
        merge(src, want, dequantize=True)
    else:
        merge(src, want, quantize="fp8-block")
    r = invoke("merge", url, tmp_path / "out", *QUANT_MODES[mode])
    assert r.exit_code == 0, r.output
    same_model(tmp_path / "out", want)
