"""Shared helpers for the benchmarks: run a command in a fresh child process and measure its
wall time and peak resident set size, warm the page cache, describe the machine, render tables.

Only the standard library is needed (psutil is used as a fallback where ``os.wait4`` does not
exist). Nothing here imports torch or ckpttool.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_CHUNK = 8 << 20


@dataclass
class Measurement:
    """One run of one command."""

    cmd: list[str]
    wall_s: float
    peak_rss_bytes: int | None  # None if it could not be measured
    returncode: int  # negative: killed by that signal (as subprocess reports it)
    rss_method: str  # "wait4" (kernel ru_maxrss of the child) or "psutil" (polled, a lower bound)
    stderr: str  # the tail of what the child wrote on stderr
    stdout: str  # the tail of what the child wrote on stdout
    timed_out: bool = False
    cpu_s: float | None = None  # user + system CPU seconds of the command
    rss_floor_bytes: int | None = None  # the launcher's peak RSS: a lower bound on peak_rss

    @property
    def at_floor(self) -> bool:
        """The measured peak is (within 5%) the launcher's floor: the true peak may be lower."""
        return (self.peak_rss_bytes is not None and self.rss_floor_bytes is not None
                and self.peak_rss_bytes <= self.rss_floor_bytes * 1.05)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def peak_rss_mb(self) -> float | None:
        return None if self.peak_rss_bytes is None else self.peak_rss_bytes / 2**20

    def error_line(self) -> str:
        """A one-line reason for a failure: the exception line of a Python traceback, else the
        first non-empty line of stderr, else the exit status."""
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s"
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip()]
        if any(ln.startswith("Traceback") for ln in lines):
            # The last line of a traceback is the exception; the first one says nothing.
            line = lines[-1]
        elif lines:
            line = lines[0]
        else:
            line = ""
        if self.returncode < 0:
            status = f"killed by signal {-self.returncode}"
            return f"{status}: {line}" if line else status
        return line or f"exit status {self.returncode}"

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["ok"] = self.ok
        d["peak_rss_mb"] = self.peak_rss_mb
        d["at_floor"] = self.at_floor
        if not self.ok:
            d["error"] = self.error_line()
        return d


def _maxrss_bytes(ru_maxrss: int) -> int:
    # Linux (and most Unixes) report kilobytes; macOS reports bytes.
    return ru_maxrss if sys.platform == "darwin" else ru_maxrss * 1024


def _tail(path: Path, limit: int = 8192) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


# The launcher: a minimal Python (-I -S, only os/sys/time) that forks and execs the command,
# reaps it with os.wait4 and writes its rusage to a report file. Why not wait4 the command
# directly from here: Linux carries a process's RSS high-water mark across fork + exec
# (exec records the old address space's peak in the child's ru_maxrss), so a child forked from
# a benchmark that has imported torch would report at least the benchmark's own RSS. Forked
# from this small launcher, the floor is the launcher's own peak (~9 MB), which is recorded.
_LAUNCHER = r"""
import os, sys, time
def hwm():
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith('VmHWM:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1
report, argv = sys.argv[1], sys.argv[2:]
floor = hwm()
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        os.write(2, ('cannot run %r: %s\n' % (argv[0], e)).encode())
    os._exit(127)
while True:
    try:
        _, status, ru = os.wait4(pid, 0)
        break
    except InterruptedError:
        pass
wall = time.perf_counter() - t0
with open(report, 'w') as f:
    f.write('%d %d %d %.9f %.6f %.6f' % (ru.ru_maxrss, floor, status, wall, ru.ru_utime,
                                          ru.ru_stime))
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def run_measured(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
    discard_stdout: bool = False,
) -> Measurement:
    """Run ``cmd`` as a fresh process and measure it.

    Wall time runs from just before the process is forked to just after it is reaped, so it
    includes interpreter start-up and imports, as a user would see them. Peak RSS is the
    kernel's ``ru_maxrss`` for that process as returned by ``os.wait4`` (it covers the process
    and any descendants it waited for). The command is forked by a tiny launcher process (see
    ``_LAUNCHER``), so its RSS floor is the launcher's ~9 MB, not this process's size; a result
    at that floor is flagged (``at_floor``). Where ``fork``/``wait4`` are missing, the command
    runs directly and psutil polls its RSS every 10 ms (a lower bound).

    stdout and stderr go to temporary files (never pipes, which could fill up and block the
    child); their tails are kept. ``discard_stdout`` sends stdout to /dev/null (for ``cat``).
    """
    argv = [os.fspath(c) for c in cmd]
    use_launcher = hasattr(os, "wait4") and hasattr(os, "fork")
    with tempfile.TemporaryDirectory(prefix="bench-measure-") as tmp:
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        report = Path(tmp) / "rusage"
        full = ([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(report), *argv]
                if use_launcher else argv)
        with open(err_path, "wb") as err_f, (
            open(os.devnull, "wb") if discard_stdout else open(out_path, "wb")
        ) as out_f:
            timed_out = threading.Event()
            start = time.perf_counter()
            proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f,
                                    env=None if env is None else dict(env), cwd=cwd,
                                    start_new_session=True)
            timer = None
            if timeout_s is not None:
                def _kill() -> None:
                    timed_out.set()
                    try:
                        os.killpg(proc.pid, 9)  # the launcher and the command
                    except OSError:
                        proc.kill()
                timer = threading.Timer(timeout_s, _kill)
                timer.start()
            try:
                if use_launcher:
                    proc.wait()
                    rss, method = None, "wait4"
                else:  # pragma: no cover - non-POSIX
                    rss, method = _poll_psutil(proc)
            finally:
                if timer is not None:
                    timer.cancel()
            wall = time.perf_counter() - start
        floor = cpu = None
        returncode = proc.returncode
        if use_launcher:
            try:
                maxrss, floor_b, status, wall, utime, stime = report.read_text().split()
                rss = _maxrss_bytes(int(maxrss))
                floor = int(floor_b) if int(floor_b) > 0 else None
                returncode = os.waitstatus_to_exitcode(int(status))
                wall, cpu = float(wall), float(utime) + float(stime)
            except (OSError, ValueError):
                pass  # the launcher was killed (timeout): keep the outer wall time
        return Measurement(
            cmd=argv,
            wall_s=wall,
            peak_rss_bytes=rss,
            returncode=returncode,
            rss_method=method,
            stderr=_tail(err_path),
            stdout="" if discard_stdout else _tail(out_path),
            timed_out=timed_out.is_set(),
            cpu_s=cpu,
            rss_floor_bytes=floor,
        )


def _poll_psutil(proc: subprocess.Popen[bytes]) -> tuple[int | None, str]:
    try:
        import psutil
    except ImportError:
        proc.wait()
        return None, "none"
    peak = 0
    try:
        p = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                rss = p.memory_info().rss
                rss += sum(c.memory_info().rss for c in p.children(recursive=True))
                peak = max(peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.01)
    except psutil.Error:
        pass
    proc.wait()
    return peak or None, "psutil"


def best_of(runs: Sequence[Measurement]) -> Measurement:
    """The fastest successful run (its RSS is reported with it), or the last run if none
    succeeded."""
    good = [m for m in runs if m.ok]
    return min(good, key=lambda m: m.wall_s) if good else runs[-1]


def files_under(path: Path) -> list[Path]:
    """Every regular file under ``path`` (or ``path`` itself), sorted."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


def warm_page_cache(path: Path) -> float:
    """Read every file under ``path`` once so that it sits in the page cache; returns seconds.
    (Dropping the cache instead would need root and disturb everyone else on the machine.)"""
    start = time.perf_counter()
    buf = bytearray(_CHUNK)
    for f in files_under(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - start


def evict_page_cache(path: Path) -> None:
    """Drop the clean page-cache pages of every file under ``path`` (``POSIX_FADV_DONTNEED``;
    no root needed, and only these files are touched). Call after :func:`sync`: dirty pages
    are not dropped."""
    if not hasattr(os, "posix_fadvise"):
        return
    for f in files_under(path):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def sync() -> None:
    """Flush dirty pages left by an earlier run so that its write-back does not land inside the
    next measurement."""
    if hasattr(os, "sync"):
        os.sync()


def machine_info(extra: Mapping[str, object] | None = None) -> dict[str, object]:
    info: dict[str, object] = {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else None,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
        info["loadavg_at_start"] = [round(x, 2) for x in load]
    except OSError:
        pass
    if extra:
        info.update(extra)
    return info


def filesystem_of(path: Path) -> str:
    """The filesystem type holding ``path`` (from /proc/mounts), or "unknown"."""
    try:
        best, fstype = "", "unknown"
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
        return fstype
    except OSError:
        return "unknown"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=True)]
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(list(headers)), sep, *(line(r) for r in rows)])


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CpuHog:
    """A busy process beside the measured one (``with CpuHog():``): one core of a small
    machine taken by other work, as on a shared host. Started and ended here, by its id."""

    CODE = "while True:\n    pass\n"

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> CpuHog:
        self.procs = [subprocess.Popen([sys.executable, "-I", "-S", "-c", self.CODE],
                                       stdin=subprocess.DEVNULL)
                      for _ in range(self.count)]
        time.sleep(0.2)  # running before the measured command starts
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


def bytecode_env(cache: Path) -> dict[str, str]:
    """The environment for measured Python commands: bytecode cached (under ``cache``) as an
    installed package has it, whatever PYTHONDONTWRITEBYTECODE says here; without it every
    run compiles every module it imports (measured: 0.2-0.3 s of a merge's start-up)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(cache)
    return env


def load1() -> float:
    """The 1-minute load average (what the figures beside it were measured under)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# -- the results file: one current figure per claim (docs/benchmarks.md is generated from it)

FIGURES = Path(__file__).resolve().parent / "figures.json"
_ROOT = FIGURES.parents[1]


def add_record_args(parser: argparse.ArgumentParser) -> None:
    """``--record`` and ``--figures PATH``: whether and where :func:`record_figure` writes."""
    parser.add_argument("--record", action="store_true",
                        help="write this run's figures into benchmarks/figures.json as the "
                             "current figure of each claim it measures (then run "
                             "python -m ckpttool.cli.docs)")
    parser.add_argument("--figures", type=Path, default=None, metavar="PATH",
                        help="record into PATH instead of benchmarks/figures.json (a smoke "
                             "run's figures must not replace real ones)")


def load_span(loads: Iterable[float]) -> str:
    """The 1-minute loads seen during a measurement, as the results file writes them."""
    seen = sorted(x for x in loads if x == x)  # NaN where there is no load average
    if not seen:
        return ""
    lo, hi = f"{seen[0]:.1f}", f"{seen[-1]:.1f}"
    return lo if lo == hi else f"{lo}-{hi}"


def span(values: Iterable[float], fmt: str = ".2f") -> str:
    """``lo-hi`` of ``values`` as ``fmt`` writes them, or one figure where they are alike."""
    seen = sorted(values)
    lo, hi = format(seen[0], fmt), format(seen[-1], fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def git_commit(root: Path = _ROOT) -> str | None:
    """The short commit of the tree measured, ``+changes`` if it differs from it."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "ckpttool"],
                               cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+changes" if dirty else "")


def _machine() -> str:
    info = machine_info()
    model = str(info.get("cpu_model", platform.machine()))
    return f"{info['cpu_count']} cores ({model}), {info.get('mem_total_gib', '?')} GiB RAM"


def _without_record(argv: Sequence[str]) -> list[str]:
    """``argv`` less ``--record`` and ``--figures PATH``: the command that measures."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--figures":
            skip = True
        elif a != "--record" and not a.startswith("--figures="):
            out.append(a)
    return out


def read_figures(path: Path = FIGURES) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def write_figures(data: Mapping[str, Any], path: Path = FIGURES) -> None:
    """The results file, as it is committed (two-space JSON, one key a line), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def record_figure(args: argparse.Namespace, claim: str, *, figure: str,
                  ratio: float | None = None, baseline: str | None = None,
                  cpu_s: float | None = None, peak_mb: float | None = None,
                  load: str = "", met: bool | None = None, note: str | None = None,
                  new: Mapping[str, Any] | None = None, full_size: bool = True) -> bool:
    """Replace claim ``claim``'s current figure in the results file with this run's: figure,
    ratio and baseline, CPU seconds, peak RSS in MB, whether the target was met, and the
    command (this script's argv), date, load, machine and commit. What describes the claim
    (section, what is claimed, target) stays as written; ``note`` replaces the note (a note
    is about the run it came with: none if not given). A claim not in the file yet needs
    ``new`` (at least ``section`` and ``claim``); it goes after the last claim of its section.

    Writes nothing unless the script was run with ``--record`` (benchmarks/figures.json) or
    ``--figures PATH``: a smoke run at a small size must not replace a real figure. A run
    at another size than the claim's (``full_size=False``) goes only to ``--figures PATH``.
    Returns whether it wrote."""
    path: Path | None = getattr(args, "figures", None)
    if path is None and getattr(args, "record", False):
        if not full_size:
            print(f"figures: {claim} not recorded (not the claim's size; --figures PATH "
                  "takes it)")
            return False
        path = FIGURES
    if path is None:
        print(f"figures: {claim} not recorded (pass --record to keep this run's figure)")
        return False
    if not path.exists():
        write_figures({"claims": []}, path)
    data = read_figures(path)
    claims: list[dict[str, Any]] = data["claims"]
    entry = next((c for c in claims if c["id"] == claim), None)
    if entry is None:
        if not new or "section" not in new or "claim" not in new:
            raise KeyError(f"{path}: no claim '{claim}'; pass new={{'section': ..., "
                           f"'claim': ...}} to add it")
        entry = {"id": claim, "section": new["section"], "claim": new["claim"],
                 "target": new.get("target"), "met": None, "note": None}
        at = max((i + 1 for i, c in enumerate(claims) if c["section"] == new["section"]),
                 default=len(claims))
        claims.insert(at, entry)
    script = Path(sys.argv[0]).resolve()
    try:
        script_name = str(script.relative_to(_ROOT))
    except ValueError:
        script_name = script.name
    entry.update({
        "figure": figure, "cpu_s": None if cpu_s is None else round(cpu_s, 2),
        "baseline": baseline, "ratio": None if ratio is None else round(ratio, 2),
        "peak_mb": None if peak_mb is None else round(peak_mb),
        "command": shlex.join([script_name, *_without_record(sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": load or None, "machine": _machine(), "commit": git_commit()})
    entry["met"] = met  # None: this run does not judge the target
    entry["note"] = note  # a note is about the run it came with
    # every entry keeps the committed file's key order, whatever was added
    order = ["id", "section", "claim", "target", "met", "figure", "cpu_s", "baseline", "ratio",
             "peak_mb", "command", "date", "load", "machine", "commit", "note"]
    claims[claims.index(entry)] = {k: entry[k] for k in sorted(
        entry, key=lambda k: order.index(k) if k in order else len(order))}
    write_figures(data, path)
    print(f"figures: recorded {claim} in {path} (now run python -m ckpttool.cli.docs)")
    return True
