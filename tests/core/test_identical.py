"""``tensors.identical``: a small head of the two tensors compared first (two different
weights differ there), then block by block; the verdict is the same wherever they differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpttool.core.checkpoint import tensors
from ckpttool.core.checkpoint.discover import discover, open_reader


@pytest.mark.parametrize("where", [None, 0, 100, tensors.HEAD_BYTES // 2 - 1,
                                   tensors.HEAD_BYTES // 2, 70_000, 3 * 65_536 - 1])
@pytest.mark.parametrize("block", [1 << 10, tensors.BLOCK_BYTES])
def test_identical_finds_a_difference_anywhere(tmp_path: Path, where: int | None,
                                               block: int) -> None:
    a = (torch.arange(3 * 65_536, dtype=torch.int32) % 30_000).to(torch.int16)
    b = a.clone()
    if where is not None:
        b[where] += 1
    save_file({"a": a, "b": b, "short": a[:10].clone(), "short2": a[:10].clone()},
              tmp_path / "m.safetensors")
    ckpt = discover(tmp_path / "m.safetensors", command="merge")
    found = {t.name: t.tensor for t in ckpt.tensors}
    with open_reader(ckpt) as reader:
        same = tensors.identical(reader, found["a"], reader, found["b"], block_bytes=block)
        assert same is (where is None)
        assert tensors.identical(reader, found["short"], reader, found["short2"])
