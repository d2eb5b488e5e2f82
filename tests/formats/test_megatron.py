"""Megatron-Core torch_dist runs (written by megatron-core itself, tests/megatron_layouts.py) to
Hugging Face: recognised as runs and iterations, merged through the family's map with no
--names, bit for bit against Megatron's own loaded state dict rearranged by plain torch, and
with transformers' logits equal to Megatron's own forward pass; wrong inputs refused before
anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.formats import megatron, registry
from tests.helpers import assert_bit_exact, load_out
from tests.megatron_layouts import VARIANTS, hf_reference

# fp32 forward passes of the same weights in two implementations (Megatron's local attention
# and transformers' eager/sdpa): they differ by summation order only. Seen: at most 1.2e-7
# on logits of magnitude up to 0.8.
LOGITS_ATOL = 1e-5


def run_cli(*args: object) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def merged(megatron_runs: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, tuple[Path, ckpttool.MergeReport]]:
    out = tmp_path_factory.mktemp("megatron-merged")
    return {name: (out / name, ckpttool.merge(megatron_runs / name, out / name))
            for name in VARIANTS}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_merge_is_bit_exact_against_megatrons_own_state(
        name: str, megatron_runs: Path, merged: dict[str, tuple[Path, ckpttool.MergeReport]]
        ) -> None:
    out, report = merged[name]
    assert report.format == "megatron"
    assert report.name_map is not None
    assert report.name_map.map == f"megatron-{VARIANTS[name].family}"
    assert_bit_exact(load_out(out), hf_reference(megatron_runs / name))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_transformers_logits_match_megatrons_forward(
        name: str, megatron_runs: Path, merged: dict[str, tuple[Path, ckpttool.MergeReport]]
        ) -> None:
    import transformers

    ref = torch.load(megatron_runs / name / "reference.pt", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(merged[name][0],
                                                              dtype=torch.float32)
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    vocab = logits.shape[-1]
    assert vocab == json.loads((megatron_runs / name / "config.json").read_text())["vocab_size"]
    torch.testing.assert_close(logits, ref["logits"][..., :vocab], atol=LOGITS_ATOL, rtol=0)


def test_run_and_iteration_are_recognised(megatron_runs: Path) -> None:
    run = megatron_runs / "llama-tp2"
    for path in (run, run / "iter_0000002"):
        fmt = registry.detect(path)
        assert fmt is not None and fmt.NAME == "megatron"
    info = megatron.read_info(run)
    assert info.root == run / "iter_0000002"
    layout = info.storage["megatron"]
    assert (layout["iteration"], layout["tensor_parallel"], layout["pipeline_parallel"]) == (
        2, 2, 1)
    assert layout["padded_vocab_size"] == 64 and layout["num_query_groups"] == 2
    assert info.values["args"]["attention_backend"] is not None  # an enum, read as its value


def test_inspect_shows_iteration_layout_and_parts(megatron_runs: Path) -> None:
    r = run_cli("inspect", megatron_runs / "llama-pp2")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    text = r.stdout  # type: ignore[attr-defined]
    assert "Megatron-Core torch_dist; iteration 2; TP 1 x PP 2 x EP 1; 4 layers" in text
    assert "rng: 2 non-tensor entries (keys rng_state" in text
    assert "train_state: 1 non-tensor entry (keys iteration" in text
    assert "may be malicious" not in text


def test_iteration_option_of_read_info(megatron_runs: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(megatron_runs / "llama", run)
    with pytest.raises(ckpttool.InputError, match="has no iteration 7 .*iter_0000002"):
        megatron.read_info(run, iteration=7)
    assert megatron.read_info(run, iteration=2).root == run / "iter_0000002"


def test_incomplete_iteration_is_exit_3(megatron_runs: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(megatron_runs / "llama", run)
    (run / "iter_0000002" / "metadata.json").unlink()
    for path in (run, run / "iter_0000002"):
        r = run_cli("inspect", path)
        assert r.exit_code == 3, r.output  # type: ignore[attr-defined]
        assert (f"{run / 'iter_0000002'}: no metadata.json, which Megatron writes last: this "
                "save is incomplete") in r.output  # type: ignore[attr-defined]


def test_tracker_naming_a_missing_iteration_is_exit_3(megatron_runs: Path,
                                                      tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(megatron_runs / "llama", run)
    (run / "latest_checkpointed_iteration.txt").write_text("500")
    r = run_cli("merge", run, tmp_path / "out")
    assert r.exit_code == 3, r.output  # type: ignore[attr-defined]
    assert "names iteration 500, but iter_0000500/ is not there; it holds iter_0000002" in (
        r.output)  # type: ignore[attr-defined]
    assert not (tmp_path / "out").exists()


def test_megatron_metadata_as_plain_dcp_is_unsupported_not_malicious(
        megatron_runs: Path, tmp_path: Path) -> None:
    """Issue 21 item 3: a genuine Megatron .metadata, seen where ckpttool reads plain DCP (the
    directory renamed, no metadata.json), is exit 4 saying what it is."""
    plain = tmp_path / "shards"
    shutil.copytree(megatron_runs / "llama" / "iter_0000002", plain)
    (plain / "metadata.json").unlink()
    r = run_cli("inspect", plain)
    assert r.exit_code == 4, r.output  # type: ignore[attr-defined]
    assert "torch's DCP save plans (Megatron-Core torch_dist writes them)" in r.output  # type: ignore[attr-defined]
    assert "malicious" not in r.output  # type: ignore[attr-defined]


def test_names_none_keeps_megatron_names_without_config(megatron_runs: Path,
                                                        tmp_path: Path) -> None:
    """--names none derives no config (there is no family to write) and keeps the stored
    global tensors; without it, a config is derived (test_config_derived_from_args_...)."""
    run = tmp_path / "run"
    shutil.copytree(megatron_runs / "llama", run, ignore=shutil.ignore_patterns("config.json"))
    r = run_cli("merge", run, tmp_path / "native", "--names", "none", "-q", "--weights-only")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert "decoder.layers.self_attention.linear_qkv.weight" in load_out(tmp_path / "native")
    assert not (tmp_path / "native" / "config.json").exists()


def test_config_of_another_model_is_exit_3_before_writing(megatron_runs: Path,
                                                          tmp_path: Path) -> None:
    """A config whose sizes the stored shapes do not fit (here: 8 heads where the run has 4
    with 2 query groups) fails on a shape before anything is written."""
    config = json.loads((megatron_runs / "llama" / "config.json").read_text())
    config["num_key_value_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    r = run_cli("merge", megatron_runs / "llama", out, "--config", tmp_path / "config.json")
    assert r.exit_code == 3, r.output  # type: ignore[attr-defined]
    assert "'decoder.layers.self_attention.linear_qkv.weight': shape [2, 64, 32], but --names " \
        "megatron-llama" in r.output  # type: ignore[attr-defined]
    assert not out.exists()


def test_family_without_a_map_is_exit_4(megatron_runs: Path, tmp_path: Path) -> None:
    config = json.loads((megatron_runs / "llama" / "config.json").read_text())
    config["model_type"] = "gemma"
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run_cli("merge", megatron_runs / "llama", tmp_path / "out", "--config",
                tmp_path / "config.json")
    assert r.exit_code == 4, r.output  # type: ignore[attr-defined]
    assert "model_type 'gemma' has no Megatron-Core map yet" in r.output  # type: ignore[attr-defined]


def test_verify_checks_integrity_json(megatron_runs: Path, tmp_path: Path) -> None:
    """integrity.json (SHA-256 per file) is written here by hashing the files, as the writers
    that add one do (megatron-core 0.16 writes none): intact, it passes; a changed
    metadata.json, which no CRC-32 of DCP covers, is found."""
    import hashlib

    run = tmp_path / "run"
    shutil.copytree(megatron_runs / "llama", run)
    it = run / "iter_0000002"
    files = sorted(p for p in it.iterdir() if p.is_file())
    (it / "integrity.json").write_text(json.dumps({"files": {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}}))
    assert ckpttool.verify(run).ok
    meta = it / "metadata.json"
    meta.write_text(json.dumps(json.loads(meta.read_text()), indent=1))  # same JSON, new bytes
    report = ckpttool.verify(run)
    found = [p for p in report.problems if p.code == "integrity-mismatch"]
    assert not report.ok and [p.location.file for p in found] == ["metadata.json"]


def test_common_pt_alone_is_exit_4_naming_it(megatron_runs: Path) -> None:
    common = megatron_runs / "llama" / "iter_0000002" / "common.pt"
    r = run_cli("inspect", common)
    assert r.exit_code == 4, r.output  # type: ignore[attr-defined]
    assert f"{common}: Megatron-Core's common state (args and the iteration)" in (
        r.output)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["llama-tp2", "llama-pp2", "mixtral-ep2"])
def test_slices_copied_file_to_file_are_bit_exact(name: str, megatron_runs: Path,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer, q/k/v, gate/up, expert and vocabulary slices move file to file (the kernel's
    copy) when their runs are long; the fixtures' runs are short, so every run is copied here
    (COPY_RUN 0), and the result is still Megatron's own state bit for bit."""
    from ckpttool.core.merge import engine

    monkeypatch.setattr(engine, "COPY_RUN", 0)
    copied: list[int] = []
    real = engine.Reader.copy_to

    def counted(self: engine.Reader, *args: int | str) -> None:
        copied.append(1)
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.Reader, "copy_to", counted)
    r = run_cli("merge", megatron_runs / name, tmp_path / "out", "-q", "--workers", "1")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert copied
    assert_bit_exact(load_out(tmp_path / "out"), hf_reference(megatron_runs / name))


@pytest.mark.parametrize("name", ["llama-tp2", "mixtral-ep2"])
def test_slices_gathered_in_small_blocks_are_bit_exact(name: str, megatron_runs: Path,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slice gathered (COPY_RUN above any run) and written in blocks of an odd size
    (GATHER_BLOCK 1000 bytes: runs cut where a block ends, scattered reads of back-to-back
    runs, two workers taking turns to write): Megatron's own state bit for bit."""
    from ckpttool.core.merge import engine

    monkeypatch.setattr(engine, "COPY_RUN", 1 << 40)
    monkeypatch.setattr(engine, "GATHER_BLOCK", 1000)
    reads: list[int] = []
    real = engine.Reader.readv

    def counted(self: engine.Reader, file: str, offset: int, bufs: list[memoryview]) -> int:
        reads.append(len(bufs))
        return real(self, file, offset, bufs)

    monkeypatch.setattr(engine.Reader, "readv", counted)
    r = run_cli("merge", megatron_runs / name, tmp_path / "out", "-q", "--workers", "2")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert reads
    if name == "llama-tp2":  # a row-parallel layer's rows: back-to-back runs read together
        assert max(reads) > 1
    assert_bit_exact(load_out(tmp_path / "out"), hf_reference(megatron_runs / name))


def test_merge_rearranges_without_torch(megatron_runs: Path, tmp_path: Path) -> None:
    """The maps' slices are rearrangements of stored bytes: the CLI's merge imports no torch
    for them (importing it costs about a second, what the whole copy of a small model costs),
    and of the formats only those it reads (the registry imports a format when it is tried).
    --weights-only: the output contract builds the model with transformers, which imports
    torch (core.contract)."""
    import subprocess
    import sys

    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
            "atexit.register(lambda: print('formats imported:', sorted(\n"
            "    m for m in sys.modules if m.count('.') == 2\n"
            "    and m.startswith('ckpttool.formats.')\n"
            "    and m not in ('ckpttool.formats.base', 'ckpttool.formats.registry'))))\n"
            "from ckpttool.cli import main\nmain()\n")
    done = subprocess.run(
        [sys.executable, "-c", code, "merge", str(megatron_runs / "qwen3_moe-ep2"),
         str(tmp_path / "out"), "-q", "--weights-only"], capture_output=True, text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0, done.stderr
    assert "torch imported: False" in done.stdout
    # rank_files and torchfile: the recogniser looks for their files beside a DCP checkpoint.
    assert ("formats imported: ['ckpttool.formats.codecs', 'ckpttool.formats.dcp', "
            "'ckpttool.formats.megatron', 'ckpttool.formats.rank_files', "
            "'ckpttool.formats.safetensors', 'ckpttool.formats.torchfile']") in done.stdout


def test_cast_to_bf16_without_torch_is_torchs_cast(megatron_runs: Path, tmp_path: Path) -> None:
    """``--dtype bf16`` of small float32 tensors (Megatron's float32 norms in a bf16 run) is
    cast in Python; bit for bit what torch's cast gives."""
    r = run_cli("merge", megatron_runs / "llama-tp2", tmp_path / "out", "--dtype", "bf16", "-q")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    want = {k: v.to(torch.bfloat16) for k, v in hf_reference(megatron_runs / "llama-tp2").items()}
    assert_bit_exact(load_out(tmp_path / "out"), want)


def test_f32_to_bf16_is_torchs_rounding() -> None:
    from ckpttool.formats.codecs.dtypes import f32_to_bf16

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (100_000,), generator=g, dtype=torch.int64)
    values = torch.cat([bits.to(torch.int32).view(torch.float32), torch.tensor(
        [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38,
         -3.4028235e38, 1e-45, 3.3961e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8])])
    got = torch.frombuffer(f32_to_bf16(values.numpy().tobytes()), dtype=torch.bfloat16)
    assert torch.equal(got.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))


def _two_iterations(megatron_runs: Path, tmp_path: Path) -> Path:
    """A run holding iteration 2 (the tracker's) and a copy of it as iteration 1: the
    reports name the directory read."""
    run = tmp_path / "run"
    shutil.copytree(megatron_runs / "llama", run)
    shutil.copytree(run / "iter_0000002", run / "iter_0000001")
    return run


@pytest.mark.parametrize("command", ["merge", "inspect", "verify", "reshard"])
def test_iteration_option_picks_another_iteration(command: str, megatron_runs: Path,
                                                  tmp_path: Path) -> None:
    run = _two_iterations(megatron_runs, tmp_path)
    out = [tmp_path / "out"] if command in ("merge", "reshard") else []
    extra = ["--ranks", "1"] if command == "reshard" else []
    r = run_cli(command, run, *out, "--iteration", "1", "--json", *extra)
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert str(run / "iter_0000001") in r.stdout  # type: ignore[attr-defined]
    assert str(run / "iter_0000002") not in r.stdout  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", ["merge", "inspect", "verify", "reshard"])
def test_missing_iteration_is_one_line_exit_3(command: str, megatron_runs: Path,
                                              tmp_path: Path) -> None:
    run = _two_iterations(megatron_runs, tmp_path)
    out = [tmp_path / "out"] if command in ("merge", "reshard") else []
    r = run_cli(command, run, *out, "--iteration", "7")
    assert r.exit_code == 3, r.output  # type: ignore[attr-defined]
    assert r.output == (  # type: ignore[attr-defined]
        f"ckpttool: error: {run}: has no iteration 7 (iter_0000007); it holds iter_0000001, "
        "iter_0000002\n")
    assert not (tmp_path / "out").exists()


def test_iteration_of_what_is_not_a_run_is_exit_2(megatron_runs: Path, tmp_path: Path) -> None:
    # A bad value for the option, not bad input: a usage error, as the README says (issue 38).
    it = megatron_runs / "llama" / "iter_0000002"
    r = run_cli("inspect", it, "--iteration", "2")
    assert r.exit_code == 2, r.output  # type: ignore[attr-defined]
    assert f"{it}: is one iteration already; pass the run directory {it.parent} with " \
        "--iteration 2" in r.output  # type: ignore[attr-defined]
    r = run_cli("inspect", megatron_runs / "llama" / "config.json", "--iteration", "2")
    assert r.exit_code == 2, r.output  # type: ignore[attr-defined]
    assert "--iteration 2 picks one iteration of a Megatron-Core run directory" in \
        r.output  # type: ignore[attr-defined]
    r = run_cli("merge", megatron_runs / "llama", tmp_path / "o", "--all", "--iteration", "2")
    assert r.exit_code == 2, r.output  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.family != "gpt_oss"])
def test_config_derived_from_args_loads_and_matches_megatron(name: str, megatron_runs: Path,
                                                             tmp_path: Path) -> None:
    """Without a config.json, the one Megatron's args describe is written: the family it
    chose is reported, from_pretrained loads the output, and its logits are Megatron's."""
    import transformers

    run = tmp_path / "run"
    shutil.copytree(megatron_runs / name, run, ignore=shutil.ignore_patterns("config.json"))
    r = run_cli("merge", run, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    doc = json.loads(r.stdout)  # type: ignore[attr-defined]
    family = VARIANTS[name].family
    assert doc["derived_config"]["family"] == family
    assert doc["name_map"]["map"] == f"megatron-{family}"
    assert not [w for w in doc["warnings"] if "WEIGHTS ONLY" in w]
    ref = torch.load(megatron_runs / name / "reference.pt", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float32)
    assert model.config.model_type == family
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"][..., :logits.shape[-1]],
                               atol=LOGITS_ATOL, rtol=0)
    human = run_cli("merge", run, tmp_path / "again")
    assert f"config.json derived from Megatron's args: family {family} (" in \
        human.stdout  # type: ignore[attr-defined]


def test_args_of_no_one_family_ask_for_config(megatron_runs: Path, tmp_path: Path) -> None:
    """args with both a QKV bias and q/k layernorm fit no family here: exit 3, naming why and
    the --config command to run, nothing written. (common.pt is re-saved with torch.save,
    as Megatron writes it, with those two flags set.)"""
    run = tmp_path / "run"
    shutil.copytree(megatron_runs / "llama", run, ignore=shutil.ignore_patterns("config.json"))
    common = run / "iter_0000002" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].add_qkv_bias = state["args"].qk_layernorm = True
    torch.save(state, common)
    out = tmp_path / "out"
    r = run_cli("merge", run, out)
    assert r.exit_code == 3, r.output  # type: ignore[attr-defined]
    assert r.output == (  # type: ignore[attr-defined]
        "ckpttool: error: no config.json beside the run, and Megatron's args fit none of the "
        "families a config is derived for (llama, qwen2, qwen3, qwen3_moe, mixtral): both a "
        "QKV bias and q/k layernorm; pass the model's Hugging Face config.json: ckpttool "
        f"merge {run} {out} --config path/to/config.json\n")
    assert not out.exists()


@pytest.mark.parametrize(("change", "why"), [
    ({"multi_latent_attention": True}, "multi-latent attention"),
    ({"normalization": "LayerNorm"}, "normalization LayerNorm"),
    ({"num_experts": 8, "moe_shared_expert_intermediate_size": 64}, "shared experts"),
    ({"num_experts": 8, "moe_router_pre_softmax": True}, "moe_router_pre_softmax"),
])
def test_derive_refuses_what_no_family_fits(change: dict[str, object], why: str) -> None:
    from ckpttool.core.transforms import megatron_config

    args = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4,
            "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
            "add_bias_linear": False, "padded_vocab_size": 64, "moe_ffn_hidden_size": 24}
    assert megatron_config.derive(args, command="x").notes  # no vocab_size: the padded kept
    with pytest.raises(megatron_config.NotDerivable, match=why):
        megatron_config.derive({**args, **change}, command="ckpttool merge R O")


def test_part_optimizer_is_bit_exact_against_adams_state(megatron_runs: Path,
                                                         tmp_path: Path) -> None:
    """Megatron's non-distributed optimizer state (plain chunks of each parameter's global
    tensor, written by megatron-core's own optimizer sharding) merges with --part optimizer,
    bit for bit Adam's state, under the Hugging Face names of the model's map
    (``state.<name>.<kind>``: the state is laid out as the weights, stacked, fused, padded)."""
    from safetensors.torch import load_file

    from tests.megatron_layouts import native_reference

    run = megatron_runs / "llama-optim"
    r = run_cli("merge", run, tmp_path / "out", "--part", "optimizer", "-q")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    got = load_file(tmp_path / "out" / "optimizer.safetensors")
    state = torch.load(run / "reference_optim.pt", weights_only=True)
    want = {f"state.{name}.{kind}": value for kind, by_name in state.items()
            for name, value in hf_reference(run, by_name).items()}
    assert_bit_exact(got, want)
    r = run_cli("merge", run, tmp_path / "stored", "--part", "optimizer", "--names", "none",
                "-q")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert_bit_exact(load_file(tmp_path / "stored" / "optimizer.safetensors"),
                     {f"optimizer.state.{kind}.{name}": value
                      for kind, by_name in state.items()
                      for name, value in native_reference(run, by_name).items()})


def _flattened(megatron_runs: Path, tmp_path: Path) -> Path:
    """llama-optim with its real .metadata minimally edited into what megatron-core before
    0.14 wrote for the distributed optimizer's flattened_range shards: the MCoreMetadata
    class, with ``mcore_data`` giving each optimizer tensor's
    ``nd_reformulated_orig_global_shape``. (megatron-core 0.16 writes this layout no more.)"""
    import pickle

    from megatron.core.dist_checkpointing.strategies.torch import MCoreMetadata

    run = tmp_path / "run"
    shutil.copytree(megatron_runs / "llama-optim", run)
    path = run / "iter_0000002" / ".metadata"
    md = pickle.loads(path.read_bytes())  # our own fixture's, trusted
    old = MCoreMetadata()
    old.__dict__.update(md.__dict__)
    old.mcore_data = {k: {"nd_reformulated_orig_global_shape": tuple(v.size)}
                      for k, v in md.state_dict_metadata.items() if k.startswith("optimizer.")}
    path.write_bytes(pickle.dumps(old))
    return run


def test_flattened_range_optimizer_is_exit_4_naming_it(megatron_runs: Path,
                                                       tmp_path: Path) -> None:
    run = _flattened(megatron_runs, tmp_path)
    r = run_cli("merge", run, tmp_path / "out", "--part", "optimizer")
    assert r.exit_code == 4, r.output  # type: ignore[attr-defined]
    assert r.output == (  # type: ignore[attr-defined]
        f"ckpttool: error: {run / 'iter_0000002'}: the optimizer state is Megatron-Core's "
        "distributed optimizer in its flattened_range layout (N-D flattened shards, "
        "'nd_reformulated_orig_global_shape' in .metadata, written by megatron-core before "
        "0.14), whose tensors do not have the parameters' shapes; not supported yet. The "
        "model merges without --part optimizer; for the optimizer state, re-save the run "
        "with megatron-core 0.14 or later, which stores it as plain chunks\n")
    assert "malicious" not in r.output  # type: ignore[attr-defined]
    assert not (tmp_path / "out").exists()
    r = run_cli("inspect", run)
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert "flattened_range layout" in r.output  # type: ignore[attr-defined]
    r = run_cli("merge", run, tmp_path / "model", "-q")  # the model is plain chunks
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert_bit_exact(load_out(tmp_path / "model"), hf_reference(run))


def test_gpt_oss_args_derive_its_config(megatron_runs: Path, tmp_path: Path) -> None:
    """gpt-oss's args (attention sinks, the quick-GELU GLU with its clamp and offset, biases,
    experts) derive transformers' GptOss config: the merge is bit exact. With a sliding
    window in args (which layers slide is not derived), exit 3 asking for --config, nothing
    written."""
    run = tmp_path / "run"
    shutil.copytree(megatron_runs / "gpt_oss-ep2", run,
                    ignore=shutil.ignore_patterns("config.json"))
    r = run_cli("merge", run, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert json.loads(r.stdout)["derived_config"]["family"] == "gpt_oss"  # type: ignore[attr-defined]
    expected = tmp_path / "expected"
    expected.mkdir()
    shutil.copy(tmp_path / "out" / "config.json", expected / "config.json")
    assert_bit_exact(load_out(tmp_path / "out"), hf_reference(
        expected, torch.load(megatron_runs / "gpt_oss-ep2" / "reference.pt",
                             weights_only=True)["state_dict"]))
    from ckpttool.core.transforms import megatron_config

    args = {**megatron.read_info(run).values["args"], "window_size": (128, 0)}
    with pytest.raises(megatron_config.NotDerivable, match=r"sliding-window attention"):
        megatron_config.derive(args, command="ckpttool merge R O")
