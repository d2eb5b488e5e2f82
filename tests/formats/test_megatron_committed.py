"""Megatron-Core runs that cannot be written at test time, committed with their generator
(tests/data/megatron/generate.py, written on a GPU): DeepSeek-V3 (megatron-core 0.16.1 builds
multi-latent attention on a CUDA device only) and a run of megatron-core 0.19.2 (Python 3.12),
which stores the common state as the DCP bytes entry ``common_state/shard_0_1``. Each is merged
bit for bit against Megatron's own loaded state dict (``reference.safetensors``, rearranged
here by plain torch), and transformers' forward pass of the merged output matches Megatron's
(``logits.safetensors``). No megatron-core needed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.core.transforms import namemaps
from ckpttool.formats import megatron
from ckpttool.formats.base import Tensor
from ckpttool.formats.codecs.dtypes import DType
from tests.helpers import assert_bit_exact, load_out
from tests.megatron_layouts import MEGATRON, deepseek_v3_reference, hf_reference, mtp_logits

DATA = Path(__file__).parents[1] / "data" / "megatron"
DEEPSEEK = ["deepseek_v3-tp2", "deepseek_v3-ep2", "deepseek_v3-mtp", "deepseek_v3-mtp2",
            "deepseek_v3-pp2", "deepseek_v3-yarn"]
MTP = DATA / "deepseek_v3-mtp"  # mtp_num_layers 1 after 2 decoder layers, TP 2
# mtp_num_layers 2 (EP 2); PP 2 with the MTP layer on the last stage
MTP_RUNS = ["deepseek_v3-mtp", "deepseek_v3-mtp2", "deepseek_v3-pp2"]
YARN = DATA / "deepseek_v3-yarn"  # YaRN as MLA's default (rope_type unset in args), TP 2
COMMON_STATE = DATA / "llama-common_state"

# fp32 forward passes of the same weights: Megatron's on an H200 (TF32 off), transformers'
# on the CPU here. Seen: at most 1.8e-7 on logits of magnitude up to 0.44.
LOGITS_ATOL = 1e-5


def run_cli(*args: object) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def deepseek_reference(run: Path) -> dict[str, torch.Tensor]:
    """What a merge of a DeepSeek-V3 ``run`` must write, bit for bit: Megatron's own loaded
    state dict rearranged into transformers' DeepseekV3 names with plain torch
    (:func:`tests.megatron_layouts.deepseek_v3_reference`)."""
    config = json.loads((run / "config.json").read_text())
    return deepseek_v3_reference(config, load_file(run / "reference.safetensors"))


def _with_config(run: Path, tmp: Path) -> Path:
    """``run``'s reference beside the config.json the merge into ``tmp / "out"`` wrote."""
    where = tmp / "expected"
    where.mkdir()
    shutil.copy(tmp / "out" / "config.json", where / "config.json")
    (where / "reference.safetensors").symlink_to(run / "reference.safetensors")
    return where


def common_state_reference() -> dict[str, torch.Tensor]:
    return hf_reference(COMMON_STATE, load_file(COMMON_STATE / "reference.safetensors"))


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, tuple[Path, ckpttool.MergeReport]]:
    out = tmp_path_factory.mktemp("megatron-committed")
    return {name: (out / name, ckpttool.merge(DATA / name, out / name))
            for name in (*DEEPSEEK, COMMON_STATE.name)}


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_v3_merge_is_bit_exact_against_megatrons_own_state(
        name: str, merged: dict[str, tuple[Path, ckpttool.MergeReport]]) -> None:
    out, report = merged[name]
    assert report.format == "megatron"
    assert report.name_map is not None and report.name_map.map == "megatron-deepseek_v3"
    assert_bit_exact(load_out(out), deepseek_reference(DATA / name))


@pytest.mark.parametrize("name", [*DEEPSEEK, COMMON_STATE.name])
def test_transformers_logits_match_megatrons_forward(
        name: str, merged: dict[str, tuple[Path, ckpttool.MergeReport]]) -> None:
    import transformers

    ref = load_file(DATA / name / "logits.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(merged[name][0],
                                                              dtype=torch.float32)
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    assert logits.shape[-1] == json.loads((DATA / name / "config.json").read_text())[
        "vocab_size"]
    torch.testing.assert_close(logits, ref["logits"][..., :logits.shape[-1]],
                               atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_v3_config_derived_from_args(name: str, tmp_path: Path) -> None:
    """Without a config.json, DeepSeek-V3's is derived from the run's args (MLA, shared
    experts, sigmoid routing; first_k_dense_replace from moe_layer_freq): the same tensors,
    and transformers' logits still Megatron's."""
    import transformers

    run = tmp_path / "run"
    shutil.copytree(DATA / name, run, ignore=shutil.ignore_patterns("config.json"))
    r = run_cli("merge", run, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    doc = json.loads(r.stdout)  # type: ignore[attr-defined]
    assert doc["derived_config"]["family"] == "deepseek_v3"
    assert doc["name_map"]["map"] == "megatron-deepseek_v3"
    want = json.loads((DATA / name / "config.json").read_text())
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("q_lora_rank", "first_k_dense_replace", "n_shared_experts",
                "routed_scaling_factor", "qk_nope_head_dim", "v_head_dim"):
        assert got[key] == want[key], key
    assert got["num_nextn_predict_layers"] == want.get("num_nextn_predict_layers", 0)
    # args hold the NullTokenizer's vocab_size 50, the size before EOD: 51 tokens
    assert got["vocab_size"] == want["vocab_size"] + 1
    assert_bit_exact(load_out(tmp_path / "out"),
                     deepseek_reference(_with_config(DATA / name, tmp_path)))
    ref = load_file(DATA / name / "logits.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float32)
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"][..., :logits.shape[-1]],
                               atol=LOGITS_ATOL, rtol=0)


def test_deepseek_v3_inspect_shows_the_layout() -> None:
    for name, layout in (("deepseek_v3-tp2", "TP 2 x PP 1 x EP 1; 3 layers, 64 hidden"),
                         ("deepseek_v3-mtp", "TP 2 x PP 1 x EP 1; 2 layers, 64 hidden"),
                         ("deepseek_v3-ep2", "TP 1 x PP 1 x EP 2; 2 layers, 64 hidden"),
                         ("deepseek_v3-pp2", "TP 1 x PP 2 x EP 1; 2 layers, 64 hidden"),
                         ("deepseek_v3-mtp2", "TP 1 x PP 1 x EP 2; 2 layers, 64 hidden")):
        r = run_cli("inspect", DATA / name)
        assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
        assert f"Megatron-Core torch_dist; iteration 2; {layout}" in r.stdout  # type: ignore[attr-defined]
    r = run_cli("inspect", MTP)
    assert "64 vocab (padded), 1 MTP layers" in r.stdout  # type: ignore[attr-defined]
    r = run_cli("inspect", DATA / "deepseek_v3-mtp2")
    assert "64 vocab (padded), 2 MTP layers" in r.stdout  # type: ignore[attr-defined]


def test_deepseek_v3_config_of_another_model_is_exit_3_before_writing(tmp_path: Path) -> None:
    """The TP=2 run has q_lora_rank 32 (q_down/q_up projections); a config without one
    (a plain q_proj) does not describe it."""
    config = json.loads((DATA / "deepseek_v3-tp2" / "config.json").read_text())
    config["q_lora_rank"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    r = run_cli("merge", DATA / "deepseek_v3-tp2", out, "--config", tmp_path / "config.json")
    assert r.exit_code == 3, r.output  # type: ignore[attr-defined]
    assert "'decoder.layers.0.self_attention.linear_q_down_proj.weight': " in r.output  # type: ignore[attr-defined]
    assert "has no 'q_lora_rank'" in r.output  # type: ignore[attr-defined]
    assert not out.exists()


@pytest.mark.parametrize("name", MTP_RUNS)
def test_mtp_layers_compute_megatrons_mtp_logits(
        name: str, merged: dict[str, tuple[Path, ckpttool.MergeReport]]) -> None:
    """The MTP layers' meaning, not only their bytes: DeepSeek-V3's MTP modules computed by hand
    from the merged tensors under their Hugging Face names (transformers' own decoder layer
    and RMSNorm) give the logits of Megatron's MTP layers (``mtp_logits.k``, its forward on the
    same tokens). Layer ``k`` is ``eh_proj([enorm(embed(tokens shifted k + 1)); hnorm(h)])``,
    then its decoder layer, then ``shared_head``, where ``h`` is the main model's last hidden
    state (after its final norm) for ``k = 0`` and layer ``k - 1``'s output after its
    ``shared_head.norm`` after that, as Megatron chains them; Megatron's shifted input ends in
    token 0, as here. Covers one MTP layer, two, and one on the last of two pipeline stages."""
    run = DATA / name
    ref = load_file(run / "logits.safetensors")
    found = mtp_logits(merged[name][0], ref["tokens"])
    assert len(found) == sum(k.startswith("mtp_logits.") for k in ref)
    for k, logits in enumerate(found):
        torch.testing.assert_close(logits, ref[f"mtp_logits.{k}"][..., :logits.shape[-1]],
                                   atol=LOGITS_ATOL, rtol=0, msg=f"MTP layer {k}")


def test_pipeline_parallel_mtp_run_stores_the_embedding_once() -> None:
    """At PP 2 the last stage keeps its own copy of the embedding for the MTP layer, tied to
    the first stage's: Megatron saves one global tensor, and the merge writes the model's
    embedding once plus the MTP layer's copy of it (equal)."""
    info = megatron.read_info(DATA / "deepseek_v3-pp2")
    assert [t.name for t in info.tensors].count("embedding.word_embeddings.weight") == 1
    assert info.values["args"]["pipeline_model_parallel_size"] == 2


def test_yarn_config_derived_from_args_is_megatrons_yarn(tmp_path: Path) -> None:
    """DeepSeek-V3's Megatron-LM recipes leave --rope-type unset, and MLA then takes YaRN:
    the derived config says so, with every YaRN parameter from args (each off its default in
    the run), and transformers' logits are Megatron's. A config.json with RoPE instead, or with
    mscale and mscale_all_dim swapped, is further off than the tolerance (seen: 4e-4, 6e-5)."""
    import transformers

    args = megatron.read_info(YARN).values["args"]
    assert args["rope_type"] is None and args["multi_latent_attention"]
    run = tmp_path / "run"
    shutil.copytree(YARN, run, ignore=shutil.ignore_patterns("config.json"))
    r = run_cli("merge", run, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    assert got["rope_parameters"] == {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 2048, "beta_fast": 64.0, "beta_slow": 2.0,
        "mscale": 0.9, "mscale_all_dim": 0.8}
    ref = load_file(YARN / "logits.safetensors")
    for rope, close in ((None, True), ({"rope_type": "default", "rope_theta": 10000.0}, False),
                        ({**got["rope_parameters"], "mscale": 0.8, "mscale_all_dim": 0.9},
                         False)):
        config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
        if rope is not None:
            config.rope_parameters = rope
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "out", config=config, dtype=torch.float32)
        with torch.no_grad():
            logits = model(ref["tokens"]).logits
        off = (logits - ref["logits"][..., :logits.shape[-1]]).abs().max().item()
        assert (off <= LOGITS_ATOL) == close, (rope, off)


def test_mtp_sets_num_nextn_predict_layers_in_config(tmp_path: Path) -> None:
    """config.json says how many MTP layers were written (what vLLM and SGLang read), also
    when the given config lacks it or says another number."""
    config = json.loads((MTP / "config.json").read_text())
    del config["num_nextn_predict_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run_cli("merge", MTP, tmp_path / "out", "--config", tmp_path / "config.json")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert "num_nextn_predict_layers: None -> 1" in r.output  # type: ignore[attr-defined]
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    assert got["num_nextn_predict_layers"] == 1
    # A run without MTP under DeepSeek-V3's own config (num_nextn_predict_layers 1): 0 written.
    config = json.loads((DATA / "deepseek_v3-ep2" / "config.json").read_text())
    (tmp_path / "c2").mkdir()
    (tmp_path / "c2" / "config.json").write_text(
        json.dumps({**config, "num_nextn_predict_layers": 1}))
    r = run_cli("merge", DATA / "deepseek_v3-ep2", tmp_path / "o2", "--config", tmp_path / "c2")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    got = json.loads((tmp_path / "o2" / "config.json").read_text())
    assert got["num_nextn_predict_layers"] == 0


def test_mtp_with_a_config_of_fewer_layers_is_exit_3(tmp_path: Path) -> None:
    """A config.json of 1 layer for a run of 2 layers and 1 MTP layer: the MTP layer would
    land on the decoder's layer 1: refused, naming why, before anything is written."""
    config = json.loads((MTP / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    out = tmp_path / "out"
    r = run_cli("merge", MTP, out, "--config", tmp_path / "config.json")
    assert r.exit_code == 3, r.output  # type: ignore[attr-defined]
    assert "says num_hidden_layers 1, fewer than the checkpoint's decoder layers" in r.output  # type: ignore[attr-defined]
    assert not out.exists()


def test_multi_token_prediction_layers_of_other_families_are_exit_4() -> None:
    """MTP layers in a family whose Hugging Face model has no place for them (only
    DeepSeek-V3's has): refused by name, not called a foreign checkpoint."""
    f32 = DType("F32", "float32", 4, "float")
    tensors = [(n, Tensor(n, (n,), f32, (64, 64), ())) for n in (
        "embedding.word_embeddings.weight", "mtp.layers.0.eh_proj.weight")]
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": 64}
    with pytest.raises(ckpttool.UnsupportedError, match=(
            r"multi-token prediction \(MTP\) layers \('mtp.layers.0.eh_proj.weight'\)")):
        namemaps.apply("megatron-qwen3_moe", tensors, config)


def test_common_state_is_read_for_args_and_iteration(tmp_path: Path) -> None:
    """megatron-core 0.19 writes no common.pt: args and the iteration come from the
    common_state bytes entry, read by the allow-list (nothing executed). The run is copied
    under another iteration's name, so the iteration shown is the one stored, not the
    directory's."""
    run = tmp_path / "run"
    shutil.copytree(COMMON_STATE, run)
    (run / "iter_0000002").rename(run / "iter_0000005")
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    assert not (run / "iter_0000005" / "common.pt").exists()
    info = megatron.read_info(run)
    assert info.values["iteration"] == 2
    assert info.values["args"]["tensor_model_parallel_size"] == 2
    assert not any(o.name.startswith("common_state/") for o in info.objects)
    r = run_cli("inspect", run)
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert ("Megatron-Core torch_dist; iteration 2; TP 2 x PP 1 x EP 1; 2 layers, 32 hidden, "
            "48 ffn, 4 heads, 2 query groups, 8 head dim, 64 vocab (padded)") in r.stdout  # type: ignore[attr-defined]
    assert "train_state: 1 non-tensor entry (keys iteration)" in r.stdout  # type: ignore[attr-defined]
    assert "not executed" not in r.output  # type: ignore[attr-defined]


def test_common_state_run_merges_bit_exact(
        merged: dict[str, tuple[Path, ckpttool.MergeReport]]) -> None:
    out, report = merged[COMMON_STATE.name]
    assert report.name_map is not None and report.name_map.map == "megatron-llama"
    assert_bit_exact(load_out(out), common_state_reference())


def test_common_state_args_derive_the_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(COMMON_STATE, run, ignore=shutil.ignore_patterns("config.json"))
    r = run_cli("merge", run, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert json.loads(r.stdout)["derived_config"]["family"] == "llama"  # type: ignore[attr-defined]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 51
    expected = _with_config(COMMON_STATE, tmp_path)
    assert_bit_exact(load_out(tmp_path / "out"),
                     hf_reference(expected, load_file(expected / "reference.safetensors")))


def test_common_state_verify_checks_the_writers_integrity_json(tmp_path: Path) -> None:
    """megatron-core 0.19's ``verify_integrity=True`` writes integrity.json (SHA-256 per
    file): intact, verify passes; one byte changed in a data file is found by it."""
    run = tmp_path / "run"
    shutil.copytree(COMMON_STATE, run)
    assert ckpttool.verify(run).ok
    data = run / "iter_0000002" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # inside the zip directory of the last record
    data.write_bytes(bytes(raw))
    report = ckpttool.verify(run)
    assert not report.ok
    assert "__1_0.distcp" in [p.location.file for p in report.problems
                              if p.code == "integrity-mismatch"]


def test_common_state_asking_for_a_foreign_class_is_not_executed(tmp_path: Path) -> None:
    """A common_state record whose pickle names a class outside the allow-list (here
    ``argparse.Namespace`` turned into ``argparse.ArgumentParser``, same length) is not
    executed: inspect says so and shows no args."""
    run = tmp_path / "run"
    shutil.copytree(COMMON_STATE, run)
    data = run / "iter_0000002" / "__0_0.distcp"
    raw = data.read_bytes()
    assert raw.count(b"argparse\nNamespace") == 1
    # Same length: a 9-letter name the allow-list does not hold.
    data.write_bytes(raw.replace(b"argparse\nNamespace", b"argparse\nFileTypeX"))
    info = megatron.read_info(run)
    assert "args" not in info.values
    # argparse's unknown names are the pickle policy's "runs code" (argparse.FileType opens
    # files): said as such wherever the common state is read
    said = ("the pickle asks for 'argparse.FileTypeX', which runs code: the file may be "
            "malicious (nothing was executed)")
    assert [p.message for p in info.problems if p.code == "common-not-read"] == [
        f"common_state/shard_0_1: {said}; args and the iteration are not shown"]
    r = run_cli("inspect", run)
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert ("common_state.shard_0_1: needs arbitrary unpickling (argparse.FileTypeX); not "
            "executed, not read") in r.stdout  # type: ignore[attr-defined]


@pytest.mark.skipif(not MEGATRON, reason="needs megatron-core (Linux)")
@pytest.mark.parametrize(("mscale", "mscale_all_dim"),
                         [(0.9, 0.8), (1.0, 1.0), (0.707, 0.0), (1.0, 0.0), (0.0, 1.0)])
def test_derived_yarn_scales_attention_as_megatron(mscale: float,
                                                   mscale_all_dim: float) -> None:
    """transformers scales YaRN's cos/sin by mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) only when both are non-zero, else by mscale(factor, 1); Megatron always by
    the ratio. Where the two differ, the derived config writes ``attention_factor``: against
    megatron-core's own functions, the cos/sin factor and MLA's softmax scale agree."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    from ckpttool.core.transforms import megatron_config

    args = {**megatron.read_info(YARN).values["args"], "mscale": mscale,
            "mscale_all_dim": mscale_all_dim}
    config = DeepseekV3Config(**megatron_config.derive(args, command="x").config)
    _, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert factor == pytest.approx(
        yarn._yarn_get_concentration_factor(4.0, mscale, mscale_all_dim), rel=1e-12)
    q_head_dim = args["qk_head_dim"] + args["qk_pos_emb_head_dim"]
    megatron_softmax = yarn._yarn_get_mscale(4.0, mscale_all_dim) ** 2 / q_head_dim ** 0.5
    assert ds.DeepseekV3Attention(config, 0).scaling == pytest.approx(megatron_softmax,
                                                                       rel=1e-12)


def test_rope_with_mla_softmax_scaling_is_not_derived() -> None:
    """rope_type rope under MLA with mscale_all_dim and a scaling factor: Megatron scales the
    softmax, transformers' DeepseekV3 does not without YaRN: no config is guessed."""
    from ckpttool.core.transforms import megatron_config

    args = {**megatron.read_info(YARN).values["args"], "rope_type": "rope"}
    with pytest.raises(megatron_config.NotDerivable, match="rope_type rope with mscale_all_dim"):
        megatron_config.derive(args, command="x")
    assert megatron_config.derive({**args, "mscale_all_dim": 0.0}, command="x").config[
        "rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
