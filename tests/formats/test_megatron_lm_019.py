"""The ``args`` of a Megatron-LM 0.19 run, as its own training code makes and saves them.

``tests/data/megatron_lm/*-0.19`` were written by Megatron-LM ``core_v0.19.0``
under Python 3.12 (``generate_019.py``: ``parse_and_validate_args`` on a real
``pretrain_gpt.py`` command line, ``setup_model_and_optimizer``, one optimizer step,
``save_checkpoint``). 0.19 writes no ``common.pt``: the common state (``args``,
``iteration``, the rerun state machine's state...) is the DCP bytes entry
``common_state/shard_0_1``. ``args.json`` beside the run is the ``args`` namespace that
``save_checkpoint`` pickled, written by the generator from the live object.

The runs also go through every parametrized test of test_megatron_lm.py (bit-exact merges
with and without a config, logits equal to Megatron's, Adam's state under Hugging Face
names); here: their ``args`` are read through the pickle policy, every value as Megatron-LM
saved it, and the derived config is what they say.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.formats import megatron
from ckpttool.formats.codecs import policy, torchsave

DATA = Path(__file__).parents[1] / "data" / "megatron_lm"
# llama-release-0.19: the model only (--no-save-optim); llama-dp2-dist-0.19: two ranks with
# the distributed optimizer (dp_reshardable buckets), Adam's state saved; llama-tp2-0.19,
# llama-pp2-0.19, qwen3_moe-ep2-0.19, deepseek_v3-ep2-0.19 and gpt_oss-ep2-0.19:
# generate.py's runs of those names.
RUNS = sorted(p.name for p in DATA.glob("*-0.19") if (p / "args.json").is_file())
ENTRY = "common_state/shard_0_1"

# Every global the pickle of 0.19's common state names (Python 3.12 pickles Enum members as
# ``Class(value)``): pinned, so a regenerated run that adds one is looked at.
GLOBALS = {
    ("argparse", "Namespace"),
    ("signal", "Signals"),  # args.exit_signal = signal.SIGTERM
    ("megatron.core.transformer.enums", "InferenceCudaGraphScope"),  # new in 0.19
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.core.rerun_state_machine", "RerunState"),
    ("torch", "float32"),
    ("torch", "bfloat16"),
}


def run_cli(*args: object) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def _common_state_pickle(iteration: Path) -> bytes:
    """The ``data.pkl`` of the ``common_state`` entry, found with torch's own DCP reader."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(iteration)).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == ENTRY]
    with open(iteration / info.relative_path, "rb") as f:
        f.seek(info.offset)
        record = f.read(info.length)
    with zipfile.ZipFile(io.BytesIO(record)) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        return z.read(name)


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def test_the_runs_are_there() -> None:
    assert "llama-release-0.19" in RUNS


@pytest.mark.parametrize("name", RUNS)
def test_the_run_is_megatron_lm_0_19_under_python_3_12(name: str) -> None:
    run = DATA / name
    written = json.loads((run / "written_by.json").read_text())
    assert written["megatron_core"].startswith("0.19.")
    assert written["megatron_lm_tag"] == "core_v0.19.0"
    assert written["python"].startswith("3.12.")
    # 0.19 keeps the common state in the DCP
    assert not (run / "iter_0000001" / "common.pt").exists()


@pytest.mark.parametrize("name", RUNS)
def test_every_global_of_the_saved_args_is_read_as_data(name: str) -> None:
    """Each global the pickle names is one the Megatron lookup reads (an Enum member's value,
    a namespace, a dtype), none is one that can run code."""
    found = set(torchsave.named_global_pairs(_common_state_pickle(
        DATA / name / "iter_0000001")))
    assert found == GLOBALS
    for module, name in sorted(found):
        assert megatron.common_global(module, name) is not None, (module, name)
        assert not policy.can_run_anything(module, name), (module, name)


@pytest.mark.parametrize("name", RUNS)
def test_args_read_are_the_args_megatron_lm_saved(name: str) -> None:
    """Every one of the 800-odd values, as the live namespace held it (Enum members by their
    value: ``exit_signal`` 15, ``inference_cuda_graph_scope`` 1; dtypes by name)."""
    run = DATA / name
    info = megatron.read_info(run)
    args = info.values["args"]
    want = json.loads((run / "args.json").read_text())
    assert isinstance(args, dict) and len(want) > 800
    assert sorted(args) == sorted(want)
    differ = {k: (args[k], want[k]) for k in want if _plain(args[k]) != want[k]}
    assert not differ
    assert args["exit_signal"] == 15 and args["inference_cuda_graph_scope"] == 1
    assert info.values["iteration"] == 1
    assert info.values["rerun_state_machine"]["mode"] == "validate_results"


@pytest.fixture(scope="module")
def read_with_megatron_core_imported() -> dict[str, Any]:
    """What one process that has imported megatron-core reads of each run's args (one
    process for every run: its imports cost many seconds, the reads milliseconds)."""
    pytest.importorskip("megatron.core")
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "import megatron.core.rerun_state_machine, megatron.core.transformer.enums\n"
            "import json, sys\n"
            "from ckpttool.formats import megatron\n"
            "got = {}\n"
            "for name in sys.argv[2:]:\n"
            "    info = megatron.read_info(sys.argv[1] + '/' + name)\n"
            "    got[name] = [info.values['args']['exit_signal'],\n"
            "                 info.values['args']['inference_cuda_graph_scope'],\n"
            "                 info.values['args']['attention_backend'],\n"
            "                 info.values['rerun_state_machine']['mode']]\n"
            "print(json.dumps(got))\n")
    done = subprocess.run([sys.executable, "-c", code, str(DATA), *RUNS], capture_output=True,
                          text=True, cwd=Path(__file__).parents[2], timeout=300)
    assert done.returncode == 0, done.stderr
    got: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return got


@pytest.mark.parametrize("name", RUNS)
def test_args_read_alike_with_megatron_core_imported(
        name: str, read_with_megatron_core_imported: dict[str, Any]) -> None:
    """The process may have imported another megatron-core (the shared venv has 0.16.1): the
    0.19 classes it names are still read by value, not by that version's definitions."""
    want = json.loads((DATA / name / "args.json").read_text())
    assert read_with_megatron_core_imported[name] == [
        15, 1, want["attention_backend"], "validate_results"]


@pytest.mark.parametrize("name", RUNS)
def test_inspect_and_verify_read_the_args(name: str) -> None:
    run = DATA / name
    r = run_cli("verify", run, "--json")
    assert r.exit_code == 0, r.output
    assert "malicious" not in r.output
    # Megatron's own names, stored per layer (DeepSeek-V3's dense first layer) or stacked:
    # no warning either way (merge maps them; no loader reads a torch_dist checkpoint)
    assert json.loads(r.stdout)["problems"] == []
    r = run_cli("inspect", run, "--json")
    assert r.exit_code == 0, r.output
    assert "malicious" not in r.output
    doc = json.loads(r.stdout)
    entries = {o.get("name"): o for o in doc["non_tensor"]}
    assert {"args", "iteration", "checkpoint_version"} <= set(entries)
    assert entries["args"]["readable"] and entries["iteration"]["value"] == 1
    assert entries["args"]["value"]["exit_signal"] == 15
    assert entries["args"]["value"]["inference_cuda_graph_scope"] == 1


@pytest.mark.parametrize("name", RUNS)
def test_derived_config_is_what_the_args_say(name: str, tmp_path: Path) -> None:
    """No config: the derived one is read from the saved args (``--norm-epsilon`` is
    ``layernorm_epsilon``; the NullTokenizer's vocabulary is ``vocab_size`` + EOD, its
    padding to ``padded_vocab_size`` cut)."""
    run = DATA / name
    args = json.loads((run / "args.json").read_text())
    out = tmp_path / "out"
    r = run_cli("merge", run, out, "--json", "-q")
    assert r.exit_code == 0, r.output
    family = json.loads((run / "written_by.json").read_text())["family"]
    assert json.loads(r.stdout)["derived_config"]["family"] == family
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == json.loads((run / "hf_config.json").read_text())[
        "architectures"]
    if family in ("deepseek_v3", "gpt_oss"):  # rope_parameters; test_megatron_lm.py checks
        return  # the whole config against transformers' class for every run
    assert {k: config[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
        "rope_theta", "tie_word_embeddings", "vocab_size")} == {
        "hidden_size": args["hidden_size"], "intermediate_size": args["ffn_hidden_size"],
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": args["num_attention_heads"],
        "num_key_value_heads": args["num_query_groups"], "head_dim": args["kv_channels"],
        "max_position_embeddings": args["max_position_embeddings"],
        "rms_norm_eps": args["layernorm_epsilon"], "rope_theta": args["rotary_base"],
        "tie_word_embeddings": not args["untie_embeddings_and_output_weights"],
        "vocab_size": args["vocab_size"] + 1}
    assert args["tokenizer_type"] == "NullTokenizer" and args["padded_vocab_size"] == 512
