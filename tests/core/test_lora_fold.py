"""The LoRA fold block by block of rows (``fold.row_blocks``, ``fold.blocks_exact``): a bf16
model with an fp32 adapter, both saved by their own writers (transformers' and PEFT's
``save_pretrained``), folded with ``--adapter`` and compared bit for bit with PEFT's own
``merge_and_unload()`` of the same files, with blocks of every size down to one row.

Tolerance: none. PEFT adds the fp32 product (times the scale) to the bf16 weight in fp32 and
rounds once; the fold does the same operations per element, a block of rows at a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpttool
from ckpttool.core.transforms.lora import fold, layout

pytestmark = pytest.mark.filterwarnings("ignore")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 176, 1000, 5632])
@pytest.mark.parametrize("cols", [1, 64, 176, 2048, 1 << 20])
def test_row_blocks_tile_the_rows(rows: int, cols: int) -> None:
    bounds = fold.row_blocks(rows, cols)
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]
    assert bounds[0] == 0 and bounds[-1] == rows and sum(sizes) == rows
    assert max(sizes) - min(sizes) <= 1  # no short last block
    assert len(sizes) == 1 or min(sizes) >= fold.FOLD_ROWS
    if len(sizes) > 1:  # about FOLD_BLOCK elements, never under FOLD_ROWS rows
        assert min(sizes) * cols <= 2 * max(fold.FOLD_BLOCK, fold.FOLD_ROWS * cols)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A bf16 Llama saved by transformers and an fp32 rank-8 adapter on every projection saved
    by PEFT (lora_B non-zero, so that the fold changes the weights)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    work = tmp_path_factory.mktemp("bf16-lora")
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         dtype="bfloat16")
    torch.manual_seed(11)
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    base.save_pretrained(work / "base")
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = torch.randn(p.shape, dtype=torch.float32) * 0.05
    model.save_pretrained(work / "adapter")
    return work / "base", work / "adapter"


@pytest.fixture(scope="module")
def peft_merged(bf16_model: tuple[Path, Path]) -> dict[str, torch.Tensor]:
    """What a user gets from PEFT: the base loaded in bf16, the adapter on it, merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir = bf16_model
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    return {k: v.clone() for k, v in merged.state_dict().items()}


@pytest.mark.parametrize(("block", "min_rows"), [
    (fold.FOLD_BLOCK, fold.FOLD_ROWS),  # one block per weight at these widths
    (2048, fold.FOLD_ROWS),  # 2 to 5 blocks per weight, of uneven sizes
    (1, 1),  # one row per block: torch.mm may give other bits; the check must catch it
])
def test_bf16_fold_equals_peft_merge_and_unload(
        bf16_model: tuple[Path, Path], peft_merged: dict[str, torch.Tensor], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, block: int, min_rows: int) -> None:
    base_dir, adapter_dir = bf16_model
    monkeypatch.setattr(fold, "FOLD_BLOCK", block)
    monkeypatch.setattr(fold, "FOLD_ROWS", min_rows)
    report = ckpttool.merge(base_dir, tmp_path / "out", adapter=adapter_dir)
    assert report.lora is not None and report.lora.fused == 2 * len(TARGETS)
    got = load_file(tmp_path / "out" / "model.safetensors")
    before = load_file(base_dir / "model.safetensors")
    assert set(got) == set(peft_merged)
    for name, want in peft_merged.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], want), name
    changed = [n for n in got if not torch.equal(got[n], before[n])]
    assert len(changed) == 2 * len(TARGETS)


def test_blocks_exact_says_whether_every_block_has_the_whole_products_bits() -> None:
    torch.manual_seed(3)
    b, a = torch.randn(40, 16), torch.randn(16, 64)
    whole = b @ a
    for bounds in ([0, 20, 40], [0, 13, 26, 40], list(range(41))):
        truth = all(torch.equal(b[lo:hi] @ a, whole[lo:hi])
                    for lo, hi in zip(bounds, bounds[1:], strict=False))
        assert fold.blocks_exact(b, a, bounds) is truth


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("scale", [1.0, 2.0, 4.0, 1024.0])
@pytest.mark.parametrize("seed", range(4))
def test_a_fused_power_of_two_scale_has_the_bits_of_scaling_then_adding(
        scale: float, seed: int) -> None:
    """Where ``fma_exact`` allows it, ``w + d * scale`` in one fused pass equals PEFT's two
    roundings bit for bit, on weights with zeros of both signs, subnormals, infinities and
    NaNs, and products that reach the subnormal range and cancel."""
    g = torch.Generator().manual_seed(seed)
    rank, rows, cols = 16, 64, 96
    a = torch.randn(rank, cols, generator=g) * 10.0 ** torch.randint(-30, 3, (rank, cols),
                                                                      generator=g)
    b = torch.randn(rows, rank, generator=g) * 10.0 ** torch.randint(-30, 3, (rows, rank),
                                                                      generator=g)
    a[0, :8] = 1e-45  # the smallest subnormal, and products that round to zero
    b[:4, 1] = -1e-40
    w = torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(-40, 5, (rows, cols),
                                                                      generator=g)
    w[0, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-44])
    d = b @ a
    assert fold.fma_exact(scale, a, b)
    assert torch.equal(_bits(torch.add(w, d, alpha=scale)), _bits(w + d * scale))
    # as the fold rounds a bf16 output from the sum
    assert torch.equal(torch.add(w, d, alpha=scale).bfloat16().view(torch.int16),
                       (w + d * scale).bfloat16().view(torch.int16))


def test_fma_exact_refuses_other_scales_and_what_could_overflow_or_meet_a_nan() -> None:
    a, b = torch.ones(4, 8), torch.ones(8, 4)
    for scale in (0.5, 0.25, 3.0, 0.75, 2 / 4**0.5 * 1.5, 8 / 16**0.5 + 1e-9):
        assert not fold.fma_exact(scale, a, b), scale
    assert fold.fma_exact(2.0, a, b)
    assert not fold.fma_exact(2.0, a * 2.0**60, b * 2.0**64)  # 4 * 2**124 * 2 >= 2**126
    assert fold.fma_exact(2.0, a * 2.0**60, b * 2.0**62)
    for bad in (float("inf"), float("nan")):
        c = a.clone()
        c[1, 2] = bad
        assert not fold.fma_exact(2.0, c, b) and not fold.fma_exact(2.0, a, c.T)
    assert not fold.fma_exact(2.0, torch.ones(4, 0), torch.ones(0, 4))
    tiny = torch.full((4, 8), 1e-30)
    assert fold.fma_exact(2.0**127, tiny, tiny.T)
    assert not fold.fma_exact(2.0**128, tiny, tiny.T)  # no float32: torch refuses the alpha


@pytest.mark.parametrize("weight", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 2.0, 0.5, 1.5, 2.0**20])
@pytest.mark.parametrize("transpose", [False, True])
def test_the_fold_piece_by_piece_has_peft_s_bits(weight: torch.dtype, scale: float,
                                                  transpose: bool) -> None:
    """``_fused_weight``'s pieces (what a merge writes), fused or not, as float32, bf16 and
    the weight's dtype, against PEFT's order (``w + (b @ a) * scale`` in float32, then the
    cast), on values from 2**-140 to 2**40, zeros of both signs, infinities and NaNs in the
    weight (a NaN with a payload of its own), and a NaN in the adapter."""
    from ckpttool.formats.base import Chunk, Tensor
    from ckpttool.formats.codecs.dtypes import BY_TORCH_NAME

    g = torch.Generator().manual_seed(int(scale * 7) + transpose + weight.itemsize)
    rank, rows, cols = 4, 40, 24

    def wide(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 2.0 ** torch.randint(-140, 40, shape,
                                                                        generator=g).float()

    a, b = wide(rank, cols), wide(rows, rank)
    w = wide(*((cols, rows) if transpose else (rows, cols))).to(weight)
    w.view(-1)[:4] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")]).to(weight)
    if weight == torch.float32:
        w.view(torch.int32).view(-1)[0] = 0x7FC00123
    for nan_in_adapter in (False, True):
        if nan_in_adapter:
            a[0, 0] = float("nan")

        def meta(t: torch.Tensor, name: str) -> Tensor:
            return Tensor(name, (name,), BY_TORCH_NAME[str(t.dtype).removeprefix("torch.")],
                          tuple(t.shape), (
                Chunk((0,) * t.dim(), tuple(t.shape), "f", 0, t.numel() * t.itemsize),))

        m = layout.Module("x", embedding=transpose, a=meta(a, "x.lora_A.weight"),
                        b=meta(b, "x.lora_B.weight"))
        config = layout.AdapterConfig(rank, scale * rank, False, False, {}, {}, False, (), None,
                                    "test")
        derived = fold.fused_weight("x.weight", meta(w, "x.weight"), m, config, None)
        assert derived.pieces is not None
        d = b @ a
        want32 = w.float() + (d.T if transpose else d) * scale  # PEFT's order
        for target in (torch.float32, torch.bfloat16, weight):
            got = torch.frombuffer(bytearray(b"".join(
                bytes(p) for p in derived.pieces([w, a, b], target))), dtype=target)
            want = want32.to(target).reshape(-1)
            assert torch.equal(got.view(_int(target)), want.view(_int(target))), \
                (target, nan_in_adapter)


def _int(dtype: torch.dtype) -> torch.dtype:
    return torch.int16 if dtype.itemsize == 2 else torch.int32
