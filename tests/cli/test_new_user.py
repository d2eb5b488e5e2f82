"""What a new user meets first: installs without numpy or torch, shell completion in each
shell, option spellings, pipes, unreadable files, --dry-run, help text, the typed API.

Each test here failed (or the feature was missing) before the fix it pins."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("merge", "inspect", "verify", "reshard")


def run(*args: str | Path, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def cli_env() -> dict[str, str]:
    """The environment a subprocess needs to run this checkout's ckpttool."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


def run_without(module: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """The CLI in a process where ``import <module>`` fails, as on a machine without it
    (``module``: one name, or several separated by commas)."""
    code = ("import sys\n"
            + "".join(f"sys.modules[{m!r}] = None\n" for m in module.split(","))
            + f"sys.argv = ['ckpttool', *{[str(a) for a in args]!r}]\n"
            "from ckpttool.cli import main\nmain()\n")
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                          text=True, env=cli_env(), timeout=300)


def no_temp_files(*dirs: Path) -> bool:
    return not [p for d in dirs if d.exists() for p in d.rglob("*ckpttool-tmp*")]


# -- torch without numpy (a user's own torch build)


def test_casts_and_value_checks_need_no_numpy(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_without("numpy", "merge", llama_ckpt, out, "--dtype", "bf16", "-q")
    assert r.returncode == 0, r.stderr
    r = run_without("numpy", "verify", llama_ckpt, "--against", out, "--allow-cast", "--dtype",
                    "bf16")
    assert r.returncode == 0, r.stderr
    r = run_without("numpy", "inspect", out, "--stats", "--json")
    assert r.returncode == 0, r.stderr
    assert all(t["stats"]["nan"] == 0 for t in json.loads(r.stdout)["tensors"])
    assert run("merge", llama_ckpt, tmp_path / "ref", "--dtype", "bf16", "-q").exit_code == 0
    assert ((out / "model.safetensors").read_bytes()
            == (tmp_path / "ref" / "model.safetensors").read_bytes())


def test_without_torch_the_commands_that_need_it_say_install_torch(llama_ckpt: Path,
                                                                     tmp_path: Path) -> None:
    # (A small float32 -> bfloat16 cast needs no torch: dtypes.f32_to_bf16; fp16 does.)
    for without, args in (("torch", ("merge", llama_ckpt, tmp_path / "out", "--dtype", "fp16")),
                          ("torch,numpy", ("verify", llama_ckpt)),
                          ("torch", ("inspect", llama_ckpt, "--stats"))):
        r = run_without(without, *args)
        assert r.returncode == 4, (args, r.stderr)
        assert r.stderr == ("ckpttool: error: this needs PyTorch (reading values, casting, "
                            "writing DCP), which is not installed here; install it: pip "
                            "install torch\n")
    assert no_temp_files(tmp_path)
    # What needs no torch still runs without it.
    r = run_without("torch", "merge", llama_ckpt, tmp_path / "kept", "--dtype", "keep", "-q")
    assert r.returncode == 0, r.stderr
    assert run_without("torch", "inspect", llama_ckpt, "-q").returncode == 0
    # verify checks values from their bit patterns with numpy, without torch.
    r = run_without("torch", "verify", llama_ckpt)
    assert r.returncode == 0, r.stderr
    assert "0 errors" in r.stdout


# -- shell completion, in each shell


@pytest.fixture(scope="module")
def on_path(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment whose PATH has a ``ckpttool`` that runs this checkout."""
    bin_dir = tmp_path_factory.mktemp("bin")
    exe = bin_dir / "ckpttool"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m ckpttool \"$@\"\n")
    exe.chmod(0o755)
    env = cli_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def shell(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (apt-get install -y {name}; .ci/run installs it)")
    return found


def test_bash_completes(on_path: dict[str, str]) -> None:
    script = ROOT / "completions" / "ckpttool.bash"
    code = (f"source {script}\n"
            "COMP_WORDS=(ckpttool me); COMP_CWORD=1; _ckpttool_completion ckpttool\n"
            'printf "%s\\n" "${COMPREPLY[@]}"\n'
            "COMP_WORDS=(ckpttool merge --dr); COMP_CWORD=2; _ckpttool_completion ckpttool\n"
            'printf "%s\\n" "${COMPREPLY[@]}"\n')
    r = subprocess.run([shell("bash"), "--norc", "--noprofile", "-c", code], env=on_path,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["merge", "--dry-run"], r.stderr


def test_zsh_completes_from_fpath_on_the_first_tab(on_path: dict[str, str]) -> None:
    # As README says: the file in $fpath, compinit. compinit finds it only by its first line
    # (#compdef); the first TAB runs the file itself as _ckpttool, which must complete.
    # _arguments (what the program's answer calls) is replaced to print what it is given.
    code = ("fpath=($COMPLETIONS $fpath); autoload -Uz compinit; compinit -u -D\n"
            'print -r -- "registered: $_comps[ckpttool]"\n'
            '_arguments() { print -r -- "$@" }\n'
            "words=(ckpttool me); CURRENT=2; _ckpttool\n"
            "words=(ckpttool merge --dr); CURRENT=3; _ckpttool\n")
    env = {**on_path, "COMPLETIONS": str(ROOT / "completions")}
    r = subprocess.run([shell("zsh"), "-f", "-c", code], env=env, capture_output=True,
                       text=True, timeout=120)
    lines = r.stdout.splitlines()
    assert lines[0] == "registered: _ckpttool", r.stdout + r.stderr
    assert lines[1].startswith('*: :(("merge":"Merge a checkpoint'), r.stdout + r.stderr
    assert '"--dry-run":"Show what would be written' in r.stdout, r.stdout + r.stderr


def test_zsh_completes_when_sourced(on_path: dict[str, str]) -> None:
    code = ("autoload -Uz compinit; compinit -u -D\n"
            f"source {ROOT / 'completions' / '_ckpttool'}\n"
            'print -r -- "registered: $_comps[ckpttool]"\n'
            '_arguments() { print -r -- "$@" }\n'
            "words=(ckpttool me); CURRENT=2; _ckpttool_completion\n")
    r = subprocess.run([shell("zsh"), "-f", "-c", code], env=on_path, capture_output=True,
                       text=True, timeout=120)
    lines = r.stdout.splitlines()
    assert lines[0] == "registered: _ckpttool_completion", r.stdout + r.stderr
    assert lines[1].startswith('*: :(("merge":"Merge a checkpoint'), r.stdout + r.stderr


def test_fish_completes(on_path: dict[str, str]) -> None:
    code = (f"source {ROOT / 'completions' / 'ckpttool.fish'}\n"
            "complete -C 'ckpttool me'\ncomplete -C 'ckpttool merge --dr'\n")
    r = subprocess.run([shell("fish"), "--no-config", "-c", code], env=on_path,
                       capture_output=True, text=True, timeout=120)
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == ["merge", "--dry-run"], (
        r.stdout + r.stderr)


def test_completion_imports_neither_torch_nor_the_operations(on_path: dict[str, str]) -> None:
    # Every TAB runs the program: it must stay light (typer's own import of pydantic on this
    # path is the rest of its cost; see README).
    code = ("import sys\nfrom ckpttool.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('ckpttool.core'))\n"
            "assert not loaded, loaded\n")
    env = {**on_path, "_CKPTTOOL_COMPLETE": "complete_bash",
           "COMP_WORDS": "ckpttool merge --d", "COMP_CWORD": "2"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--dtype" in r.stdout.split()


# -- option spellings and usage errors


@pytest.mark.parametrize("spelling", ["bfloat16", "float16", "float32", "torch.bfloat16"])
def test_verify_takes_every_dtype_spelling(spelling: str, llama_ckpt: Path,
                                           tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("merge", llama_ckpt, out, "--dtype", spelling, "-q").exit_code == 0
    r = run("verify", llama_ckpt, "--against", out, "--allow-cast", "--dtype", spelling, "-q")
    assert r.exit_code == 0, r.output
    r = run("verify", out, "--expect-dtype", spelling, "--json")
    assert r.exit_code == 0, r.output


def test_a_bad_shard_size_is_a_usage_error_in_reshard(tmp_path: Path) -> None:
    save_file({"w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    r = run("reshard", tmp_path / "model.safetensors", tmp_path / "o", "--to", "safetensors",
            "--max-shard-size", "5XB")
    assert r.exit_code == 2
    assert ("Invalid value for '--max-shard-size': invalid size '5XB'; write it like 5GB, "
            "500MB or 2GiB") in r.stderr
    assert not (tmp_path / "o").exists()


# -- pipes


def test_merge_into_a_closed_pipe_leaves_no_temporary_files(llama_ckpt: Path,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ckpttool", "merge", str(llama_ckpt),
                             str(out), "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=cli_env())
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| true` does: the reader is gone before the report is printed
    proc.wait(timeout=300)
    assert proc.returncode in (0, -13), proc.returncode  # -13: SIGPIPE, the shell's 141
    assert proc.stderr.read() == b""
    assert no_temp_files(out, llama_ckpt)
    assert run("verify", llama_ckpt, "--against", out, "--allow-cast", "-q").exit_code == 0


# -- merge reads what inspect reads: full weights too


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_merge_takes_a_file_of_full_weights(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = {"model.embed.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4),
             "lm_head.weight": torch.randn(8, 4).to(torch.bfloat16)}
    src = tmp_path / "src" / name
    src.parent.mkdir()
    if name.endswith(".bin"):
        torch.save(state, src)
    else:
        save_file(state, str(src))
    out = tmp_path / "out"
    r = run("merge", "--weights-only", src, out, "--dtype", "keep", "--json")
    assert r.exit_code == 0, r.output
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8),
                                                       v.view(torch.uint8)), k


# -- files this user may not read


def _unprivileged() -> list[str]:
    """A command prefix that runs a program without the power to read other users' files.

    Tests run as root here: as nobody, when nobody can run this Python and read this checkout;
    else as root without the two capabilities that bypass file permissions (the kernel then
    checks permissions as for any user). Not root: no prefix needed."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root and setpriv (util-linux) is not installed: no way to run "
                    "the CLI unprivileged")
    probe = [sys.executable, "-c", "import ckpttool.cli"]
    for prefix in ([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"],
                   [setpriv, "--bounding-set=-dac_override,-dac_read_search"]):
        done = subprocess.run([*prefix, *probe], env=cli_env(), capture_output=True,
                              timeout=120, check=False)
        if done.returncode == 0:
            return prefix
    pytest.skip("no unprivileged user can run this Python here")


def run_unprivileged(prefix: list[str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "ckpttool", *map(str, args)],
                          env=cli_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture
def readable_copy(llama_ckpt: Path) -> Iterator[Path]:
    """A copy of the llama checkpoint every user may read, in a directory of the system's
    temporary directory that everyone may enter (pytest's own is private to its user)."""
    base = Path(tempfile.mkdtemp(prefix="ckpttool-shared-"))
    try:
        base.chmod(0o755)
        ckpt = Path(shutil.copytree(llama_ckpt, base / "ckpt"))
        for p in (ckpt, *ckpt.rglob("*")):
            p.chmod(0o755 if p.is_dir() else 0o644)
        yield ckpt
    finally:
        shutil.rmtree(base)


def unreadable_message(path: Path) -> str:
    return (f"ckpttool: error: {path}: cannot read it: Permission denied; make it readable "
            "for this user (chmod a+r, and a+x on its directories) or run as its owner\n")


def test_an_unreadable_data_file_is_exit_3_in_one_line(readable_copy: Path) -> None:
    prefix = _unprivileged()
    victim = readable_copy / "pytorch_model_fsdp_0" / "__1_0.distcp"
    victim.chmod(0)
    out = readable_copy.parent / "out"
    for args in (("verify", readable_copy), ("merge", readable_copy, out),
                 ("inspect", readable_copy, "--stats")):
        r = run_unprivileged(prefix, *args)
        assert r.returncode == 3, (args, r.stderr)
        assert r.stderr == unreadable_message(victim), args
        assert r.stdout == ""
    # In the optimizer checkpoint beside the model: verify reads it too.
    victim.chmod(0o644)
    other = readable_copy / "optimizer_0" / "__0_0.distcp"
    other.chmod(0)
    r = run_unprivileged(prefix, "verify", readable_copy)
    assert r.returncode == 3 and r.stderr == unreadable_message(other)
    assert no_temp_files(out)


def test_an_unreadable_config_or_metadata_is_exit_3_in_one_line(readable_copy: Path) -> None:
    prefix = _unprivileged()
    for victim in (readable_copy / "config.json",
                   readable_copy / "pytorch_model_fsdp_0" / ".metadata"):
        victim.chmod(0)
        for args in (("verify", readable_copy), ("inspect", readable_copy),
                     ("merge", readable_copy, readable_copy.parent / "out")):
            r = run_unprivileged(prefix, *args)
            assert r.returncode == 3, (victim, args, r.stderr)
            assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
            assert r.stderr.startswith(f"ckpttool: error: {victim}: cannot read"), r.stderr
        victim.chmod(0o644)
    # A directory that cannot be listed.
    (readable_copy / "pytorch_model_fsdp_0").chmod(0)
    try:
        r = run_unprivileged(prefix, "inspect", readable_copy)
        assert r.returncode == 3 and r.stderr.count("\n") == 1, r.stderr
        assert "Permission denied" in r.stderr and "Traceback" not in r.stderr
    finally:
        (readable_copy / "pytorch_model_fsdp_0").chmod(0o755)


# -- the same options everywhere


def test_every_command_takes_json_and_quiet_and_workers() -> None:
    for command in COMMANDS:
        r = run(command, "--help")
        assert r.exit_code == 0
        for option in ("--json", "-q, --quiet", "--workers N", "--no-progress"):
            assert option in r.stdout, (command, option)


def test_inspect_quiet_says_it_with_the_exit_code(uneven_ckpt: Path, tmp_path: Path) -> None:
    r = run("inspect", uneven_ckpt, "-q")
    assert r.exit_code == 0 and r.output == ""
    r = run("inspect", tmp_path, "-q")
    assert r.exit_code == 3 and r.stdout == "" and r.stderr.startswith("ckpttool: error: ")


def test_workers_do_not_change_results(llama_ckpt: Path, tmp_path: Path) -> None:
    docs = []
    for n in ("1", "3"):
        r = run("inspect", llama_ckpt, "--stats", "--json", "--workers", n)
        assert r.exit_code == 0, r.output
        docs.append(json.loads(r.stdout)["tensors"])
    assert docs[0] == docs[1] and all(t["stats"] for t in docs[0])
    merged = tmp_path / "merged"
    assert run("merge", llama_ckpt, merged, "--dtype", "keep", "-q").exit_code == 0
    for args in (("--ranks", "3"), ("--to", "safetensors", "--max-shard-size", "20KB")):
        outs = []
        for n in ("1", "4"):
            out = tmp_path / f"{args[1]}-{n}"
            src = llama_ckpt / "pytorch_model_fsdp_0" if args[0] == "--ranks" else merged
            r = run("reshard", src, out, *args, "--workers", n, "-q")
            assert r.exit_code == 0, r.output
            # (a .metadata differs by its random storage_meta.save_id)
            outs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())
                         if p.name != ".metadata"})
        assert outs[0] == outs[1] and len(outs[0]) > 1, args
        assert run("verify", out, "--against", src, "-q").exit_code == 0


# -- merge --dry-run


def _header(path: Path) -> tuple[int, dict[str, dict[str, object]]]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return 8 + n, json.loads(data[8 : 8 + n])


def test_dry_run_reports_the_plan_and_writes_nothing(llama_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = sorted(p.relative_to(llama_ckpt) for p in llama_ckpt.rglob("*"))
    r = run("merge", llama_ckpt, out, "--dry-run", "--json", "--max-shard-size", "30KB")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["dry_run"] is True
    assert not out.exists() and no_temp_files(llama_ckpt, tmp_path)
    assert sorted(p.relative_to(llama_ckpt) for p in llama_ckpt.rglob("*")) == before
    # The real merge writes exactly that.
    r = run("merge", llama_ckpt, out, "--json", "--max-shard-size", "30KB")
    assert r.exit_code == 0, r.output
    done = json.loads(r.stdout)
    for key in ("files", "num_tensors", "num_parameters", "total_bytes", "dtype", "tie",
                "bytes_after", "copied"):
        assert plan[key] == done[key], key
    assert done["dry_run"] is False and done["tensors"] == []
    assert len(plan["files"]) == 3  # two shards and the index
    by_file: dict[str, list[dict[str, object]]] = {}
    for t in plan["tensors"]:
        by_file.setdefault(str(t["file"]), []).append(t)
    for name, rows in by_file.items():
        start, header = _header(out / name)
        assert len(header) - 1 == len(rows)  # and __metadata__
        for t in rows:
            h = header[str(t["name"])]
            assert h["dtype"] == t["dtype"] and h["shape"] == t["shape"]
            begin, end = t["offsets"]  # type: ignore[misc]
            assert h["data_offsets"] == [begin - start, end - start]
            assert end - begin == t["bytes"]
    assert {t["source_dtype"] for t in plan["tensors"]} == {"F32"}
    assert {t["dtype"] for t in plan["tensors"]} == {"BF16"}


def test_dry_run_makes_the_checks_a_merge_makes(uneven_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    r = run("merge", "--weights-only", uneven_ckpt, out, "--dry-run")
    assert r.exit_code == 3 and "pass --overwrite" in r.stderr
    r = run("merge", "--weights-only", uneven_ckpt, out, "--dry-run", "--overwrite")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"dry run: would merge model {uneven_ckpt}/pytorch_model_fsdp_0 "
                               f"-> {out} (nothing written)\n")
    assert "  would write model.safetensors: " in r.stdout
    assert r.stdout.splitlines()[-8].split() == ["name", "shape", "dtype", "from", "size", "file"]
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"precious"
    r = run("merge", "--weights-only", uneven_ckpt, uneven_ckpt / "pytorch_model_fsdp_0" / "x",
            "--dry-run")
    assert r.exit_code == 3 and "choose an output directory outside it" in r.stderr


# -- help text


def test_help_prints_examples_as_written_and_names_the_arguments() -> None:
    for command in COMMANDS:
        r = run(command, "--help", env={"COLUMNS": "60"})
        assert r.exit_code == 0
        examples = [line.strip() for line in r.stdout.splitlines()
                    if line.strip().startswith("ckpttool ")]
        module = __import__(f"ckpttool.cli.{command}", fromlist=["EPILOG"])
        want = [line.strip() for line in module.EPILOG.splitlines()
                if line.strip().startswith("ckpttool ")]
        assert examples == want and want, command
        usage = r.stdout.splitlines()[0]
        # issue 38: no braces (typer's own usage puts required arguments in them)
        assert usage.endswith("[OPTIONS] SRC OUT" if command in ("merge", "reshard")
                              else "[OPTIONS] PATH"), usage
    long = "ckpttool merge outputs/checkpoint/step-1000 out/ --names torchtitan-llama3 --config hf/"
    assert long in run("merge", "--weights-only", "--help", env={"COLUMNS": "60"}).stdout


# -- progress on a dumb terminal


def test_a_dumb_terminal_gets_plain_progress_lines(uneven_ckpt: Path, tmp_path: Path) -> None:
    def stderr_on_a_terminal(*extra: str) -> str:
        leader, follower = pty.openpty()
        env = {**cli_env(), "TERM": "dumb", "CKPTTOOL_PROGRESS": "auto"}
        proc = subprocess.Popen([sys.executable, "-m", "ckpttool", "merge", "--weights-only",
                                 str(uneven_ckpt),
                                 str(tmp_path / f"out{len(extra)}"), "--json", *extra],
                                stdout=subprocess.DEVNULL,
                                stderr=follower, env=env)
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
        assert proc.wait(timeout=300) == 0
        return b"".join(chunks).decode().replace("\r\n", "\n")

    def progress_lines(*extra: str) -> list[str]:  # warnings (no config.json here) aside
        return [line for line in stderr_on_a_terminal(*extra).splitlines()
                if not line.startswith("ckpttool: warning: ")]

    lines = progress_lines()
    assert lines and lines[-1].startswith("merging: 100% (") and "\x1b" not in "".join(lines)
    assert progress_lines("--no-progress") == []


# -- the library's types and reports


def test_the_package_is_typed_in_the_wheel(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    import zipfile

    (wheel,) = tmp_path.glob("ckpttool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckpttool/py.typed" in names
    # issue 24: completion scripts where the shells look, the license, the project's URLs
    data = "ckpttool-0.1.0.data/data/share/"
    for script in ("bash-completion/completions/ckpttool.bash", "zsh/site-functions/_ckpttool",
                   "fish/vendor_completions.d/ckpttool.fish"):
        assert data + script in names
    assert "ckpttool-0.1.0.dist-info/licenses/LICENSE" in names
    metadata = zipfile.ZipFile(wheel).read("ckpttool-0.1.0.dist-info/METADATA").decode()
    assert "Project-URL: Documentation, https://github.com/ckpttool/ckpttool/blob/main/docs/" in (
        metadata)
    # issue 38: README.md links the docs relatively; the index's description links them whole
    assert "[merge]: docs/merge.md" in (ROOT / "README.md").read_text()
    assert "[merge]: https://github.com/ckpttool/ckpttool/blob/main/docs/merge.md" in metadata
    assert not re.search(r"(?m)^\[[^\]]+\]: (?!https?://)", metadata)


def test_every_report_is_json_serialisable(uneven_ckpt: Path, tmp_path: Path) -> None:
    reports = [ckpttool.merge(uneven_ckpt, tmp_path / "out", weights_only=True),
               ckpttool.merge(uneven_ckpt, tmp_path / "dry", dry_run=True, weights_only=True),
               ckpttool.inspect(uneven_ckpt, stats=True),
               ckpttool.verify(uneven_ckpt, against=tmp_path / "out", allow_cast=True),
               ckpttool.reshard(tmp_path / "out", tmp_path / "dcp", ranks=2)]
    for report in reports:
        doc = json.loads(json.dumps(report.to_json()))
        assert doc["schema"] == 1 and doc["command"] in COMMANDS


# -- issue 24: completion of option values, one line per description, fish runs us once


def complete_bash(words: str, env: dict[str, str]) -> list[str]:
    """What the program answers bash for the command line ``words`` (completing its last
    word, which may be empty)."""
    parts = words.split(" ")
    env = {**env, "_CKPTTOOL_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(parts) - 1)}
    r = subprocess.run([sys.executable, "-c", "from ckpttool.cli import main; main()"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize(("words", "values"), [
    ("ckpttool merge a b --dtype ", ["auto", "keep", "bf16", "fp16", "fp32"]),
    ("ckpttool merge a b --dtype b", ["bf16"]),
    ("ckpttool verify a --expect-dtype ", ["auto", "bf16", "fp16", "fp32"]),
    ("ckpttool verify a --allow-cast --dtype f", ["fp16", "fp32"]),
    ("ckpttool merge a b --lora ", ["fuse", "adapter"]),
    ("ckpttool merge a b --part ", ["model", "optimizer"]),
    ("ckpttool merge a b --names torchtitan-q", ["torchtitan-qwen3"]),
    ("ckpttool reshard a b --to ", ["dcp", "safetensors"]),
])
def test_option_values_complete(words: str, values: list[str]) -> None:
    assert complete_bash(words, cli_env()) == values


def test_every_name_map_completes() -> None:
    from ckpttool.cli.merge import NAME_MAPS

    # and none, which --names takes too (issue 38)
    assert complete_bash("ckpttool merge a b --names ", cli_env()) == [*NAME_MAPS, "none"]


def test_completed_dtypes_are_the_dtypes_merge_takes() -> None:
    from ckpttool.cli.common import DTYPE_VALUES
    from ckpttool.cli.merge import NAME_MAPS
    from ckpttool.core.transforms.maps import NAMES
    from ckpttool.formats.codecs.dtypes import CHOICES

    assert tuple(v for v, _ in DTYPE_VALUES) == CHOICES
    assert set(NAME_MAPS) == set(NAMES)


def test_fish_runs_the_program_once_per_tab_and_keeps_descriptions_whole(
        on_path: dict[str, str], tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "ckpttool"
    exe.write_text(f"#!/bin/sh\necho >> {calls}\nexec {sys.executable} -m ckpttool \"$@\"\n")
    exe.chmod(0o755)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").touch()
    env = {**on_path, "PATH": f"{bin_dir}{os.pathsep}{on_path['PATH']}"}
    code = (f"source {ROOT / 'completions' / 'ckpttool.fish'}\ncd {tmp_path}\n"
            "complete -C 'ckpttool merge --dtype '\necho ---\n"
            "complete -C 'ckpttool merge --d'\necho ---\n"
            "complete -C 'ckpttool merge ckpt/m'\n")
    r = subprocess.run([shell("fish"), "--no-config", "-c", code], env=env,
                       capture_output=True, text=True, timeout=120)
    values, options, files = r.stdout.split("---\n")
    assert [line.split("\t")[0] for line in values.splitlines()] == [
        "auto", "bf16", "fp16", "fp32", "keep"], r.stdout + r.stderr
    dtype = next(line for line in options.splitlines() if line.startswith("--dtype\t"))
    assert dtype.endswith("Float8, integer and bool tensors are never cast."), dtype
    assert files.split() == ["ckpt/model.safetensors"]
    assert len(calls.read_text().splitlines()) == 3  # one run per TAB


def test_the_command_list_shows_whole_summaries() -> None:
    r = run("--help")
    assert "  merge    Merge a checkpoint (any format) into Hugging Face safetensors.\n" in (
        r.output)
    commands = r.output.split("Commands:\n")[1].splitlines()
    assert len(commands) == 6 and not [c for c in commands if c.endswith("...")]


def test_pip_users_are_told_how_to_get_completion() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "ckpttool --install-completion" in readme
    assert "--install-completion" in run("--help").output
