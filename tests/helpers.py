"""Helpers shared by test modules: one home, so that no test module imports another
(importing a ``test_*.py`` drags its fixtures and module-level set-up along)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ckpttool.core.checkpoint.names import canonical_fqn
from ckpttool.formats.dcp import reader as dcp
from tests.reference import reference_state_dict

# dtypes a merge never casts (--dtype leaves them as stored).
NEVER_CAST = {torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.uint8, torch.int8,
              torch.int16, torch.int32, torch.int64}
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
               torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL",
               torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def load_out(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a merged safetensors output (one file or an index and shards)."""
    index = out / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    result: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(out / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert key not in result
                result[key] = f.get_tensor(key)
    return result


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaNs and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def expected(dcp_dir: Path, cast_to: torch.dtype | None) -> dict[str, torch.Tensor]:
    """What a merge of ``dcp_dir`` must hold, by PyTorch's own DCP loader, under canonical
    names (cast to ``cast_to`` where a merge casts)."""
    info = dcp.read_info(dcp_dir)
    paths = {t.name: t.path for t in info.tensors}
    ref = reference_state_dict(dcp_dir)
    out = {}
    for key, path in paths.items():
        t = ref[key]
        assert isinstance(t, torch.Tensor)
        if cast_to is not None and t.is_floating_point() and t.dtype not in NEVER_CAST:
            t = t.to(cast_to)
        out[canonical_fqn(path)] = t
    return out


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                     *, cast: bool = False) -> None:
    """Every byte equal. After a cast, NaNs only need to stay NaN: PyTorch's own f64 -> bf16
    kernel gives a NaN 0x7FC0 in its scalar tail and 0xFFFF in its vector loop, so the bit
    pattern of a cast NaN depends on where it falls, not on its value."""
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype, name
        assert tuple(g.shape) == tuple(t.shape), name
        if cast and t.is_floating_point() and t.element_size() > 1:
            nan = torch.isnan(t)
            assert torch.equal(torch.isnan(g), nan), f"{name}: NaNs moved"
            assert torch.equal(bits(g[~nan]), bits(t[~nan])), f"{name} differs"
        else:
            assert torch.equal(bits(g), bits(t)), f"{name} differs"


def as_table(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], str, int]]:
    """Name -> (shape, safetensors dtype, bytes) of real tensors."""
    return {k: (list(v.shape), DTYPE_NAMES[v.dtype], v.numel() * v.element_size())
            for k, v in tensors.items()}


def json_table(doc: dict[str, Any]) -> dict[str, tuple[list[int], str, int]]:
    """The same table from an ``inspect --json`` document."""
    return {t["name"]: (t["shape"], t["dtype"], t["bytes"]) for t in doc["tensors"]}


class RunsCommand:
    """A pickle that runs ``command`` when loaded (hostile input: it must never run)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


def write_malicious(directory: Path, sentinel: Path) -> Path:
    """A DCP directory whose ``.metadata`` would create ``sentinel`` if it were unpickled."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {sentinel}")))
    (directory / "__0_0.distcp").write_bytes(b"\0" * 64)
    return directory


def same_inspect(url: str, local: Path) -> None:
    """``inspect --json`` of the remote checkpoint ``url`` is that of its local copy (the
    paths aside)."""
    from typer.testing import CliRunner

    from ckpttool.cli import app

    a = CliRunner().invoke(app, ["inspect", url, "--json"])
    b = CliRunner().invoke(app, ["inspect", str(local), "--json"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    da, db = json.loads(a.stdout.replace(url, str(local))), json.loads(b.stdout)
    da.pop("seconds", None), db.pop("seconds", None)
    assert da == db
