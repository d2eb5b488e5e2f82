"""The CLI in a process of its own, forked from a zygote instead of started afresh, for tests
that run it dozens of times (a kill at every step): :class:`ForkedCli` (what those tests use
of ``subprocess.Popen``) and :func:`run_cli` (of ``subprocess.run``). Used through
:mod:`tests.helpers`, which re-exports them; the zygote imports only this module."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository: PYTHONPATH of a CLI process


class ForkedCli:
    """``python -m ckpttool *args`` with environment ``env`` (and working directory ``cwd``),
    in a process forked by :class:`Zygote` (torch and the CLI's modules imported there
    already) instead of a fresh interpreter: about 1.5 s of imports less per run, for tests
    that run the CLI dozens of times (a kill at every step). What those tests use of
    ``subprocess.Popen`` (``stdout=PIPE, stderr=PIPE, text=True``): ``pid``, ``poll``,
    ``send_signal``, ``communicate`` and ``returncode``, negative for a signal.

    ``script`` instead runs that Python source as ``python -c script *args`` would."""

    def __init__(self, args: list[str], env: dict[str, str],
                 cwd: str | Path | None = None, *, script: str | None = None) -> None:
        import tempfile

        self.args = ["ckpttool" if script is None else "-c", *args]
        self._dir = tempfile.TemporaryDirectory(prefix="ckpttool-cli-")
        self._out, self._err = Path(self._dir.name, "stdout"), Path(self._dir.name, "stderr")
        self._zygote = Zygote.get()
        self.pid: int = self._zygote.start(
            {"args": list(args), "env": dict(env), "out": str(self._out),
             "err": str(self._err), "cwd": None if cwd is None else str(cwd),
             "script": script})
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._zygote.ended(self.pid, 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.returncode = self._zygote.ended(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        try:
            return self._out.read_text(), self._err.read_text()
        finally:
            self._dir.cleanup()

    def kill(self) -> None:
        self.send_signal(9)
        self._zygote.ended(self.pid, None)


class Zygote:
    """One fresh interpreter per test process that imports what the CLI runs (torch, the
    CLI's commands, transformers) once, then forks a child per :class:`ForkedCli`: the child
    takes the run's environment, working directory, argv and standard streams and runs the
    program as ``python -m ckpttool`` (or ``python -c``) does; the zygote reaps it and reports
    its exit status. A plain ``os.fork`` of an interpreter that has imported everything costs
    about 0.1 s, where multiprocessing's forkserver child (pickled target, main module
    prepared again, the CLI imported afresh) cost 0.4-0.7 s before the command ran.

    Protocol (pipes): a request is one line of JSON on the zygote's stdin; it answers
    ``started PID`` and, when that child has ended, ``ended PID RETURNCODE`` (negative for
    a signal) on its stdout. It ends at end of input."""

    _current: Zygote | None = None
    _PRELOAD = ("torch", "transformers", "ckpttool.cli", "ckpttool.cli.merge",
                "ckpttool.cli.inspect", "ckpttool.cli.verify", "ckpttool.cli.reshard",
                "ckpttool.core.merge.operation", "ckpttool.core.runtime.urls", "boto3",
                "ckpttool.storage.s3")

    @classmethod
    def get(cls) -> Zygote:
        """This process's zygote, started on first use (again in a forked test process)."""
        if cls._current is None or cls._current.owner != os.getpid() \
                or cls._current.proc.poll() is not None:
            cls._current = cls()
        return cls._current

    def __init__(self) -> None:
        import atexit
        import threading

        self.owner = os.getpid()
        code = (f"import sys; from tests.forked_cli import _zygote_serve; "
                f"job = _zygote_serve({list(self._PRELOAD)!r}); job and job()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._ended: dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)

    def close(self) -> None:
        """End the zygote (at end of input) and reap it, so that its CPU time and its
        children's count in this process's (``time -v`` of a test run)."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            what, pid, *code = line.split()
            with self._changed:
                if what == "started":
                    self._started.append(int(pid))
                else:
                    self._ended[int(pid)] = int(code[0])
                self._changed.notify_all()
        with self._changed:
            self._gone = True  # no more answers
            self._changed.notify_all()

    def start(self, request: dict[str, Any]) -> int:
        """Fork a child for ``request``; its pid."""
        assert self.proc.stdin is not None
        with self._lock, self._changed:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            self._changed.wait_for(lambda: bool(self._started) or self._gone, timeout=120)
            assert self._started, "the zygote ended"
            return self._started.pop(0)

    def ended(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s return code once it has ended, waiting at most ``timeout`` s; None if it
        is still running."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._ended or self._gone, timeout=timeout)
            return self._ended.get(pid)


def _zygote_serve(preload: list[str]) -> Callable[[], None] | None:
    """The zygote's loop (:class:`Zygote`): returns, in a forked child, the run to do; in
    the zygote itself, None at end of input."""
    import importlib
    import select

    for name in preload:
        with contextlib.suppress(ModuleNotFoundError):  # an extra not installed
            importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    requests = sys.stdin.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            print("ended", pid, os.waitstatus_to_exitcode(status), flush=True)
        if requests not in ready:
            continue
        data = os.read(requests, 1 << 16)
        if not data:
            return None
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                return functools.partial(_zygote_child, json.loads(line))
            print("started", pid, flush=True)


def _zygote_child(request: dict[str, Any]) -> None:
    """A child of the zygote: the environment, working directory, argv and standard streams
    of ``python -m ckpttool *args`` (or ``python -c script *args``), then the program, which
    ends the process itself or returns to end it as an interpreter ends."""
    import tempfile

    # Ctrl-C raises KeyboardInterrupt, as in a program started from a terminal, even where
    # the test run was started with SIGINT ignored (`cmd &` in a script or a CI runner: a
    # shell without job control starts background commands so), which the zygote, a fresh
    # interpreter, would otherwise keep: a `python -c` run there ignored the tests' SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from TMPDIR, as a fresh interpreter finds it
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if request["cwd"] is not None:
        os.chdir(request["cwd"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        f = os.open(path, flags)
        os.dup2(f, fd)
        os.close(f)
    if request["script"] is None:
        sys.argv = ["ckpttool", *request["args"]]
        from ckpttool.cli import run

        run()
    else:
        sys.argv = ["-c", *request["args"]]
        try:
            exec(compile(request["script"], "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            if not isinstance(e.code, int | None):
                raise
            _leave(e.code or 0)
            raise
        _leave(0)


def _leave(code: int) -> None:
    """End a zygote's child with ``code`` as :func:`ckpttool.cli._leave` ends the CLI: exit
    handlers run and the streams are flushed, then ``os._exit``, without tearing down an
    interpreter that holds torch and transformers (about a second). Returns (the caller
    ends as an interpreter ends) while a thread that an exit would wait for is alive."""
    import atexit
    import threading

    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_cli(args: list[str], env: dict[str, str], *, timeout: float = 120,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run([python, "-m", "ckpttool", *args], env=env, cwd=cwd,
    capture_output=True, text=True, timeout=timeout)`` returns, from a :class:`ForkedCli`."""
    p = ForkedCli(args, env, cwd)
    try:
        out, err = p.communicate(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode is not None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)
