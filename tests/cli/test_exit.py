"""How the program ends (``ckpttool.cli.run``): once the command is over, the exit handlers
run, the streams are flushed and the process ends without tearing the interpreter down; the
status and every byte of output are what a normal exit gives. ``main()`` still ends by raising
``SystemExit``, for callers that go on after it."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_private_exit_handler_runner_is_still_there() -> None:
    # ckpttool.cli._leave runs the atexit handlers itself before os._exit: if CPython moves
    # this, the program would end without them.
    assert callable(atexit._run_exitfuncs)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("exit") / "w.safetensors"
    save_file({f"w{i}": torch.zeros(64, 8) for i in range(200)}, path)
    return path


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


PROGRAM = ("import atexit, sys, threading, time\n"
           "from ckpttool.cli import run\n"
           "atexit.register(lambda: print('handler ran', file=sys.stderr))\n"
           "if sys.argv[1] == 'thread':\n"
           "    threading.Thread(target=lambda: (time.sleep(0.3), print('thread done',"
           " file=sys.stderr))).start()\n"
           "sys.argv = ['ckpttool', *sys.argv[2:]]\n"
           "run()\n"
           "print('not reached', file=sys.stderr)\n")


@pytest.mark.parametrize("thread", ["none", "thread"])
def test_run_ends_with_the_whole_output_the_handlers_and_the_status(small: Path,
                                                                    thread: str) -> None:
    r = _run(PROGRAM, thread, "inspect", str(small), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # every byte of the document, flushed
    assert len(doc["tensors"]) == 200
    assert "handler ran" in r.stderr and "not reached" not in r.stderr
    # a thread a normal exit would wait for: the exit waits for it too
    assert ("thread done" in r.stderr) == (thread == "thread")


def test_run_keeps_the_status_of_a_failed_command(tmp_path: Path) -> None:
    r = _run(PROGRAM, "none", "inspect", str(tmp_path / "missing"))
    assert r.returncode == 3
    assert r.stderr.startswith("ckpttool: error:") and "handler ran" in r.stderr


def test_python_m_ckpttool_and_main_from_a_script(small: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "ckpttool", "inspect", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 3 and r.stderr.count("\n") == 1, r.stderr
    # run from another script, the module returns control (SystemExit) to it
    # (also as the __main__ module it installs, as pdb's and coverage's -m do: the command
    # line that started the process is not ``python -m ckpttool``)
    for alter in (False, True):
        code = ("import runpy, sys\nsys.argv = ['ckpttool', 'inspect', sys.argv[1]]\n"
                "try:\n    runpy.run_module('ckpttool', run_name='__main__', "
                f"alter_sys={alter})\n"
                "except SystemExit as e:\n    print('went on', e.code)\nprint('after')\n")
        r = _run(code, str(small))
        assert r.returncode == 0 and r.stdout.splitlines()[-2:] == ["went on 0", "after"], \
            (alter, r.stderr)
