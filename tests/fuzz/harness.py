"""Run mutants through ``inspect``, ``verify`` and ``merge``/``reshard`` and check the goal
invariants (the issue's table):

* no code executed and no file opened outside the mutant's directory and the output;
* exit code in {0, 1, 3, 4}: never 70 (internal error), never a traceback on stderr;
* no run over :data:`TIMEOUT_S` seconds of CPU time (or :data:`BLOCKED_S` waiting without
  ending: wall time on a busy machine says nothing); no MemoryError and no peak RSS more than
  :data:`MEMORY_GROWTH` above the worker's before the run (under an address-space limit of
  :data:`ADDRESS_SPACE`);
* a merge or reshard that exits 0 leaves safetensors files that ``safetensors`` opens in
  full (and an index that names only tensors its shards hold);
* ``verify`` never exits 0 on a mutant whose changed bytes a stored CRC-32 covers;
* an error is one line.

Runs happen in worker processes (``python -m tests.fuzz.harness --worker``) that import
ckpttool and torch once and run the CLI in-process (``typer.testing.CliRunner``), so a run
costs milliseconds; the parent kills and replaces a worker that hangs or blows up.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.fuzz.mutate import Mutant, mutation, seed_files

TIMEOUT_S = 20.0  # of the worker's CPU time; BLOCKED_S of wall time with no CPU used
BLOCKED_S = 10 * TIMEOUT_S
ADDRESS_SPACE = 4 << 30
MEMORY_GROWTH = 1 << 30
ROOT = Path(__file__).resolve().parents[2]

ROWS = (
    ("outside", "code executed, files opened outside the checkpoint"),
    ("exit70", 'exit 70 "internal error" (a crash on bad input)'),
    ("traceback", "uncaught exceptions / tracebacks shown"),
    ("hang", f"hangs over {TIMEOUT_S:.0f} s (CPU time)"),
    ("memory", "memory blow-ups (MemoryError or +1 GB)"),
    ("bad_output", "merge exit 0 with an output safetensors cannot open"),
    ("crc_missed", "verify OK on CRC-protected data that was corrupted"),
    ("multiline", "multi-line error messages"),
    ("other_exit", "exit codes other than 0, 1, 3, 4 (70 apart)"),
    ("raw_control", "control or bidi characters printed raw (human output, errors)"),
    ("untiled", "exit 0 on a safetensors file whose data is not tiled exactly"),
)

# What a terminal acts on instead of showing (tab and newline apart): never printed raw.
_RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028"
                          "\u2029\u202a-\u202e\u2066-\u2069]")


# --------------------------------------------------------------------------------------------
# Which commands a mutant gets


def commands(seed: str, index: int, path: str, out: str) -> list[list[str]]:
    """inspect (human or --json), verify, and merge or reshard (alternating)."""
    inspect = ["inspect", path] + (["--json"] if index % 2 else [])
    verify = ["verify", path] + (["--json"] if index % 3 == 1 else [])
    full = seed in ("safetensors", "safetensors-sharded", "torch-save", "bin-sharded")
    if index % 4 == 3:
        write = (["reshard", path, out, "--to", "safetensors", "--max-shard-size", "300"]
                 if full else ["reshard", path, out, "--ranks", "2"])
    else:
        write = ["merge", path, out, "--dtype", "keep" if index % 2 else "auto", "-q",
                 "--weights-only"]
    return [inspect, verify, write]


# --------------------------------------------------------------------------------------------
# The worker


def _status(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


class _Watch:
    """An audit hook that records files opened outside the allowed roots and any attempt to
    start a process, while ``active``."""

    EXEC_EVENTS = ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn",
                   "os.fork", "os.forkpty", "pty.spawn", "webbrowser.open")
    WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "shutil.rmtree", "os.mkdir",
                    "os.symlink", "os.link", "os.truncate", "os.chmod")

    def __init__(self) -> None:
        self.active = False
        self.allowed: tuple[str, ...] = ()
        self.found: list[str] = []
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(ROOT), "/proc/", "/sys/",
                    "/dev/null", "/dev/urandom", "/usr/lib", "/usr/share/zoneinfo",
                    "/etc/localtime", "/etc/ld.so.cache", "/lib", "/usr/local/lib"}
        prefixes |= {p for p in sys.path if p}
        # torch's inductor cache directory, made when the contract check imports transformers
        # (an import's side effect, the same for every input; nothing of the mutant's)
        prefixes.add(os.path.join(tempfile.gettempdir(), "torchinductor_"))
        # ...and what the contract keeps of a config between runs (core/contract_cache.py:
        # written by ckpttool itself, JSON, the same for every input of one config)
        from ckpttool.core import contract_cache

        prefixes.add(str(contract_cache.directory().parent))  # made with its parents
        self.system = tuple(sorted(prefixes))
        sys.addaudithook(self)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active:
            return
        if event.startswith(self.EXEC_EVENTS):
            self.found.append(f"{event} {args!r:.200}")
        elif event == "ctypes.dlopen" and args and isinstance(args[0], str) and "/" in args[0]:
            # A library by path (a lazy import loading libc by name is no finding).
            if not os.path.abspath(args[0]).startswith(self.system):
                self.found.append(f"{event} {args[0]}")
        elif event == "open" or event.startswith(self.WRITE_EVENTS):
            path = args[0] if args else None
            if isinstance(path, int) or path is None:
                return
            try:
                text = os.fsdecode(path)
            except TypeError:
                return
            full = os.path.abspath(text)
            if not full.startswith(self.allowed + self.system):
                self.found.append(f"{event} {full}")


def _check_output(out: Path) -> str | None:
    """None if every safetensors file in ``out`` opens and reads in full and the index (if
    any) names only tensors its shards hold; else what is wrong."""
    from safetensors import safe_open

    held: dict[str, set[str]] = {}
    try:
        for p in sorted(out.glob("*.safetensors")):
            with safe_open(str(p), framework="pt") as f:
                names = set(f.keys())
                for k in names:
                    f.get_tensor(k)
            held[p.name] = names
        index = out / "model.safetensors.index.json"
        if index.exists():
            if (out / "model.safetensors").exists():
                return "model.safetensors beside an index"
            wm = json.loads(index.read_text())["weight_map"]
            for k, v in wm.items():
                if k not in held.get(v, ()):
                    return f"index names {k} in {v}, which does not hold it"
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        return f"{type(e).__name__}: {e}"[:300]
    return None


def _one_line(stderr: str) -> bool:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.startswith("ckpttool: error:"):
            return i == len(lines) - 1
    return True


def materialize(job: dict[str, Any], dest: Path, *, marker: Path | None = None,
                cache: dict[str, Any] | None = None) -> tuple[Mutant, str]:
    """Write the mutant ``job`` names into ``dest`` (a copy of its seed's directory with one
    file changed); returns it and the path to give the commands."""
    seed, index, campaign = job["seed"], job["index"], job["campaign"]
    cache = {} if cache is None else cache
    root, rel = Path(job["root"]), job["rel"]
    if seed not in cache:
        # The checkpoint's own files and the JSON files beside it, not its neighbours'.
        top = Path(rel).parts[0] if rel else ""
        cache[seed] = [(n, d) for n, d in seed_files(root)
                       if not top or n.startswith(top + "/") or ("/" not in n
                                                                 and n.endswith(".json"))]
    marker = marker if marker is not None else dest.parent / f"ran-{index}"
    m = mutation(seed, cache[seed], index, campaign=campaign, marker=str(marker))
    shutil.copytree(root, dest, symlinks=True)
    target = dest / m.file
    if m.data is None:
        target.unlink()
    else:
        target.write_bytes(m.data)
    return m, str(dest / rel) if rel else str(dest)


def worker_main() -> None:  # pragma: no cover - runs in the worker process
    soft = ADDRESS_SPACE
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (soft, resource.getrlimit(resource.RLIMIT_AS)[1]))
    import torch  # noqa: F401 - imported once, before the runs measure memory
    from typer.testing import CliRunner

    from ckpttool.cli import app

    watch = _Watch()
    runner = CliRunner()
    work = Path(tempfile.mkdtemp(prefix="ckpttool-fuzz-"))
    seeds: dict[str, Any] = {}
    out_stream = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not break the protocol
    out_stream.write(json.dumps({"ready": True}) + "\n")  # the clock starts per job now
    out_stream.flush()
    for line in sys.stdin:
        job = json.loads(line)
        seed, index = job["seed"], job["index"]
        here = work / f"m{index}"
        shutil.rmtree(here, ignore_errors=True)
        out, trap = here / "out", work / "trap"
        marker = trap / f"ran-{index}"
        m, path = materialize(job, here / "ckpt", marker=marker, cache=seeds)
        for args in commands(seed, index, path, str(out)):
            out_stream.write(json.dumps({"begin": args[0]}) + "\n")
            out_stream.flush()
            shutil.rmtree(out, ignore_errors=True)
            watch.allowed = (str(here),)
            watch.found = []
            _reset_peak()
            base = _status("VmRSS")
            watch.active = True
            try:
                result = runner.invoke(app, args)
            finally:
                watch.active = False
            peak = _status("VmHWM")
            stderr = result.stderr
            exc = result.exception
            if exc is not None and not isinstance(exc, SystemExit):
                import traceback

                stderr += "".join(traceback.format_exception(exc))
            rec: dict[str, Any] = {
                "index": index, "command": args[0], "args": args[1:], "exit": result.exit_code,
                "stderr": stderr[-2000:], "growth": peak - base,
                "traceback": "Traceback (most recent call last)" in stderr,
                "outside": watch.found[:5] + ([f"marker {marker} written"]
                                              if marker.exists() else []),
                "crc_protected": m.crc_protected, "mutant": m.describe(),
                "raw_control": bool(_RAW_CONTROL.search(
                    stderr + ("" if "--json" in args else result.stdout))),
            }
            if args[0] in ("merge", "reshard") and result.exit_code == 0:
                rec["bad_output"] = _check_output(out)
            out_stream.write(json.dumps(rec) + "\n")
            out_stream.flush()
        shutil.rmtree(here, ignore_errors=True)
        out_stream.write(json.dumps({"done": index}) + "\n")
        out_stream.flush()


# --------------------------------------------------------------------------------------------
# Classifying one run


def findings(rec: dict[str, Any]) -> list[str]:
    """The table rows one run record falls in."""
    rows: list[str] = []
    if rec.get("hang"):
        return ["hang"]
    if rec.get("died"):
        return ["memory" if rec.get("memory") else "other_exit"]
    stderr = rec["stderr"]
    code = rec["exit"]
    if rec["outside"]:
        rows.append("outside")
    if code == 70:
        rows.append("exit70")
    elif code not in (0, 1, 3, 4):
        rows.append("other_exit")
    if rec.get("traceback") or "Traceback (most recent call last)" in stderr:
        rows.append("traceback")
    if "MemoryError" in stderr or rec["growth"] > MEMORY_GROWTH:
        rows.append("memory")
    if rec.get("bad_output"):
        rows.append("bad_output")
    if rec["command"] == "verify" and rec["crc_protected"] and code == 0:
        rows.append("crc_missed")
    if code in (3, 4) and not _one_line(stderr):
        rows.append("multiline")
    if rec.get("raw_control"):
        rows.append("raw_control")
    if (code == 0 and rec["command"] in ("verify", "merge", "reshard")
            and "(untiled)" in rec.get("mutant", "")):
        rows.append("untiled")
    return rows


# --------------------------------------------------------------------------------------------
# The parent: a small pool of workers


@dataclass
class Campaign:
    seeds: dict[str, tuple[Path, str]]  # name -> (root to copy, path inside it to pass)
    campaign: int = 0
    workers: int = 2
    timeout_s: float = TIMEOUT_S
    records: list[dict[str, Any]] = field(default_factory=list)
    mutants: int = 0

    def jobs(self, n: int, only: Iterable[int] | None = None) -> list[dict[str, Any]]:
        names = sorted(self.seeds)
        indices = list(only) if only is not None else range(n)
        return [{"seed": names[i % len(names)], "index": i, "campaign": self.campaign,
                 "root": str(self.seeds[names[i % len(names)]][0]),
                 "rel": self.seeds[names[i % len(names)]][1]} for i in indices]

    def run(self, n: int, only: Iterable[int] | None = None,
            progress: bool = False, minutes: float | None = None) -> list[dict[str, Any]]:
        """Run mutants ``0..n-1`` (or ``only``); with ``minutes``, send no new mutant after
        that long (the table then counts the mutants that ran)."""
        todo = self.jobs(n, only)
        stop_at = None if minutes is None else time.monotonic() + 60 * minutes
        sent = 0
        pool = [_Worker() for _ in range(max(1, min(self.workers, len(todo))))]
        started = time.monotonic()
        done = 0
        try:
            while todo or any(w.job is not None for w in pool):
                if stop_at is not None and time.monotonic() > stop_at:
                    todo.clear()
                for w in pool:
                    if w.job is None and w.ready and todo:
                        w.send(todo.pop(0))
                        sent += 1
                # Workers still importing (a loaded machine takes long) are read too, but
                # only a job's run is timed.
                ready = [w for w in pool if w.job is not None or not w.ready]
                r, _, _ = select.select([w.proc.stdout for w in ready], [], [], 0.5)
                for w in ready:
                    if w.proc.stdout in r:
                        for rec in w.read():
                            self.records.append(rec)
                    if w.job is not None and (w.overdue(self.timeout_s)
                                              or w.proc.poll() is not None):
                        self.records.append(w.fail(self.timeout_s))
                    elif not w.ready and w.proc.poll() is not None:
                        w.dead = True
                    if w.job is None and w.finished:
                        done += 1
                        w.finished = False
                        if progress and done % 100 == 0:
                            rate = done / (time.monotonic() - started)
                            print(f"{done} mutants, {rate:.1f}/s", file=sys.stderr, flush=True)
                    if w.dead:
                        pool[pool.index(w)] = _Worker()
        finally:
            for w in pool:
                w.close()
            self.mutants += sent
        return self.records

    def table(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for rec in self.records:
            counts.update(set(findings(rec)))
        return {key: counts[key] for key, _ in ROWS}

    def render(self) -> str:
        runs = len(self.records)
        lines = [f"{self.mutants:,} mutants, {runs:,} runs (timeout {self.timeout_s:.0f} s, "
                 f"address space {ADDRESS_SPACE >> 30} GB)", "",
                 "| outcome | count | goal |", "|---|---|---|"]
        for key, label in ROWS:
            lines.append(f"| {label.replace('20 s', f'{self.timeout_s:.0f} s')} | "
                         f"{self.table()[key]} | 0 |")
        return "\n".join(lines)

    def failures(self) -> Iterator[tuple[list[str], dict[str, Any]]]:
        for rec in self.records:
            rows = findings(rec)
            if rows:
                yield rows, rec


class _Worker:
    def __init__(self) -> None:
        env = dict(os.environ, MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("CKPTTOOL_DEBUG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz.harness", "--worker"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        self.buf = b""
        self.job: dict[str, Any] | None = None
        self.command: str | None = None
        self.since = time.monotonic()
        self.cpu_since = 0.0
        self.dead = False
        self.finished = False
        self.ready = False  # imports done (it said so)

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.job = job
        self.since, self.cpu_since = time.monotonic(), self._cpu()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def read(self) -> list[dict[str, Any]]:
        """Every complete message the worker has written (its stdout read unbuffered, so
        that select() sees what is left)."""
        assert self.proc.stdout is not None
        chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
        self.buf += chunk
        out: list[dict[str, Any]] = []
        while b"\n" in self.buf and not self.dead:
            line, self.buf = self.buf.split(b"\n", 1)
            out += self._message(json.loads(line))
        return out

    def _cpu(self) -> float:
        """The worker's CPU time so far (0 once it has ended)."""
        try:
            t = psutil.Process(self.proc.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return float(t.user + t.system)

    def overdue(self, timeout_s: float) -> bool:
        """The run has used ``timeout_s`` of CPU time, or waited ``BLOCKED_S`` (scaled)
        without ending. CPU time, not wall time: on a busy machine (the suite's other
        workers, other people's runs) a run of a few CPU seconds can take minutes of wall
        time, while a run that loops on bad input uses CPU time as it goes."""
        wall = time.monotonic() - self.since
        if wall <= timeout_s:
            return False
        return wall > BLOCKED_S * timeout_s / TIMEOUT_S or self._cpu() - self.cpu_since > timeout_s

    def _message(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        self.since, self.cpu_since = time.monotonic(), self._cpu()
        if "ready" in msg:
            self.ready = True
            return []
        if "begin" in msg:
            self.command = msg["begin"]
            return []
        if "done" in msg:
            self.job = None
            self.command = None
            self.finished = True
            return []
        if msg["growth"] > MEMORY_GROWTH or "MemoryError" in msg["stderr"]:
            self.dead = True  # start afresh: a heap that grew stays grown
            self.close()
            self.job = None
            self.finished = True
        return [msg]

    def fail(self, timeout_s: float) -> dict[str, Any]:
        assert self.job is not None
        alive = self.proc.poll() is None
        rec = {"index": self.job["index"], "seed": self.job["seed"], "command": self.command,
               "hang": alive, "died": not alive, "exit": self.proc.returncode,
               "memory": self.proc.returncode in (-9, 137), "stderr": "", "growth": 0,
               "outside": [], "crc_protected": False,
               "mutant": f"#{self.job['index']} {self.job['seed']}"}
        self.close()
        self.dead = True
        self.job = None
        self.finished = True
        return rec

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker_main()
