"""verify's value checks from the bit patterns (core/values.py): the same NaN, Inf and all-zero
findings as torch's (core/inspect.py's Stats), for every dtype, however the bytes are split
into blocks; and no ``import torch`` where they need none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.core import values
from ckpttool.core.values import Stats
from ckpttool.formats.codecs.dtypes import BY_NAME, DType

DTYPES = [d.name for d in BY_NAME.values() if d.kind != "complex"]
SPECIAL = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1.0, -2.5,
           1e-40, -1e-45, 6e-8, 65504.0, 3e38, -3e38, 448.0]


def _specials(dtype: DType) -> list[bytes]:
    """Each special value as torch stores it in ``dtype`` (NaN and Inf where it has them)."""
    t = getattr(torch, dtype.torch_name)
    if dtype.kind == "bool":
        return [b"\x00", b"\x01"]
    if dtype.kind == "int":
        return [bytes(dtype.itemsize), b"\x01" + bytes(dtype.itemsize - 1)]
    return [bytes(torch.tensor([v], dtype=torch.float64).to(t).view(torch.uint8).tolist())
            for v in SPECIAL]


def _reference(dtype: DType, data: bytes) -> tuple[int, int, bool | None]:
    stats = Stats(dtype, full=False)
    stats.update(bytearray(data))
    r = stats.result()
    return r.nan, r.inf, r.all_zero


@pytest.mark.parametrize("name", DTYPES)
@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_findings_match_torch_in_any_blocks(name: str, data: st.DataObject) -> None:
    dtype = BY_NAME[name]
    specials = _specials(dtype)
    item = dtype.itemsize
    element = st.one_of(st.sampled_from(specials),
                        st.binary(min_size=item, max_size=item) if dtype.kind != "bool"
                        else st.sampled_from(specials))
    stored = b"".join(data.draw(st.lists(element, max_size=40)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stored)), max_size=5)))
    check = values.check(dtype)
    if isinstance(check, values._Bits):
        check._GATHER = data.draw(st.sampled_from([1, 3, 16, 1 << 20]))  # gathered or not
    for lo, hi in zip([0, *cuts], [*cuts, len(stored)], strict=True):
        check.update(memoryview(bytearray(stored[lo:hi])))
    got = check.result()
    assert (got.nan, got.inf, got.all_zero) == _reference(dtype, stored)


def test_ieee_and_integer_dtypes_need_no_torch() -> None:
    for name in ("F64", "F32", "F16", "BF16", "I64", "I8", "U8", "BOOL"):
        assert not values.needs_torch(BY_NAME[name]), name
    assert values.needs_torch(BY_NAME["F8_E4M3"])  # its special values are its own


def _values_ckpt(tmp_path: Path) -> Path:
    w = torch.randn(64, 32).to(torch.bfloat16)
    w[3, 4], w[10, 0], w[20, 31] = float("nan"), float("inf"), -float("inf")
    h = torch.randn(1000, dtype=torch.float32)
    h[::100] = float("nan")
    state = {"w": w, "h": h, "z": torch.zeros(128, 16), "neg_zero": -torch.zeros(7),
             "ids": torch.zeros(5, dtype=torch.int64)}
    out = tmp_path / "ckpt"
    torch_dcp.save({"model": state}, checkpoint_id=out, no_dist=True)
    return out


@pytest.mark.parametrize("numpy", [True, False])
def test_verify_finds_nan_inf_and_zeros_without_torch(numpy: bool, tmp_path: Path) -> None:
    """With numpy, torch is never imported; without it, torch finds the same."""
    ckpt = _values_ckpt(tmp_path)
    code = ("import sys\n"
            + ("" if numpy else "sys.modules['numpy'] = None  # as without numpy\n")
            + "import ckpttool\n"
            f"r = ckpttool.verify({str(ckpt)!r})\n"
            "print(sorted((p.code, p.location.tensor, p.message.split(' holds ')[-1])\n"
            "             for p in r.problems if p.severity == 'warning'))\n"
            f"assert ('torch' in sys.modules) == {not numpy}, 'torch imported or not'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(sorted([
        ("all-zero", "ids", "tensor 'ids' is entirely zero"),
        ("all-zero", "neg_zero", "tensor 'neg_zero' is entirely zero"),
        ("all-zero", "z", "tensor 'z' is entirely zero"),
        ("inf", "w", "2 infinite values (of 2048)"),
        ("nan", "h", "10 NaN values (of 1000)"),
        ("nan", "w", "1 NaN values (of 2048)"),
    ]))
