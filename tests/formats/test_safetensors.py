from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpttool import units
from ckpttool.errors import InputError
from ckpttool.formats import safetensors as st
from ckpttool.formats.codecs import dtypes


def test_layout_is_read_by_the_safetensors_library(tmp_path: Path) -> None:
    tensors = {
        "b": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "a": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
        "empty": torch.empty(0, 4, dtype=torch.float16),
    }
    lay = st.layout([(n, dtypes.BY_TORCH_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape))
                     for n, t in tensors.items()])
    data = bytearray(lay.header) + bytearray(lay.file_size - len(lay.header))
    for slot in lay.slots:
        raw = tensors[slot.name].reshape(-1).view(torch.uint8).numpy().tobytes()
        data[slot.begin : slot.end] = raw
        assert slot.begin % slot.dtype.itemsize == 0
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(data))
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t)
    meta, slots = st.read_layout(path)
    assert meta == {"format": "pt"} and {s.name for s in slots} == set(tensors)


@pytest.mark.parametrize(("text", "n"), [("5GB", 5 * 10**9), ("500MB", 5 * 10**8),
                                          ("2GiB", 2 * 2**30), ("1024", 1024), ("1.5kb", 1500)])
def test_parse_size(text: str, n: int) -> None:
    assert units.parse_size(text) == n


def test_parse_size_rejects_garbage() -> None:
    with pytest.raises(InputError, match="invalid size 'lots'"):
        units.parse_size("lots")


def test_shard_names() -> None:
    assert st.shard_names(1) == ["model.safetensors"]
    assert st.shard_names(2) == ["model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('"x"', "header entry is not an object"),
        ('{"dtype": 3, "shape": [1], "data_offsets": [0, 4]}', "unknown dtype 3"),
        ('{"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}', "invalid shape '1'"),
        ('{"dtype": "F32", "shape": [1], "data_offsets": [0]}', "invalid data_offsets [0]"),
        ('{"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}',
         "span 4 bytes but F32 [2] needs 8"),
    ],
)
def test_mangled_headers_are_input_errors(tmp_path: Path, entry: str, message: str) -> None:
    import struct

    text = ('{"t": ' + entry + "}").encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
    with pytest.raises(InputError) as e:
        st.read_layout(path)
    assert message in str(e.value)


@pytest.mark.parametrize("file", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors",
                                  "..", ""])
def test_index_never_points_outside_its_directory(tmp_path: Path, file: str) -> None:
    import json

    (tmp_path / st.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": file}}))
    with pytest.raises(InputError, match="not a file name in this directory"):
        st.read_info(tmp_path)
