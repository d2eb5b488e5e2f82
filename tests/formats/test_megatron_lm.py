"""Runs written by Megatron-LM's own training code (tests/data/megatron_lm/generate.py:
``initialize_megatron`` on a real command line, ``setup_model_and_optimizer``, one optimizer
step, ``save_checkpoint``), committed with their oracle: Megatron-LM's own ``load_checkpoint``
at TP=PP=EP=1 (``reference.safetensors``) and its forward pass on tokens that include the
NullTokenizer's EOD (``logits.safetensors``). No megatron-core needed here.

Each run merges with and without a config (the one derived from its ``args``), bit for bit
against the reference rearranged by plain torch, and transformers' logits of the output,
the EOD token's included, are Megatron's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.core.transforms import megatron_config
from tests.helpers import assert_bit_exact, load_out
from tests.megatron_layouts import hf_reference, mtp_logits

DATA = Path(__file__).parents[1] / "data" / "megatron_lm"
RUNS = sorted(p.name for p in DATA.iterdir() if (p / "written_by.json").is_file()) \
    if DATA.is_dir() else []
# fp32 forward passes of the same weights, Megatron's local implementation and transformers'
# (both on a CPU): they differ by summation order only.
LOGITS_ATOL = 1e-5


def run_cli(*args: object) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def _expected(run: Path, config: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The reference state dict rearranged into Hugging Face names for ``config``."""
    where = tmp / "expected"
    where.mkdir(exist_ok=True)
    shutil.copy(config, where / "config.json")
    return hf_reference(where, load_file(run / "reference.safetensors"))


def _logits_match(run: Path, out: Path) -> None:
    import transformers

    ref = load_file(run / "logits.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    vocab = model.config.vocab_size
    assert ref["tokens"].max() == vocab - 1  # the EOD id: the last row, not padding
    torch.testing.assert_close(logits, ref["logits"][..., :vocab], atol=LOGITS_ATOL, rtol=0)


# --- the vocabulary, as Megatron-LM's build_tokenizer and _vocab_size_with_padding make it ---

_ARGS = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
         "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
         "add_bias_linear": False, "make_vocab_size_divisible_by": 128}


@pytest.mark.parametrize(("tokenizer", "vocab", "padded", "expected"), [
    ("NullTokenizer", 500, 512, 501),  # --vocab-size is the size before EOD
    ("NullTokenizer", 511, 512, 512),  # EOD is the last row: nothing to cut
    ("NullMultimodalTokenizer", 500, 512, 501),
    ("TikTokenizer", 500, 512, 500),  # its --vocab-size counts every token
    ("HuggingFaceTokenizer", None, 512, 512),  # size not recorded: the padded kept
])
def test_vocabulary_is_the_tokenizers(tokenizer: str, vocab: int | None, padded: int,
                                      expected: int) -> None:
    args = {**_ARGS, "tokenizer_type": tokenizer, "vocab_size": vocab,
            "padded_vocab_size": padded}
    derived = megatron_config.derive(args, command="x")
    assert derived.config["vocab_size"] == expected
    assert bool(derived.notes) == (vocab is None)


def test_tokenizer_larger_than_the_padded_vocabulary_is_refused() -> None:
    args = {**_ARGS, "tokenizer_type": "NullTokenizer", "vocab_size": 512,
            "padded_vocab_size": 512}
    with pytest.raises(megatron_config.NotDerivable, match="a tokenizer of 513 tokens"):
        megatron_config.derive(args, command="ckpttool merge R O")


@pytest.mark.parametrize(("change", "why"), [
    ({}, None),
    ({"window_size": [128, 0]}, "sliding-window attention"),
    ({"glu_linear_offset": 0.0}, "glu_linear_offset 0.0 (gpt-oss's is 1)"),
    ({"activation_func_clamp_value": None}, "no activation clamp"),
    ({"moe_router_pre_softmax": True}, "softmax over all experts"),
    ({"add_bias_linear": False}, "no bias in the linear layers"),
    ({"moe_shared_expert_intermediate_size": 64}, "shared experts"),
])
def test_gpt_oss_is_derived_only_where_args_are_gpt_oss(change: dict[str, Any],
                                                        why: str | None) -> None:
    """The committed gpt-oss run's own args give transformers' GptOss config; each thing
    GptOss cannot hold is named instead."""
    from ckpttool.formats import megatron

    args = {**megatron.read_info(DATA / "gpt_oss-ep2").values["args"], **change}
    if why is None:
        config = megatron_config.derive(args, command="x").config
        assert config["model_type"] == "gpt_oss" and config["swiglu_limit"] == 7.0
        return
    with pytest.raises(megatron_config.NotDerivable, match="not gpt-oss as transformers") as e:
        megatron_config.derive(args, command="x")
    assert why in str(e.value)


def test_norm_epsilon_is_read_where_megatron_lm_keeps_it() -> None:
    """``--norm-epsilon`` lands in ``args.layernorm_epsilon``."""
    args = {**_ARGS, "layernorm_epsilon": 1e-6, "padded_vocab_size": 512}
    assert megatron_config.derive(args, command="x").config["rms_norm_eps"] == 1e-6
    assert megatron_config.derive({**_ARGS, "padded_vocab_size": 512}, command="x"
                                  ).config["rms_norm_eps"] == 1e-5


# --- the committed runs ---


@pytest.mark.parametrize("name", RUNS)
def test_merge_with_the_models_config_is_bit_exact(name: str, tmp_path: Path) -> None:
    run = DATA / name
    out = tmp_path / "out"
    r = run_cli("merge", run, out, "--config", run / "hf_config.json")
    assert r.exit_code == 0, r.output
    assert_bit_exact(load_out(out), _expected(run, run / "hf_config.json", tmp_path))
    shutil.copy(run / "hf_config.json", out / "config.json")
    _logits_match(run, out)


@pytest.mark.parametrize("name", RUNS)
def test_config_derived_from_args_is_the_models(name: str, tmp_path: Path) -> None:
    """No config: the one derived from Megatron-LM's args is the config transformers' class
    builds for the model (vocabulary included: the tokenizer's 501 tokens, EOD too), and the
    merge is bit exact and loads with Megatron's logits."""
    run = DATA / name
    out = tmp_path / "out"
    r = run_cli("merge", run, out, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    expected = json.loads((run / "hf_config.json").read_text())
    assert doc["derived_config"]["family"] == expected["model_type"]
    derived = json.loads((out / "config.json").read_text())
    import transformers

    cls = transformers.AutoConfig.for_model
    want = cls(**expected).to_dict()
    got = cls(**derived).to_dict()
    differ = {k: (got.get(k), want.get(k)) for k in want
              if k not in ("transformers_version", "dtype", "torch_dtype", "_name_or_path")
              and got.get(k) != want.get(k)}
    assert not differ
    assert derived["vocab_size"] == 501
    assert_bit_exact(load_out(out), _expected(run, out / "config.json", tmp_path))
    _logits_match(run, out)


@pytest.mark.parametrize("name", RUNS)
def test_inspect_and_verify(name: str) -> None:
    """``verify`` finds nothing wrong; ``inspect`` lists the optimizer state as the
    optimizer, never as model tensors."""
    run = DATA / name
    r = run_cli("verify", run)
    assert r.exit_code == 0, r.output
    r = run_cli("inspect", run, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    model = [t["name"] for t in doc["tensors"] if t["part"] == "model"]
    assert model and not [n for n in model if "optimizer" in n]
    parts = {c["part"]: c for c in doc["contents"]}
    mtp = ["mtp"] if _flag(_command(name), "--mtp-num-layers", 0) else []
    assert parts["model"]["keys"] == ["decoder", "embedding", *mtp, "output_layer"] or \
        parts["model"]["keys"] == ["decoder", "embedding", *mtp]  # tied
    if "--no-save-optim" not in _command(name):
        assert parts["optimizer"]["tensors"] > 0
        assert not [o for o in doc["non_tensor"] if "optimizer" in str(o.get("name", ""))
                    and o.get("part") == "other"]


def _command(name: str) -> str:
    return str(json.loads((DATA / name / "written_by.json").read_text())["command"])


def _flag(command: str, flag: str, default: int = 1) -> int:
    words = command.split()
    return int(words[words.index(flag) + 1]) if flag in words else default


@pytest.mark.parametrize("name", [n for n in RUNS if "--mtp-num-layers" in _command(n)])
def test_mtp_layers_compute_megatrons_mtp_logits(name: str, tmp_path: Path) -> None:
    """DeepSeek-V3's multi-token prediction layers, merged as DeepSeek-V3's checkpoints hold
    them, computed by hand from the output's tensors (transformers runs no MTP layer) give the
    logits of Megatron's own MTP block on the same tokens (EOD included), with the derived
    config (which counts them: ``num_nextn_predict_layers``)."""
    run = DATA / name
    out = tmp_path / "out"
    r = run_cli("merge", run, out, "-q")
    assert r.exit_code == 0, r.output
    ref = load_file(run / "logits.safetensors")
    found = mtp_logits(out, ref["tokens"])
    assert len(found) == _flag(_command(name), "--mtp-num-layers") == \
        sum(k.startswith("mtp_logits.") for k in ref)
    for k, logits in enumerate(found):
        torch.testing.assert_close(logits, ref[f"mtp_logits.{k}"][..., :logits.shape[-1]],
                                   atol=LOGITS_ATOL, rtol=0, msg=f"MTP layer {k}")


def _gradient(key: str, shape: tuple[int, ...], command: str) -> torch.Tensor:
    """The gradient generate.py gave the parameter ``key`` (a TP=EP=1 name), as the full
    model sees it: drawn by each rank's own parameter name and cut to the rank's rows, so a
    SwiGLU ``linear_fc1`` at TP > 1 holds each rank's [gate; up] rows, and a layer at PP > 1
    or an expert at EP > 1 the draw of its stage's or rank's own name."""
    import re
    import zlib

    tp = _flag(command, "--tensor-model-parallel-size")
    ep = _flag(command, "--expert-model-parallel-size")
    experts = _flag(command, "--num-experts", 0)
    name = key
    per_chunk = _flag(command, "--num-layers-per-virtual-pipeline-stage", _flag(
        command, "--num-layers", 2) // _flag(command, "--pipeline-model-parallel-size"))
    if (m := re.match(r"decoder\.layers\.(\d+)\.", key)) is not None:  # a stage's own index
        name = f"decoder.layers.{int(m[1]) % per_chunk}.{key[m.end():]}"
    if ".local_experts." in key:
        tp = _flag(command, "--expert-tensor-parallel-size", tp)
        expert = int(re.search(r"\.local_experts\.(\d+)\.", key)[1])  # type: ignore[index]
        local = expert % (experts // ep)
        name = name.replace(f".local_experts.{expert}.", f".local_experts.{local}.")
    g = torch.randn(shape, generator=torch.Generator().manual_seed(
        zlib.crc32(f"module.{name}".encode())))
    if key.endswith("linear_fc1.weight") and tp > 1 and "--swiglu" in command.split():
        pieces = g.chunk(tp)
        g = torch.cat([p.chunk(2)[0] for p in pieces] + [p.chunk(2)[1] for p in pieces])
    return g


# Expert TP 2 at TP 1 and EP 1: the experts share the dense buckets, each DP rank saving its
# part of a bucket from its own expert shards (see test_expert_tp_sharing_dense_buckets...).
PARTIAL_EXPERTS = "qwen3_moe-etp2"


@pytest.mark.parametrize("name", [n for n in RUNS if "--use-distributed-optimizer"
                                  in _command(n) and n != PARTIAL_EXPERTS])
def test_part_optimizer_gives_adams_state_under_hugging_face_names(name: str,
                                                                    tmp_path: Path) -> None:
    """The distributed optimizer's state, in either layout (fully_reshardable, or
    dp_reshardable's flat buckets, Megatron-LM's default): the fp32 master params equal the
    merged weights bit for bit, and Adam's moments after its one step are those of the
    gradient the generator gave each parameter (drawn by its name), each under its Hugging
    Face name: a swapped q/k, gate/up, layer or bucket place would not match."""

    run = DATA / name
    out = tmp_path / "out"
    r = run_cli("merge", run, out, "--part", "optimizer", "--config", run / "hf_config.json")
    assert r.exit_code == 0, r.output
    # the config given is the one used and written (an MTP layer's state is written: so is
    # the config's count of them)
    given = json.loads((run / "hf_config.json").read_text())
    written = json.loads((out / "config.json").read_text())
    assert "derived from Megatron's args" not in r.output
    assert {k: v for k, v in written.items() if k not in ("torch_dtype", "dtype")} == {
        k: v for k, v in given.items() if k not in ("torch_dtype", "dtype")}
    got = load_file(out / "optimizer.safetensors")
    # the router's expert bias is a buffer (set from token counts, not by the optimizer)
    weights = {k: v for k, v in load_file(run / "reference.safetensors").items()
               if not k.endswith("router.expert_bias")}
    where = tmp_path / "expected"
    where.mkdir()
    shutil.copy(run / "hf_config.json", where / "config.json")
    grads = {k: _gradient(k, tuple(v.shape), _command(name)) for k, v in weights.items()}
    want = {f"state.{k}.param": v for k, v in hf_reference(where, weights).items()}
    assert {k for k in got if k.endswith(".param")} == set(want)
    assert_bit_exact({k: v for k, v in got.items() if k.endswith(".param")}, want)
    for kind, of in (("exp_avg", lambda g: 0.1 * g), ("exp_avg_sq", lambda g: 0.001 * g * g)):
        expected = hf_reference(where, {k: of(g) for k, g in grads.items()})
        assert {k for k in got if k.endswith(f".{kind}")} == {f"state.{k}.{kind}"
                                                             for k in expected}
        for k, value in expected.items():
            torch.testing.assert_close(got[f"state.{k}.{kind}"], value, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", [n for n in RUNS if "--use-distributed-optimizer"
                                  in _command(n) and "fully-reshardable" not in _command(n)])
def test_dp_reshardable_model_merges_beside_its_optimizer(name: str, tmp_path: Path) -> None:
    r = run_cli("merge", run_dir := DATA / name, tmp_path / "out", "--part", "model", "-q")
    assert r.exit_code == 0, r.output
    assert_bit_exact(load_out(tmp_path / "out"),
                     _expected(run_dir, tmp_path / "out" / "config.json", tmp_path))


def test_dp_reshardable_layout_not_known_is_exit_4(tmp_path: Path) -> None:
    """A bucket layout that does not add up (here: args saying another transformer
    implementation, whose norms register elsewhere) is refused, never guessed."""
    from ckpttool.core.checkpoint.discover import discover, open_reader, select
    from ckpttool.core.merge import megatron_buckets
    from ckpttool.errors import UnsupportedError

    run = DATA / "llama-dp2-dist"
    ckpt = select(discover(run), "optimizer")
    assert ckpt.info is not None
    args = {**ckpt.info.values["args"], "transformer_impl": "transformer_engine"}
    named = [(t.name, t.tensor) for t in ckpt.tensors]
    with open_reader(ckpt) as reader, pytest.raises(UnsupportedError,
                                                    match="dp_reshardable layout"):
        megatron_buckets.unbucketed(megatron_buckets.model_tensors(ckpt.info.tensors), named,
                                    args, reader)


def test_args_of_megatron_lm_0_16_and_0_19_are_readable() -> None:
    """``args.exit_signal`` (``signal.SIGTERM``, Megatron-LM >= 0.16) and 0.19's
    ``InferenceCudaGraphScope`` are read as their values, by value or by name (Python 3.11),
    never looked up; another value or name is refused."""
    import pickle
    import signal

    from ckpttool.formats import megatron
    from ckpttool.formats.codecs import torchsave

    signals = megatron.common_global("signal", "Signals")
    assert signals(15) == signal.SIGTERM.value
    assert torchsave.enum_getattr(signals, "SIGTERM") == 15
    with pytest.raises(pickle.UnpicklingError):
        signals(9999)
    with pytest.raises(torchsave.Refused):
        torchsave.enum_getattr(signals, "__class__")
    scope = megatron.common_global("megatron.core.transformer.enums", "InferenceCudaGraphScope")
    assert scope is not None and scope(1) == 1
    assert megatron.common_global("signal", "signal") is None
    args = megatron.read_common(DATA / "llama-release" / "iter_0000001" / "common.pt")
    assert isinstance(args, dict) and args["args"]["exit_signal"] == 15


def test_unmapped_tensor_without_names_does_not_say_merge_without_names(
        tmp_path: Path) -> None:
    """The map a Megatron model gets unasked names a tensor it does not map: the message
    says what to pass next, not "merge without --names" (no --names was passed)."""
    config = json.loads((DATA / "llama-release" / "hf_config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))  # llama: no q/k norms
    out = tmp_path / "out"
    r = run_cli("merge", DATA / "qwen3-dp2-full", out, "--config", tmp_path / "config.json")
    assert r.exit_code == 3, r.output
    assert "--names megatron-llama: no rule maps 'decoder.layers.self_attention.k_layernorm" \
        in r.output
    assert r.output.endswith("--names none writes the stored tensors under their own names\n")
    assert "merge without --names" not in r.output
    assert not out.exists()


def test_dp_reshardable_bucket_byte_flipped_is_exit_3(tmp_path: Path) -> None:
    """The buckets' records are CRC-checked as their elements are copied out: a byte flipped
    in one stops the merge, nothing written."""
    from ckpttool.formats import megatron

    run = tmp_path / "run"
    shutil.copytree(DATA / "llama-dp2-dist", run)
    info = megatron.read_info(run)
    bucket = next(t for t in info.tensors if t.name.endswith("bucket_idx_0.exp_avg"))
    chunk = max(bucket.chunks, key=lambda c: c.length)
    with megatron.open_reader(info) as reader:
        start = reader.payload(bucket, chunk).start
    assert start is not None
    path = info.root / chunk.file
    data = bytearray(path.read_bytes())
    data[start + 1000] ^= 0x01  # in the stored elements
    path.write_bytes(bytes(data))
    r = run_cli("merge", run, tmp_path / "opt", "--part", "optimizer")
    assert r.exit_code == 3, r.output
    assert "CRC" in r.output
    assert not (tmp_path / "opt").exists()


@pytest.mark.skipif(PARTIAL_EXPERTS not in RUNS, reason="run not committed")
def test_expert_tp_sharing_dense_buckets_is_exit_4_naming_why(tmp_path: Path) -> None:
    """Megatron-LM 0.16.1 at expert TP 2, TP 1, EP 1 keeps the experts in the dense
    optimizer's buckets, and each data-parallel rank (= expert-TP rank) saves its part of a
    bucket from its own expert shards: no expert's whole state is saved. Refused, saying
    so; the model merges."""
    run = DATA / PARTIAL_EXPERTS
    r = run_cli("merge", run, tmp_path / "opt", "--part", "optimizer")
    assert r.exit_code == 4, r.output
    assert "no expert's whole state is in the checkpoint" in r.output
    assert not (tmp_path / "opt").exists()


@pytest.mark.parametrize("sizes", [(1, 3, 4), (5,), (2, 3, 4), (1, 2, 3, 5)])
def test_a_flat_range_of_a_box_is_cut_into_boxes_in_order(sizes: tuple[int, ...]) -> None:
    """Each element range of a box, cut into boxes read one after the other in C order,
    gives exactly those elements (a bucket's piece ends anywhere in a parameter)."""
    from ckpttool.core.merge.megatron_buckets import _sub_boxes

    whole = torch.arange(int(torch.tensor(sizes).prod())).reshape(sizes)
    n = whole.numel()
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            got = torch.cat([whole[tuple(slice(o, o + s) for o, s in zip(off, size,
                                                                         strict=True))]
                             .flatten() for off, size in _sub_boxes(sizes, lo, hi)])
            assert torch.equal(got, torch.arange(lo, hi)), (sizes, lo, hi)


def test_args_that_would_run_code_are_called_so(tmp_path: Path) -> None:
    """A common.pt whose args name a global that runs code (a hostile copy of a real run):
    merge without --config says the file may be malicious (exit 3), never "no args"; inspect
    says it too; nothing runs."""
    import subprocess

    run = Path(shutil.copytree(DATA / "llama-release", tmp_path / "run"))
    (run / "hf_config.json").unlink()
    common = run / "iter_0000001" / "common.pt"
    state = torch.load(common, weights_only=False)  # our own committed fixture
    state["args"].exit_signal = subprocess.run
    torch.save(state, common)
    r = run_cli("merge", run, tmp_path / "out")
    assert r.exit_code == 3, r.output
    # (pickle writes subprocess.run under its Python 2 name, commands.run)
    assert f"{run / 'iter_0000001' / 'common.pt'}: refused to read the run's args: the pickle " \
           "asks for 'commands.run', which runs code; the file may be malicious (nothing was " \
           "executed)" in r.output
    assert not (tmp_path / "out").exists()
    r = run_cli("inspect", run)
    assert "'commands.run', which runs code: the file may be malicious" in r.output, r.output
