"""Everyday use (issue 38): ``--json`` on failure, one-line usage errors, progress in logs,
run directories given as a checkpoint, flag spellings, the API's names.

Each test here failed (or the feature was missing) before the change it pins. The program is
run through :func:`ckpttool.cli.main`, as the ``ckpttool`` command runs it (a ``CliRunner``
bypasses the program's own handling of the parser's errors)."""

from __future__ import annotations

import gc
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ckpttool
from ckpttool import settings
from ckpttool.cli import main
from ckpttool.cli.progress import PlainLines
from ckpttool.units import human_bytes


class Ran:
    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        self.code, self.stdout, self.stderr = code, stdout, stderr

    def doc(self) -> dict[str, object]:
        doc = json.loads(self.stdout)
        assert isinstance(doc, dict)
        return doc


def program(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
            *args: str | Path) -> Ran:
    """``ckpttool ARGS`` as the program runs it, in this process."""
    monkeypatch.setattr(sys, "argv", ["ckpttool", *map(str, args)])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGPIPE)}
    capsys.readouterr()
    try:
        main()
    except SystemExit as e:
        code = 0 if e.code is None else e.code
    else:
        raise AssertionError("main() returned")
    finally:
        gc.unfreeze()
        for s, h in handlers.items():
            signal.signal(s, h)
    out, err = capsys.readouterr()
    assert isinstance(code, int)
    return Ran(code, out, err)


# -- --json on failure: one document, whatever failed


def failure_doc(r: Ran, command: str | None, exit_code: int, code: str) -> str:
    assert r.code == exit_code, r.stderr
    doc = r.doc()
    assert doc["ok"] is False and doc["command"] == command and doc["exit_code"] == exit_code
    assert doc["schema"] == 1
    error = doc["error"]
    assert isinstance(error, dict) and error["code"] == code, error
    assert isinstance(error["message"], str)
    return error["message"]


def test_json_on_a_missing_input(capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for command in ("merge", "reshard"):
        extra = ("--to", "safetensors") if command == "reshard" else ()
        r = program(capsys, monkeypatch, command, tmp_path / "nosuch", tmp_path / "o",
                    *extra, "--json")
        message = failure_doc(r, command, 3, "input")
        assert message == f"{tmp_path / 'nosuch'}: no such file or directory"
        assert r.stderr == f"ckpttool: error: {message}\n"
    for command in ("inspect", "verify"):
        r = program(capsys, monkeypatch, command, tmp_path / "nosuch", "--json")
        failure_doc(r, command, 3, "input")


def test_json_on_usage_errors_of_the_parser_and_of_a_command(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    r = program(capsys, monkeypatch, "merge", tmp_path, tmp_path / "o", "--dtype", "x",
                "--json")
    message = failure_doc(r, "merge", 2, "usage")
    assert message == ("Invalid value for '--dtype': 'x' is not one of auto, keep, bf16, fp16, "
                       "fp32 (or bfloat16, float16, float32); see 'ckpttool merge --help'")
    # One line in ckpttool's words, not the parser's four (Usage / Try / blank / Error).
    assert r.stderr == f"ckpttool: error: {message}\n"
    r = program(capsys, monkeypatch, "inspect", tmp_path, "--bogus", "--json")
    assert "No such option: --bogus" in failure_doc(r, "inspect", 2, "usage")
    r = program(capsys, monkeypatch, "merge", tmp_path, "--json")
    assert failure_doc(r, "merge", 2, "usage") == ("Missing argument 'OUT'; see 'ckpttool "
                                                   "merge --help'")
    r = program(capsys, monkeypatch, "verify", tmp_path, "--write-manifest", "a",
                "--check-manifest", "b", "--json")
    assert "pass one of --write-manifest and --check-manifest" in failure_doc(
        r, "verify", 2, "usage")
    r = program(capsys, monkeypatch, "merge", tmp_path, tmp_path / "o", "--slice", "3/3",
                "--json")
    failure_doc(r, "merge", 2, "usage")  # the library's UsageError


def test_without_json_a_usage_error_prints_nothing_on_stdout(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    r = program(capsys, monkeypatch, "merge", tmp_path, tmp_path / "o", "--dtype", "x")
    assert r.code == 2 and r.stdout == ""
    assert r.stderr.startswith("ckpttool: error: Invalid value for '--dtype'")
    assert r.stderr.count("\n") == 1
    # No arguments at all: the help, as before (exit 2).
    r = program(capsys, monkeypatch)
    assert r.code == 2 and r.stderr.startswith("Usage: ckpttool [OPTIONS] COMMAND")


def test_json_on_output_unsupported_bug_and_interrupt(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        uneven_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert program(capsys, monkeypatch, "merge", "--weights-only", uneven_ckpt, out).code == 0
    r = program(capsys, monkeypatch, "merge", "--weights-only", uneven_ckpt, out, "--json")
    assert "--overwrite" in failure_doc(r, "merge", 3, "output")

    def raising(e: BaseException):  # type: ignore[no-untyped-def]
        def boom(*args: object, **kwargs: object) -> None:
            raise e
        return boom

    for e, exit_code, code in ((ckpttool.UnsupportedError("not yet"), 4, "unsupported"),
                               (RuntimeError("boom"), 70, "bug"),
                               (KeyboardInterrupt(), 130, "interrupted")):
        monkeypatch.setattr("ckpttool.core.merge.operation.plan_merge", raising(e))
        r = program(capsys, monkeypatch, "merge", "--weights-only",
                    uneven_ckpt, tmp_path / "o2", "--json")
        message = failure_doc(r, "merge", exit_code, code)
        assert {"unsupported": "not yet", "bug": "RuntimeError: boom"}.get(code, message) \
            == message


def test_json_of_a_failed_verify_is_its_report(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        uneven_ckpt: Path, tmp_path: Path) -> None:
    r = program(capsys, monkeypatch, "verify", uneven_ckpt, "--expect-dtype", "fp16", "--json")
    assert r.code == 1
    doc = r.doc()  # one document: the report, not a failure document after it
    assert doc["ok"] is False and "problems" in doc


def test_version_short_flag(capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    for flag in ("--version", "-V"):
        r = program(capsys, monkeypatch, flag)
        assert (r.code, r.stdout) == (0, f"ckpttool {ckpttool.__version__}\n")


# -- progress in logs: plain lines where stderr is no terminal


def cli_env(**extra: str) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "CKPTTOOL_PROGRESS"}
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{root}{os.pathsep}{path}" if path else root
    return {**env, **extra}


def merge_stderr(src: Path, out: Path, *extra: str, terminal: bool,
                 env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``ckpttool merge`` with stderr on a pseudo-terminal or a pipe; its stderr."""
    argv = [sys.executable, "-m", "ckpttool", "merge", "--weights-only", str(src), str(out), *extra]
    env = env if env is not None else cli_env(TERM="xterm-256color")
    if not terminal:
        r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                           text=True, timeout=300)
        return r.returncode, r.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the other side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return proc.wait(timeout=300), b"".join(chunks).decode().replace("\r\n", "\n")


def progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("merging: ")]


PLAIN_DONE = re.compile(r"merging: 100% \([0-9.]+ K?B of [0-9.]+ K?B, [0-9.]+ [KMG]?B/s, "
                        r"done in 0:00:\d\d\)")


def test_a_pipe_gets_plain_progress_lines(uneven_ckpt: Path, tmp_path: Path) -> None:
    code, stderr = merge_stderr(uneven_ckpt, tmp_path / "a", terminal=False)
    assert code == 0, stderr
    lines = progress_lines(stderr)
    assert lines[0] == ("merging: planning (recognising the checkpoint, reading its metadata, "
                        "checks)")
    assert PLAIN_DONE.fullmatch(lines[-1]), lines
    assert "\x1b" not in stderr
    for off in (["--progress", "none"], ["--no-progress"]):
        code, stderr = merge_stderr(uneven_ckpt, tmp_path / off[-1], *off, terminal=False)
        assert code == 0 and progress_lines(stderr) == [], stderr
    code, stderr = merge_stderr(uneven_ckpt, tmp_path / "e", terminal=False,
                                env=cli_env(CKPTTOOL_PROGRESS="none"))
    assert code == 0 and progress_lines(stderr) == [], stderr


def test_a_terminal_gets_the_bar_unless_plain_is_asked(uneven_ckpt: Path,
                                                       tmp_path: Path) -> None:
    code, stderr = merge_stderr(uneven_ckpt, tmp_path / "a", terminal=True)
    assert code == 0, stderr
    assert "\x1b[" in stderr and not any(PLAIN_DONE.fullmatch(x) for x in stderr.splitlines())
    for how in (["--progress", "plain"], []):
        env = cli_env(TERM="xterm", CKPTTOOL_PROGRESS="plain") if not how else None
        code, stderr = merge_stderr(uneven_ckpt, tmp_path / f"p{len(how)}", *how,
                                    terminal=True, env=env)
        assert code == 0 and "\x1b" not in stderr, stderr
        assert PLAIN_DONE.fullmatch(progress_lines(stderr)[-1]), stderr


def test_plain_lines_every_tenth_or_30_seconds_never_twice_a_second() -> None:
    said: list[str] = []
    now = [0.0]
    lines = PlainLines("verifying", said.append, clock=lambda: now[0])
    lines.start(1000)
    for t, n in ((0.5, 200), (40.0, 10), (50.0, 10), (80.0, 10), (100.0, 770)):
        now[0] = t
        lines.advance(n)
    assert said == [
        "verifying: 21% (210 B of 1.00 KB, 5 B/s, 0:02:30 left)",  # 0.5 s: too soon for 20%
        "verifying: 23% (230 B of 1.00 KB, 2 B/s, 0:04:28 left)",  # 30 s on: a line anyway
        "verifying: 100% (1.00 KB of 1.00 KB, 10 B/s, done in 0:01:40)"]


def test_plain_lines_never_count_past_their_total() -> None:
    """A record's own bytes (headers, a checksummed storage) may add to what a command
    expected to read: the total grows, never "490 B of 172 B"."""
    said: list[str] = []
    lines = PlainLines("verifying", said.append, clock=lambda: 1.0)
    lines.start(172)
    lines.advance(490)
    assert said[-1].startswith("verifying: 100% (490 B of 490 B"), said


def test_a_bad_progress_value_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    r = program(capsys, monkeypatch, "inspect", tmp_path, "--progress", "loud")
    assert r.code == 2
    assert r.stderr == ("ckpttool: error: Invalid value for '--progress': 'loud' is not one "
                        "of auto, bar, plain, none; see 'ckpttool inspect --help'\n")


# -- CKPTTOOL_* flags: the usual spellings, or a word that the value was ignored


@pytest.mark.parametrize(("raw", "want"), [
    ("1", True), ("true", True), ("YES", True), ("on", True), (" True ", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False)])
def test_flags_take_the_usual_spellings(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str], raw: str,
                                        want: bool) -> None:
    monkeypatch.setenv("CKPTTOOL_DEBUG", raw)
    monkeypatch.setenv("CKPTTOOL_FORK", raw)
    assert settings.debug() is want
    assert settings.fork() is (want or raw == "")  # default on
    assert capsys.readouterr().err == ""


def test_a_flag_value_that_means_nothing_is_said_to_be_ignored(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CKPTTOOL_DEBUG", "maybe")
    monkeypatch.setenv("CKPTTOOL_PROGRESS", "loud")
    monkeypatch.setattr(settings, "_warned", set())
    assert settings.debug() is False and settings.debug() is False
    assert settings.progress() == "auto"
    assert capsys.readouterr().err == (
        "ckpttool: warning: CKPTTOOL_DEBUG='maybe' ignored: expected 1, true, yes or on; 0, "
        "false, no or off\n"
        "ckpttool: warning: CKPTTOOL_PROGRESS='loud' ignored: expected auto, bar, plain, none\n")


# -- a run directory where one checkpoint is expected


def test_a_run_directory_is_named_as_one(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch, uneven_ckpt: Path,
                                         tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (500, 1500, 1000):  # HF Trainer's: checkpoint-N/pytorch_model_fsdp_0/
        shutil.copytree(uneven_ckpt, run / f"checkpoint-{step}")
    (run / "runs").mkdir()  # TensorBoard's, beside them
    r = program(capsys, monkeypatch, "merge", run, tmp_path / "out", "--json")
    message = failure_doc(r, "merge", 3, "input")
    assert message == (
        f"{run}: a training run directory with 3 checkpoints (steps 500 to 1500), not one "
        f"checkpoint; the latest is checkpoint-1500: ckpttool merge {run / 'checkpoint-1500'} "
        f"OUT, or every one: ckpttool merge {run} OUT_ROOT --all")
    r = program(capsys, monkeypatch, "verify", run)
    assert r.code == 3 and r.stderr.endswith(
        f"ckpttool verify {run / 'checkpoint-1500'} (ckpttool merge {run} OUT_ROOT --all "
        "merges every one)\n")
    # The one it names is the one to pass.
    r = program(capsys, monkeypatch, "merge", "--weights-only",
                run / "checkpoint-1500", tmp_path / "out")
    assert r.code == 0, r.stderr


def test_a_run_directory_of_one_checkpoint_names_it(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     uneven_ckpt: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(uneven_ckpt, run / "checkpoint-500")
    r = program(capsys, monkeypatch, "inspect", run)
    assert r.code == 3 and r.stderr.endswith(
        f"{run}: a training run directory holding one checkpoint, checkpoint-500, not a "
        f"checkpoint itself: ckpttool inspect {run / 'checkpoint-500'}\n"), r.stderr


# -- exit 2 for every bad value


@pytest.mark.parametrize("bad", [["--steps", "every 7x"], ["--steps", "9-1"],
                                 ["--task", "2/2"], ["--task", "x"]])
def test_a_bad_sweep_value_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            bad: list[str]) -> None:
    r = program(capsys, monkeypatch, "merge", tmp_path, tmp_path / "o", "--all", *bad,
                "--json")
    assert failure_doc(r, "merge", 2, "usage").startswith(f"{bad[0]} {bad[1]!r}: ")


def test_iteration_of_a_checkpoint_that_is_no_megatron_run_is_a_usage_error(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        uneven_ckpt: Path, tmp_path: Path) -> None:
    r = program(capsys, monkeypatch, "merge", uneven_ckpt, tmp_path / "o", "--iteration", "2")
    assert r.code == 2, r.stderr
    assert "--iteration 2 picks one iteration of a Megatron-Core run directory" in r.stderr
    assert not (tmp_path / "o").exists()


# -- reports


def test_merge_all_reports_output_sizes_rates_and_one_line_per_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        uneven_ckpt: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (1, 2):
        shutil.copytree(uneven_ckpt, run / f"checkpoint-{step}")
    damaged = run / "checkpoint-2" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    os.truncate(damaged, damaged.stat().st_size // 2)
    # damaged, not a copy in progress (a short file changed within the hour is taken for one)
    from ckpttool.core.merge import sweep as sweep_mod
    monkeypatch.setattr(sweep_mod, "STALE_SECONDS", -1.0)
    r = program(capsys, monkeypatch, "merge", "--weights-only",
                run, tmp_path / "out", "--all", "--settle", "0")
    assert r.code == 3, r.stderr
    merged = (tmp_path / "out" / "checkpoint-1" / "model.safetensors").stat().st_size
    line = r.stdout.splitlines()[0]
    # the output's size (the model file), not the source's (which holds the optimizer too)
    assert line.startswith(f"merged      checkpoint-1 -> {tmp_path / 'out' / 'checkpoint-1'} (")
    assert re.search(r" in \d+\.\d s \([0-9.]+ [KMG]?B/s\)$", line), line
    size = line.split(" (")[1].split(")")[0]
    assert size == human_bytes(merged)
    said = r.stderr.splitlines()
    head = next(x for x in said if x.startswith("merge --all: "))
    assert head.startswith("merge --all: 1 merged, 1 failed; ") and head.endswith("B/s)")
    assert any(x.startswith("  failed: checkpoint-2 (exit 3): ") for x in said), said
    assert "\\n" not in r.stderr


def test_a_watched_checkpoint_is_counted_once() -> None:
    from ckpttool.cli.sweep import summary
    from ckpttool.core.merge.sweep import Found, Outcome

    found = Found("checkpoint-1", Path("run/checkpoint-1"), 1, 10, None)
    waiting = Outcome(found, Path("out/checkpoint-1"), "waiting", "a file changed")
    merged = Outcome(found, Path("out/checkpoint-1"), "merged")
    assert summary([waiting, merged], dry_run=False, watch=True) == (
        "merge --all (watch ended): 1 merged, 0 failed")


def test_no_config_warning_says_the_cast_asked_for(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        uneven_ckpt: Path, tmp_path: Path) -> None:
    model = uneven_ckpt / "pytorch_model_fsdp_0"
    r = program(capsys, monkeypatch, "merge", "--weights-only",
                model, tmp_path / "o", "--dtype", "bf16")
    assert r.code == 0, r.stderr
    assert "floating tensors are cast to BF16 (--dtype)" in r.stderr
    assert "dtypes are kept as stored" not in r.stderr


# -- the API: the command's names, dir()


def test_verify_takes_the_commands_manifest_names(uneven_ckpt: Path, tmp_path: Path) -> None:
    sums = tmp_path / "m.json"
    written = ckpttool.verify(uneven_ckpt, write_manifest=sums)
    assert written.ok and written.manifest is not None and written.manifest.action == "written"
    checked = ckpttool.verify(uneven_ckpt, check_manifest=sums)
    assert checked.ok and checked.manifest is not None and checked.manifest.action == "checked"
    with pytest.raises(ckpttool.UsageError, match="pass one of write_manifest and "
                                                  "check_manifest"):
        ckpttool.verify(uneven_ckpt, write_manifest=sums, check_manifest=sums)


def test_dir_lists_the_api_not_the_imports() -> None:
    names = dir(ckpttool)
    assert {"inspect", "merge", "reshard", "verify", "__version__"} <= set(names)
    assert not {"Any", "TYPE_CHECKING", "import_module", "annotations"} & set(names)


# -- verify's names-not-hf: which map merge uses, and a message that reads


def test_names_not_hf_says_what_merge_does_and_reads() -> None:
    from ckpttool.core.checkpoint import architecture

    llama = {"model_type": "llama"}
    odd = architecture.check(["foo.weight", "bar.weight"], llama)
    assert odd is not None and odd.message() == (
        "2 of 2 tensor names (e.g. 'bar.weight') are not the names transformers' model_type "
        "'llama' gives its weights (model.* and lm_head.*): from_pretrained would load none "
        "of them and leave those weights randomly initialised; rename them to the Hugging "
        "Face architecture's names first")
    peft = architecture.check(["base_model.model.model.layers.0.self_attn.q_proj.weight",
                               "base_model.model.lm_head.weight"], llama)
    assert peft is not None and peft.message().endswith(
        "; ckpttool merge maps PEFT's names itself (base_model.model. and .base_layer "
        "removed, the adapter folded or written for PEFT)")
    megatron = architecture.check(["decoder.layers.0.mlp.linear_fc1.weight",
                                   "embedding.word_embeddings.weight"], None)
    assert megatron is not None and "rename them" not in megatron.message()
    assert "ckpttool merge maps Megatron-Core names itself" in megatron.message()


# -- completion values


def complete(line: str) -> str:
    env = {**cli_env(), "_CKPTTOOL_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": line}
    return subprocess.run([sys.executable, "-m", "ckpttool"], env=env, capture_output=True,
                          text=True, timeout=120).stdout


def test_completion_offers_every_value() -> None:
    layout = complete("ckpttool merge a b --layout ")
    assert '"hub":' in layout and '"stored":' in layout
    assert '"none":"keep the stored names"' in complete("ckpttool merge a b --names n")
    assert '"latest":' in complete("ckpttool merge a b --all --steps l")
    # zsh would drop an ASCII apostrophe from a description (Typer doubles it)
    assert "''" not in complete("ckpttool merge a b --dtype ")
    assert "config.json\u2019s torch_dtype" in complete("ckpttool merge a b --dtype a")


def test_no_tie_note_where_config_unties(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "model"
    src.mkdir()
    embed = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()},
              str(src / "model.safetensors"))
    for tied, said in ((False, False), (True, True)):
        (src / "config.json").write_text(json.dumps(
            {"model_type": "llama", "tie_word_embeddings": tied, "torch_dtype": "float32"}))
        r = program(capsys, monkeypatch, "merge", "--weights-only", src, tmp_path / f"o{tied}")
        assert r.code == 0, r.stderr
        notes = [x for x in r.stdout.splitlines() if x.lstrip().startswith(("tie", "tied"))]
        assert bool(notes) is said, r.stdout


# -- --strict, for CI


def test_strict_makes_a_warning_exit_1(capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "model"
    src.mkdir()
    save_file({"foo.weight": torch.ones(4), "bar.weight": torch.ones(4)},
              str(src / "model.safetensors"))  # no config.json: a merge warns
    r = program(capsys, monkeypatch, "merge", "--weights-only", src, tmp_path / "a")
    assert r.code == 0 and "ckpttool: warning: no config.json found" in r.stderr
    r = program(capsys, monkeypatch, "merge", "--weights-only",
                src, tmp_path / "b", "--strict", "--json")
    assert r.code == 1, r.stderr
    assert r.doc()["warnings"]  # the report, once: no failure document after it
    assert (tmp_path / "b" / "model.safetensors").exists()  # the output is written
    assert r.stderr.endswith("ckpttool: error: 1 warning and --strict: exit 1\n")
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = program(capsys, monkeypatch, "verify", src)
    assert r.code == 0 and "warning: names-not-hf: " in r.stdout
    r = program(capsys, monkeypatch, "verify", src, "--strict")
    assert r.code == 1 and "--strict: exit 1" in r.stderr
    r = program(capsys, monkeypatch, "merge", tmp_path, tmp_path / "c", "--all", "--strict")
    assert r.code == 2


def test_the_hub_recipe_runs_hf_upload_per_checkpoint_and_honours_its_exit(
        uneven_ckpt: Path, tmp_path: Path) -> None:
    """docs/sweep.md's recipe, with a stand-in ``hf`` on PATH that logs its arguments."""
    run = tmp_path / "run"
    for step in (500, 1000):
        shutil.copytree(uneven_ckpt, run / f"checkpoint-{step}")
    bin_dir, log = tmp_path / "bin", tmp_path / "hf.log"
    bin_dir.mkdir()
    hf = bin_dir / "hf"
    hf.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncase "$*" in *step-1000*) exit 1;; esac\n')
    hf.chmod(0o755)
    out = tmp_path / "merged"
    r = subprocess.run(  # a process of its own: --then's output goes to its stderr
        [sys.executable, "-m", "ckpttool", "merge", "--weights-only",
            str(run), str(out), "--all", "--settle",
         "0", "--then",
         'hf upload my-org/my-model "$CKPTTOOL_OUT" . --revision "step-$CKPTTOOL_STEP"'],
        env=cli_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"), capture_output=True,
        text=True, timeout=300)
    assert r.returncode == 3, r.stderr  # the failed upload fails its checkpoint
    assert log.read_text().splitlines() == [
        f"upload my-org/my-model {out / 'checkpoint-500'} . --revision step-500",
        f"upload my-org/my-model {out / 'checkpoint-1000'} . --revision step-1000"]
    assert "failed: checkpoint-1000 (exit 3): merged, but --then exited 1" in r.stderr


@pytest.mark.parametrize("name, call", [
    ("CKPTTOOL_DIST_TIMEOUT", "dist_timeout"), ("CKPTTOOL_LOCK_STALE", "lock_stale"),
    ("CKPTTOOL_REQUEST_TIMEOUT", "request_timeout"), ("CKPTTOOL_RESUME_PIECE", "resume_piece"),
    ("CKPTTOOL_PART_SIZE", "part_size")])
def test_number_knobs_refuse_what_is_not_a_positive_number(name: str, call: str,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from ckpttool import settings
    from ckpttool.errors import OutputError

    read = getattr(settings, call)
    monkeypatch.delenv(name, raising=False)
    default = read()
    for bad in ("0", "-3", "soon", "inf"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(OutputError, match=f"^{name}='{bad}': expected .* above 0, e.g. "):
            read()
    monkeypatch.setenv(name, "7")
    assert read() == 7 and default > 0
