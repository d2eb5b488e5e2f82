"""Quantized weights (issue 39, issue 34 finding 3): scales kept as stored under every dtype
policy, ``merge --dequantize`` bit for bit against each format's reference decode, and
``merge --quantize fp8-block`` bit for bit against its formula, from a Hugging Face
directory and from DCP checkpoints (one written by FSDP2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpttool import merge
from ckpttool.cli import app
from tests.helpers import FP8, check_quantized, fp8_block_quant, save_quant_llama, weight_dequant

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def run(*args: str | Path) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


# The references in plain torch (the formula, DeepSeek-V3's weight_dequant) and the fixtures
# llama_hf, fp8_hf and fp8_dcp are shared: tests/helpers.py and tests/conftest.py.


def _scale_policy_keeps(out: Path, src: Path) -> None:
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    for name, t in a.items():
        if name.endswith("_scale_inv"):
            assert b[name].dtype == torch.float32
            assert torch.equal(b[name], t), name
        elif t.dtype == FP8:
            assert torch.equal(b[name].view(torch.uint8), t.view(torch.uint8)), name


# --- keep (issue 34 finding 3) --------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["auto", "bf16", "fp16"])
def test_scales_keep_their_dtype(fp8_hf: Path, tmp_path: Path, dtype: str) -> None:
    report = merge(fp8_hf, tmp_path / "out", dtype=dtype)
    _scale_policy_keeps(tmp_path / "out", fp8_hf)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert got["model.layers.0.mlp.up_proj.weight_scale_inv"][0, 0].item() == pytest.approx(
        0.000509229, rel=1e-7)
    assert report.bytes_after["F32"] > 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["quantization_config"]["weight_block_size"] == [128, 128]
    assert written.get("torch_dtype", written.get("dtype")) != "float32"


def test_nvfp4_global_scale_kept(tmp_path: Path) -> None:
    src = _nvfp4_dir(tmp_path, global_scale=1234.5678)
    merge(src, tmp_path / "out")  # config: torch_dtype bfloat16
    got = load_file(tmp_path / "out" / "model.safetensors")
    g = "model.layers.0.mlp.down_proj.weight_global_scale"
    assert got[g].dtype == torch.float32 and got[g].item() == pytest.approx(1234.5678, rel=1e-7)


def test_verify_refuses_a_cast_scale(fp8_hf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    state = load_file(fp8_hf / "model.safetensors")
    state = {n: t.to(torch.bfloat16) if n.endswith("_scale_inv") else t for n, t in state.items()}
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((fp8_hf / "config.json").read_text())
    for extra in ([], ["--allow-cast"]):
        result = run("verify", fp8_hf, "--against", bad, "--json", *extra)
        assert result.exit_code == 1, result.output
        codes = {p["code"] for p in json.loads(result.stdout)["problems"]}
        assert "quant-scale-cast" in codes


def test_inspect_and_verify_show_the_scheme(fp8_hf: Path, tmp_path: Path) -> None:
    result = run("inspect", fp8_hf, "--json")
    assert result.exit_code == 0, result.output
    q = json.loads(result.stdout)["summary"]["quantization"]
    assert q["method"] == "fp8-block" and q["block"] == [128, 128]
    assert q["num_quantized"] == 14 and q["unsupported"] is None
    merged = json.loads(result.stdout)["summary"]["merged"]["bytes_per_dtype"]
    assert "F32" in merged  # the scales, kept under --dtype auto (bf16)
    # A scale whose shape does not fit the block size in config.json.
    bad = tmp_path / "bad"
    bad.mkdir()
    state = load_file(fp8_hf / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(2, 2)
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((fp8_hf / "config.json").read_text())
    result = run("verify", bad, "--json")
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert any(p["code"] == "quant-config" and "up_proj" in p["message"] for p in problems)


# --- dequantize -----------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["hf", "dcp"])
def test_dequantize_block_fp8_bit_for_bit(source: str, fp8_hf: Path, fp8_dcp: Path,
                                          tmp_path: Path) -> None:
    src = fp8_hf if source == "hf" else fp8_dcp
    merge(src, tmp_path / "out", dequantize=True,
          config=fp8_hf / "config.json" if source == "dcp" else None)
    stored = load_file(fp8_hf / "model.safetensors")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert not any(n.endswith("_scale_inv") for n in got)
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == FP8:
            want = weight_dequant(t, stored[name + "_scale_inv"])
            assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), name
        else:
            assert torch.equal(got[name], t), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config


def _mxfp4_dir(tmp: Path) -> Path:
    """gpt-oss's MXFP4 layout: [E, rows, G, 16] bytes and [E, rows, G] exponents, with
    exponents from the smallest to the largest (edge values: 0, 127, 254, 255)."""
    g = torch.Generator().manual_seed(1)
    out = tmp / "mxfp4"
    out.mkdir()
    state = {
        "model.layers.0.mlp.experts.gate_up_proj_blocks":
            torch.randint(0, 256, (2, 64, 2, 16), generator=g, dtype=torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_scales":
            torch.randint(110, 135, (2, 64, 2), generator=g, dtype=torch.uint8),
        "model.layers.0.mlp.experts.down_proj_blocks":
            torch.randint(0, 256, (2, 64, 1, 16), generator=g, dtype=torch.uint8),
        "model.layers.0.mlp.experts.down_proj_scales":
            torch.randint(110, 135, (2, 64, 1), generator=g, dtype=torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(2, 64),
        "model.embed_tokens.weight": torch.randn(16, 32).to(torch.bfloat16),
    }
    state["model.layers.0.mlp.experts.gate_up_proj_scales"][0, :4, 0] = torch.tensor(
        [0, 127, 254, 255], dtype=torch.uint8)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}}))
    return out


def _as_dcp(src: Path) -> Path:
    """``src``'s tensors saved by ``torch.distributed.checkpoint.save`` (one process)."""
    out = src.with_name(src.name + "-dcp")
    torch_dcp.save({"model": load_file(src / "model.safetensors")}, checkpoint_id=out)
    return out


@pytest.mark.parametrize(("dtype", "source"), [("auto", "hf"), ("fp32", "hf"), ("auto", "dcp")])
def test_dequantize_mxfp4_as_transformers(tmp_path: Path, dtype: str, source: str) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = _mxfp4_dir(tmp_path)
    merge(src if source == "hf" else _as_dcp(src), tmp_path / "out", dequantize=True,
          dtype=dtype, config=src / "config.json")
    stored = load_file(src / "model.safetensors")
    got = load_file(tmp_path / "out" / "model.safetensors")
    target = torch.bfloat16 if dtype == "auto" else torch.float32
    for proj in ("gate_up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.{proj}"
        want = convert_moe_packed_tensors(stored[name + "_blocks"], stored[name + "_scales"],
                                          dtype=target)
        assert got[name].dtype == target and got[name].shape == want.shape
        bits = torch.int16 if target == torch.bfloat16 else torch.int32
        assert torch.equal(got[name].view(bits), want.view(bits)), name
    assert set(got) == {"model.layers.0.mlp.experts.gate_up_proj",
                        "model.layers.0.mlp.experts.down_proj",
                        "model.layers.0.mlp.experts.gate_up_proj_bias",
                        "model.embed_tokens.weight"}


def gpt_oss_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """gpt-oss' own ``_get_mxfp4_tensor`` (gpt_oss/torch/weights.py) as plain torch: the same
    decode as transformers' ``convert_moe_packed_tensors``, laid out [..., G * 32], with no
    transpose."""
    lut = torch.tensor(E2M1 + [-v for v in E2M1], dtype=dtype)
    *prefix, groups, width = blocks.shape
    flat = blocks.reshape(-1, width)
    out = torch.empty(flat.shape[0], width * 2, dtype=dtype)
    out[:, 0::2] = lut[(flat & 0x0F).int()]
    out[:, 1::2] = lut[(flat >> 4).int()]
    torch.ldexp(out, scales.reshape(-1, 1).int() - 127, out=out)
    return out.reshape(*prefix, groups * width * 2)


def test_dequantize_mxfp4_other_layouts(tmp_path: Path) -> None:
    """gpt-oss' MXFP4 as its writers store it besides [E, rows, G, 16]: transformers'
    Mxfp4 module parameter [E, rows, G * 16] (decoded as transformers decodes the 4-D
    form); one matrix [rows, G, 16] and the original release's ``X.blocks`` / ``X.scales``
    (decoded as gpt-oss' own loader: no transpose)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(5)

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8)

    experts, experts_s = u8(3, 40, 2, 16), u8(3, 40, 2, lo=110, hi=135)
    dense, dense_s = u8(300, 3, 16), u8(300, 3, lo=100, hi=140)
    orig, orig_s = u8(2, 24, 2, 16), u8(2, 24, 2, lo=115, hi=130)
    src = tmp_path / "layouts"
    src.mkdir()
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": experts.reshape(3, 40, 32),
               "model.layers.0.mlp.experts.gate_up_proj_scales": experts_s,
               "model.layers.0.self_attn.o_proj_blocks": dense,
               "model.layers.0.self_attn.o_proj_scales": dense_s,
               "block.0.mlp.mlp1_weight.blocks": orig, "block.0.mlp.mlp1_weight.scales": orig_s},
              src / "model.safetensors", metadata={"format": "pt"})
    result = run("verify", src, "--json")
    assert not [p for p in json.loads(result.stdout)["problems"]
                if p["code"] == "quant-config"], result.stdout
    merge(src, tmp_path / "out", dequantize=True, weights_only=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = {"model.layers.0.mlp.experts.gate_up_proj":
            convert_moe_packed_tensors(experts, experts_s, dtype=torch.bfloat16),
            "model.layers.0.self_attn.o_proj": gpt_oss_mxfp4(dense, dense_s),
            "block.0.mlp.mlp1_weight": gpt_oss_mxfp4(orig, orig_s)}
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        assert torch.equal(got[name].view(torch.int16), w.view(torch.int16)), name


def _nvfp4_dir(tmp: Path, global_scale: float | None = None) -> Path:
    """compressed-tensors' nvfp4-pack-quantized layout, written by its formulas: a global
    scale 448 * 6 / amax, per 16 values a float8 scale amax / 6 * global, e2m1 codes (bit 3
    the sign) two a byte, the first value in the low nibble."""
    torch.manual_seed(2)
    out = tmp / "nvfp4"
    out.mkdir()
    w = torch.randn(32, 64)
    gs = torch.tensor([448.0 * 6.0]) / w.abs().amax() if global_scale is None else \
        torch.tensor([global_scale])
    groups = w.view(32, 4, 16)
    scale = (groups.abs().amax(-1) / 6.0 * gs).to(FP8)
    eff = scale.float() / gs
    x = groups / eff.unsqueeze(-1)
    table = torch.tensor(E2M1)
    mag = (x.abs().unsqueeze(-1) - table).abs().argmin(-1)
    codes = (mag + (x < 0).long() * 8).reshape(32, 64)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    values = (table[mag] * torch.where(x < 0, -1.0, 1.0)).reshape(32, 64)
    base = "model.layers.0.mlp.down_proj"
    state = {f"{base}.weight_packed": packed, f"{base}.weight_scale": scale,
             f"{base}.weight_global_scale": gs, f"{base}.input_global_scale": torch.tensor([2.5]),
             "model.norm.weight": torch.ones(64)}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    torch.save({"values": values, "eff": eff}, tmp / "nvfp4-reference.pt")
    (out / "config.json").write_text(json.dumps({
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "compressed-tensors",
                                "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
                                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                    "num_bits": 4, "type": "float", "strategy": "tensor_group",
                                    "group_size": 16, "symmetric": True}}}}}))
    return out


@pytest.mark.parametrize("source", ["hf", "dcp"])
def test_dequantize_nvfp4(tmp_path: Path, source: str) -> None:
    src = _nvfp4_dir(tmp_path)
    merge(src if source == "hf" else _as_dcp(src), tmp_path / "out", dequantize=True,
          config=src / "config.json")
    ref = torch.load(tmp_path / "nvfp4-reference.pt")
    want = (ref["values"].view(32, 4, 16) * ref["eff"].unsqueeze(-1)).reshape(32, 64)
    got = load_file(tmp_path / "out" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(got[name].view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    assert set(got) == {name, "model.norm.weight"}


def test_dequantize_compressed_tensors_fp8(tmp_path: Path) -> None:
    torch.manual_seed(3)
    src = tmp_path / "ct-fp8"
    src.mkdir()
    w = torch.randn(48, 40)
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # per channel, as float-quantized
    q = (w / scale).to(FP8)
    base = "model.layers.0.self_attn.o_proj"
    save_file({f"{base}.weight": q, f"{base}.weight_scale": scale,
               f"{base}.input_scale": torch.tensor([0.1])}, src / "model.safetensors",
              metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}}))
    merge(src, tmp_path / "out", dequantize=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {f"{base}.weight"}
    want = (q.float() * scale).to(torch.bfloat16)
    assert torch.equal(got[f"{base}.weight"].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("configured", [True, False])
def test_dequantize_per_tensor_fp8(tmp_path: Path, configured: bool) -> None:
    """quant_method fp8 without weight_block_size: one float32 weight_scale_inv per weight
    (stored [] or [1]), and a scale grid that divides the weight; decoded as transformers'
    ``Fp8Dequantize`` decodes them (the block from the scale's grid)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(4)
    base = "model.layers.0"
    weights = {f"{base}.self_attn.q_proj": (torch.randn(48, 40), torch.tensor(0.0123)),
               f"{base}.self_attn.k_proj": (torch.randn(16, 40), torch.tensor([3.5e-4])),
               f"{base}.mlp.up_proj": (torch.randn(64, 40), torch.rand(4, 5) + 0.01)}
    state: dict[str, torch.Tensor] = {}
    for name, (w, sc) in weights.items():
        state[f"{name}.weight"] = (w / sc.max()).clamp(-448, 448).to(FP8)
        state[f"{name}.weight_scale_inv"] = sc.float()
    src = tmp_path / "fp8-tensor"
    src.mkdir()
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    if configured:
        (src / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                    "activation_scheme": "dynamic"}}))
    result = run("verify", src, "--json")
    assert not [p for p in json.loads(result.stdout)["problems"]
                if p["code"].startswith("quant-") and p["severity"] == "error"], result.stdout
    merge(src, tmp_path / "out", dequantize=True, weights_only=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {f"{n}.weight" for n in weights}
    op = Fp8Dequantize(None)
    for name in weights:
        want = op._dequantize_one(state[f"{name}.weight"], state[f"{name}.weight_scale_inv"],
                                  torch.bfloat16)
        assert torch.equal(got[f"{name}.weight"].view(torch.int16), want.view(torch.int16))


# --- quantize -------------------------------------------------------------------------------

def test_quantize_hf_bit_for_bit(llama_hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = merge(llama_hf, out, quantize="fp8-block")
    original = load_file(llama_hf / "model.safetensors")
    check_quantized(out, original)
    got = load_file(out / "model.safetensors")
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight_scale_inv"][0, 0],
                       torch.tensor(1.0))  # the zero block
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme",
                               "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}
    assert qc["modules_to_not_convert"] == ["lm_head"]
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "bfloat16"
    # the MLP's 320 rows: edge blocks, which transformers' CPU loader refuses: said so
    assert any("edge blocks" in w and "mlp" in w for w in report.warnings)


def test_quantized_loads_in_transformers(tmp_path: Path) -> None:
    """On CPU transformers reads the FP8 config and dequantizes: the weights it loads are
    DeepSeek's dequantization of what was written."""
    from transformers import AutoModelForCausalLM

    src = save_quant_llama(tmp_path, intermediate=384)
    out = tmp_path / "out"
    report = merge(src, out, quantize="fp8-block")
    assert not report.warnings
    got = load_file(out / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out)
    for i, layer in enumerate(model.model.layers):
        for proj, mod in (("mlp.down_proj", layer.mlp.down_proj),
                          ("self_attn.q_proj", layer.self_attn.q_proj)):
            name = f"model.layers.{i}.{proj}.weight"
            want = weight_dequant(got[name], got[name + "_scale_inv"])
            assert torch.allclose(mod.weight.float(), want.float(), rtol=2 ** -7, atol=0)
    original = load_file(src / "model.safetensors")
    assert torch.equal(model.lm_head.weight.to(torch.bfloat16), original["lm_head.weight"])


def test_quantize_ignore(llama_hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run("merge", llama_hf, out, "--quantize", "fp8-block", "--quantize-ignore",
                 r"model.layers.1", "--quantize-ignore", "o_proj")
    assert result.exit_code == 0, result.output
    got = load_file(out / "model.safetensors")
    assert got["model.layers.0.mlp.up_proj.weight"].dtype == FP8
    assert got["model.layers.1.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert got["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    kept = json.loads((out / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"]
    assert "model.layers.0.self_attn.o_proj" in kept and "model.layers.1.mlp.up_proj" in kept


def test_quantize_from_fsdp2_dcp(llama_ckpt: Path, tmp_path: Path) -> None:
    """From a training checkpoint written by 2 FSDP2 ranks (fp32 weights, config bf16): the
    32-wide weights are one edge block each."""
    from tests.reference import reference_state_dict

    out = tmp_path / "out"
    merge(llama_ckpt, out, quantize="fp8-block")
    ref = reference_state_dict(llama_ckpt / "pytorch_model_fsdp_0")
    original = {n.removeprefix("model."): t for n, t in ref.items()
                if isinstance(t, torch.Tensor)}
    got = load_file(out / "model.safetensors")
    for name, t in original.items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, s = fp8_block_quant(t.float())
            assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(got[name + "_scale_inv"], s), name


# --- refusals -------------------------------------------------------------------------------

def test_refusals(fp8_hf: Path, llama_hf: Path, tmp_path: Path) -> None:
    awq = tmp_path / "awq"
    awq.mkdir()
    save_file({"model.layers.0.mlp.up_proj.qweight": torch.zeros(4, 4, dtype=torch.int32),
               "model.layers.0.mlp.up_proj.scales": torch.ones(1, 4).half()},
              awq / "model.safetensors", metadata={"format": "pt"})
    (awq / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "awq", "bits": 4}}))
    result = run("merge", awq, tmp_path / "o1", "--dequantize")
    assert result.exit_code == 4 and "quant_method 'awq' is not supported yet" in result.output
    result = run("merge", fp8_hf, tmp_path / "o2", "--quantize", "fp8-block")
    assert result.exit_code == 4 and "quantized already" in result.output
    result = run("merge", llama_hf, tmp_path / "o3", "--dequantize")
    assert result.exit_code == 3 and "no quantized weight" in result.output
    result = run("merge", llama_hf, tmp_path / "o4", "--dequantize", "--quantize", "fp8-block")
    assert result.exit_code == 2
    result = run("merge", llama_hf, tmp_path / "o5", "--quantize", "int4")
    assert result.exit_code == 2
    for o in ("o1", "o2", "o3", "o4", "o5"):
        assert not (tmp_path / o / "model.safetensors").exists()


def test_expect_dtype_leaves_scales_alone(fp8_hf: Path) -> None:
    """--expect-dtype bf16 judges the model's floating weights; a float32 scale of a float8
    weight is as it must be."""
    result = run("verify", fp8_hf, "--expect-dtype", "bf16", "--json")
    problems = json.loads(result.stdout)["problems"]
    assert not [p for p in problems if "_scale_inv" in p["message"]
                and p["code"].startswith("dtype")], problems


def test_fp8_to_float_every_code() -> None:
    from ckpttool.core.transforms.quantize import fp8_to_float

    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    assert torch.equal(fp8_to_float(codes).view(torch.int32), codes.float().view(torch.int32))


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("shape", "block", "grid"), [
    ((300, 2100), (128, 128), (3, 17)),  # edge blocks both ways, three block rows per piece
    ((300, 1030), (300, 1030), (1, 1)),  # one scale for the tensor
    ((520, 1100), (1, 1100), (520, 1)),  # a scale per row (compressed-tensors channel)
])
def test_fp8_table_decode_is_the_reference(target: torch.dtype, shape: tuple[int, int],
                                           block: tuple[int, int], grid: tuple[int, int]
                                           ) -> None:
    """The table decode against ``(fp8.float() * scale[i // br, j // bc]).to(dtype)``
    element by element: every code (NaNs, -0.0, subnormals), scales from tiny to large."""
    from ckpttool.core.transforms.quantize import _fp8_by_table

    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w8 = codes.view(FP8)
    scales = torch.exp2(torch.randint(-40, 20, grid, generator=g).float()) * torch.rand(
        grid, generator=g)
    got = b"".join(bytes(p) for p in _fp8_by_table(w8, scales, block, target))
    i = torch.arange(shape[0])[:, None] // block[0]
    j = torch.arange(shape[1])[None, :] // block[1]
    want = (w8.float() * scales[i, j]).to(target)
    assert got == want.view(torch.uint8).numpy().tobytes()


def test_checks_pure() -> None:
    """quantization.check and kept_names on metadata alone."""
    from ckpttool.core import quantization as qz
    from ckpttool.formats.codecs import dtypes

    f8, f32, bf16 = dtypes.get("F8_E4M3"), dtypes.get("F32"), dtypes.get("BF16")
    stored = {"model.layers.0.mlp.up_proj.weight": (f8, (256, 128)),
              "model.layers.0.mlp.up_proj.weight_scale_inv": (f32, (2, 1)),
              "model.layers.0.mlp.down_proj.weight": (f8, (128, 256)),
              "lm_head.weight": (bf16, (10, 128)), "logit_scale": (f32, ())}
    config: dict[str, Any] = {"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.up_proj"]}}
    codes = [(p.code, p.location.tensor) for p in qz.check(config, stored)]
    assert ("quant-scale-missing", "model.layers.0.mlp.down_proj.weight") in codes
    assert ("quant-config", "model.layers.0.mlp.up_proj.weight") in codes  # ignored, quantized
    assert [p.code for p in qz.check(None, stored)].count("quant-no-config") == 1
    # A plain model's logit_scale is cast as before; a scale beside float8 is kept.
    names = [(n, d) for n, (d, _) in stored.items()]
    assert qz.kept_names(names, None) == {"model.layers.0.mlp.up_proj.weight_scale_inv"}
    assert qz.kept_names([("logit_scale", f32), ("w", bf16)], None) == frozenset()
    assert qz.matches("model.layers.11.mlp.gate", ["model.layers.*.mlp.gate"])
    assert not qz.matches("model.layers.1.mlp.gate_proj", ["model.layers.1.mlp.gate"])


def test_mxfp4_layouts_refused() -> None:
    """A stacked ``*_blocks`` of more than 4 dims (which transformers' transpose would lay out
    as no loader reads it) is refused, naming it; blocks that are no MXFP4 layout of their
    scales are bad input."""
    from types import SimpleNamespace

    from ckpttool.core.transforms.quantize import _mxfp4
    from ckpttool.errors import InputError, UnsupportedError

    def ns(*shape: int) -> Any:
        return SimpleNamespace(shape=shape)

    with pytest.raises(UnsupportedError, match="stacked layout"):
        _mxfp4("x", ns(2, 2, 3, 2, 16), ns(2, 2, 3, 2), None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="not MXFP4"):
        _mxfp4("x", ns(3, 2, 8), ns(3, 2), None)  # type: ignore[arg-type]
    assert _mxfp4("x", ns(2, 3, 2, 16), ns(2, 3, 2), None).shape == (2, 64, 3)  # type: ignore[arg-type]
    assert _mxfp4("x", ns(3, 32), ns(3, 2), None).shape == (3, 64)  # type: ignore[arg-type]
