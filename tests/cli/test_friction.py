"""Everyday friction a new user met (issue 24), each pinned by the CLI as the user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli import app

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def cli_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


def test_part_optimizer_of_a_training_directory_uses_the_optimizer_beside_the_model(
        llama_ckpt: Path, tmp_path: Path) -> None:
    r = run("merge", llama_ckpt, tmp_path / "a", "--part", "optimizer")
    assert r.exit_code == 0, r.output
    assert f"  used optimizer_0, found in {llama_ckpt}" in r.stdout
    r = run("merge", llama_ckpt / "optimizer_0", tmp_path / "b", "-q")
    assert r.exit_code == 0, r.output
    for name in ("optimizer.safetensors", "optimizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_torch_without_numpy_says_nothing_about_numpy(llama_ckpt: Path) -> None:
    # The user's own torch build without numpy: no "Failed to initialize NumPy" lines.
    code = ("import sys\nsys.modules['numpy'] = None\n"
            f"sys.argv = ['ckpttool', 'inspect', {str(llama_ckpt)!r}, '--stats', '-q']\n"
            "from ckpttool.cli import main\nmain()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=cli_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""


@pytest.mark.parametrize("given", ["3/3", "0/0", "-1/2", "a/b"])
def test_a_bad_slice_is_a_usage_error(given: str, llama_ckpt: Path, tmp_path: Path) -> None:
    r = run("merge", llama_ckpt, tmp_path / "out", f"--slice={given}")
    assert r.exit_code == 2, r.output
    assert r.stderr == (f"ckpttool: error: --slice '{given}': expected I/N with 0 <= I < N, "
                        "e.g. --slice 0/8\n")
    assert not (tmp_path / "out").exists()


def test_a_fifo_as_data_file_is_called_a_fifo_not_missing(llama_ckpt: Path,
                                                           tmp_path: Path) -> None:
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(llama_ckpt / "pytorch_model_fsdp_0", ckpt)
    data = ckpt / "__1_0.distcp"
    data.unlink()
    os.mkfifo(data)
    said = (f"{data}: is a FIFO, not a regular file; .metadata references it as a data file (")
    r = run("merge", "--weights-only", ckpt, tmp_path / "out")
    assert r.exit_code == 3 and r.stderr.startswith(f"ckpttool: error: {said}"), r.output
    assert "missing" not in r.stderr
    r = run("verify", ckpt)
    assert r.exit_code == 1 and f"error: missing-file: {said}" in r.stdout, r.output


def test_a_failed_merge_removes_the_output_directory_it_created(llama_ckpt: Path,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "new" / "out"
    r = run("merge", llama_ckpt, out, "--finish")  # no slice ran: fails after creating OUT
    assert r.exit_code == 3 and "no finished slice of this merge" in r.stderr, r.output
    assert not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    r = run("merge", llama_ckpt, tmp_path / "there", "--finish")
    assert r.exit_code == 3 and (tmp_path / "there").is_dir()  # it was there before


def test_an_interrupted_command_leaves_no_directory_it_created(tmp_path: Path) -> None:
    from ckpttool.cli.common import removes_new_dirs

    out = tmp_path / "a" / "b"
    with pytest.raises(KeyboardInterrupt), removes_new_dirs(str(out)):
        out.mkdir(parents=True)
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt), removes_new_dirs(str(out)):
        out.mkdir(parents=True)
        (out / ".x.ckpttool-tmp").touch()  # a slice's work: kept
        raise KeyboardInterrupt
    assert (out / ".x.ckpttool-tmp").exists()


def test_dry_run_of_a_slice_shows_that_slice(llama_ckpt: Path, tmp_path: Path) -> None:
    import json

    out = tmp_path / "out"
    whole = json.loads(run("merge", llama_ckpt, out, "--dry-run", "--json").stdout)
    names: list[str] = []
    for i in range(4):
        r = run("merge", llama_ckpt, out, "--dry-run", "--slice", f"{i}/4", "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        assert doc["distributed"]["mode"] == "slice" and doc["distributed"]["slice"] == i
        assert doc["distributed"]["processes"] == 4
        assert 0 < len(doc["tensors"]) < len(whole["tensors"])
        names += [t["name"] for t in doc["tensors"]]
    # every tensor is some slice's (one cut between two slices is in both)
    assert set(names) == {t["name"] for t in whole["tensors"]}
    r = run("merge", llama_ckpt, out, "--dry-run", "--slice", "1/4")
    assert r.stdout.startswith("dry run: slice 1/4 of "), r.stdout
    assert "--finish" not in r.stdout
    assert not out.exists()


def test_reshard_of_a_training_directory_says_which_checkpoint_it_used(
        llama_ckpt: Path, tmp_path: Path) -> None:
    r = run("reshard", llama_ckpt, tmp_path / "out", "--ranks", "1")
    assert r.exit_code == 0, r.output
    used = llama_ckpt / "pytorch_model_fsdp_0"
    assert r.stdout.startswith(f"resharded {used} (dcp) -> {tmp_path / 'out'} (1 rank) in ")
    assert f"  used pytorch_model_fsdp_0, found in {llama_ckpt}\n" in r.stdout


def test_merge_report_wording(llama_ckpt: Path, tmp_path: Path) -> None:
    r = run("merge", llama_ckpt, tmp_path / "out", "--dtype", "keep")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert "  wrote model.safetensors: 92.78 KB (20 tensors)" in lines
    # nothing cast: one figure; the tied copy written once has its own line
    assert "  dtypes kept as stored (--dtype keep): F32 107.14 KB" in lines
    assert "  removed wrapper 'model' from 21 names (every rename is in --json)" in lines
    assert not [line for line in lines if " -> model." in line]
    assert [line for line in lines if line.startswith("  tied: lm_head.weight is identical")]


def test_no_space_is_said_in_units(tmp_path: Path) -> None:
    from ckpttool.errors import OutputError
    from ckpttool.storage.outputs import check_space

    with pytest.raises(OutputError, match=r"takes about 1000\.00 TB and [0-9.]+ [KMGT]B are "
                                          "free; free some space"):
        check_space(tmp_path / "out", 10**15)


def test_counts_are_singular_when_one(llama_ckpt: Path, tmp_path: Path) -> None:
    r = run("inspect", llama_ckpt)
    assert "    optimizer_0: optimizer (dcp; 60 tensors, 2 files)" in r.stdout.splitlines()
    from ckpttool.core.checkpoint.discover import _count

    assert _count(1, "file") == "1 file" and _count(2, "file") == "2 files"


@pytest.mark.parametrize("width", [40, 60, 100])
def test_progress_fits_the_terminal_and_says_planning_first(width: int) -> None:
    import io

    from rich.console import Console

    from ckpttool.cli.common import ProgressBar

    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    bar = ProgressBar("merging", enabled=True, console=console, mode="auto")
    on_start, progress = bar.callbacks
    assert on_start is not None and progress is not None
    bar.begin()
    planning = bar.rendered().splitlines()
    assert len(planning) == 1 and "merging: planning" in planning[0]
    on_start(1_500_000_000)
    progress(600_000_000)
    drawn = bar.rendered().splitlines()
    bar.stop()
    assert len(drawn) == 1 and len(drawn[0]) <= width, drawn
    assert "planning" not in drawn[0] and "40%" in drawn[0] or "0.6/1.5 GB" in drawn[0]


def test_verbose_shows_what_was_read_the_plan_and_the_phases(llama_ckpt: Path,
                                                             tmp_path: Path) -> None:
    r = run("merge", llama_ckpt, tmp_path / "out", "-v")
    assert r.exit_code == 0, r.output
    said = [line.removeprefix("ckpttool: ") for line in r.stderr.splitlines()]
    assert said[0] == f"read {llama_ckpt / 'pytorch_model_fsdp_0'} (dcp)"
    assert said[1].startswith("side files: config.json, generation_config.json")
    assert said[2] == f"dtype: {llama_ckpt / 'config.json'} dtype=bfloat16"
    assert said[3] == "plan: 20 tensors, 45.38 KB into model.safetensors (47.42 KB)"
    assert said[4].startswith("timings: planning ") and ", writing " in said[4]
    for command in (["verify", llama_ckpt], ["inspect", llama_ckpt],
                    ["reshard", llama_ckpt, tmp_path / "re", "--ranks", "2"]):
        r = run(*command, "--verbose")
        assert r.exit_code == 0, r.output
        assert "ckpttool: timings: " in r.stderr, r.stderr
    assert "ckpttool: checks: structure, content, ties, dtypes" in run(
        "verify", llama_ckpt, "-v").stderr


@pytest.mark.parametrize("command", ["merge", "inspect", "verify", "reshard"])
def test_quiet_and_verbose_together_is_a_usage_error(command: str, tmp_path: Path) -> None:
    args = [tmp_path, tmp_path / "out"] if command in ("merge", "reshard") else [tmp_path]
    r = run(command, *args, "-q", "-v")
    assert r.exit_code == 2
    assert "pass one of --quiet and --verbose" in r.output


# -- examples/fsdp2_checkpoint.py


def test_the_example_writer_says_transformers_is_missing_before_starting(
        tmp_path: Path) -> None:
    code = ("import sys, runpy\nsys.modules['transformers'] = None\n"
            f"sys.argv = ['fsdp2_checkpoint.py', {str(tmp_path / 'ckpt')!r}]\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "from examples.fsdp2_checkpoint import main\nraise SystemExit(main())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=cli_env(), timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == (
        "fsdp2_checkpoint.py: error: --kind llama needs transformers, which is not installed: "
        "pip install transformers (make demo installs it in .venv)")
    assert "Traceback" not in r.stderr and not (tmp_path / "ckpt").exists()


def test_the_example_writer_takes_sizes(tmp_path: Path) -> None:
    import json

    from safetensors import safe_open

    from examples.fsdp2_checkpoint import main

    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--hidden-size", "30"])  # not a multiple of 4
    out = tmp_path / "ckpt"
    assert main([str(out), "--hidden-size", "48", "--layers", "1", "--vocab-size", "160"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            config["vocab_size"]) == (48, 96, 1, 160)
    assert run("merge", "--weights-only", out, tmp_path / "merged", "-q").exit_code == 0
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "np") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [160, 48]
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_shape() == [96, 48]


def test_verbose_with_all_says_it_applies_to_one_checkpoint(tmp_path: Path) -> None:
    r = run("merge", tmp_path, tmp_path / "out", "--all", "-v")
    assert r.exit_code == 2
    assert "applies to one checkpoint; with --all each line already says" in r.output
