"""Shares of Python-bound work in forked processes (core/forked.py), on their own and inside
merge and verify of a real many-chunk DCP checkpoint (torch's own writer): the same bytes and
the same findings as one process, failures raised as the same errors, nothing left over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpttool
from ckpttool.core.runtime import forked
from ckpttool.errors import InputError, OutputError
from ckpttool.formats.dcp import reader as dcp
from tests.helpers import load_out

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_checkpoint  # noqa: E402

LAYERS, EXPERTS, RANKS = 3, 4, 8

pytestmark = pytest.mark.skipif(not forked.available(), reason="forked shares: Linux only")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "ckpt"
    moe_checkpoint.write_one_process(out, layers=LAYERS, experts=EXPERTS, ranks=RANKS, files=3)
    return out


@pytest.fixture
def small_jobs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Windows and groups of a few tensors each (many jobs on a small checkpoint), and a
    count of the forked runs."""
    monkeypatch.setattr("ckpttool.core.merge.engine.WINDOW_STORED", 8 << 10)
    monkeypatch.setattr("ckpttool.core.verify.scan.GROUP_STORED", 8 << 10)
    runs: list[int] = []
    real = forked.run

    def counted(shares: list[forked.Share], report: object) -> list[object]:
        runs.append(len(shares))
        return real(shares, report)  # type: ignore[arg-type]

    monkeypatch.setattr("ckpttool.core.runtime.forked.run", counted)
    return runs


# --------------------------------------------------------------------------------------------
# forked.run on its own


@pytest.fixture
def pids(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The children forked.run starts."""
    started: list[int] = []
    real = os.fork

    def fork() -> int:
        pid = real()
        if pid:
            started.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", fork)
    return started


def _reaped(pids: list[int]) -> bool:
    """Every one of ``pids`` ended and reaped (no zombie, nothing running)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        return False
    return bool(pids)


def test_results_in_order_and_progress_from_every_process(pids: list[int]) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            seen.append(n)

    def share(i: int, progress: object, stop: threading.Event) -> dict[str, int]:
        for _ in range(3):
            progress(i + 1)  # type: ignore[operator]
        return {"pid_differs": int(os.getpid() != parent), "i": i}

    parent = os.getpid()
    got = forked.run([lambda p, s, i=i: share(i, p, s) for i in range(4)], report)
    assert [g["i"] for g in got] == [0, 1, 2, 3]
    assert [g["pid_differs"] for g in got] == [0, 1, 1, 1]
    assert sorted(seen) == sorted([1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4])
    assert _reaped(pids)


@pytest.mark.parametrize("count", [7, 40_000])
def test_pulled_items_go_each_to_one_process_and_the_slow_one_takes_fewer(
        pids: list[int], count: int) -> None:
    """forked.Pulled: the parent and three children iterate one queue; every item is taken
    once, heaviest first (beyond the pipe's room, in runs of consecutive items), and a
    process that is slow per item (another's work on its core) takes fewer of them."""
    items = list(range(count))

    def share(i: int, queue: forked.Pulled[int], progress: object, stop: threading.Event
              ) -> list[int]:
        got = []
        for item in queue:
            got.append(item)
            if i == 0 and count < 100:
                time.sleep(0.2)  # the slow one: this process, which starts after its children
        return got

    with forked.Pulled(items, lambda x: x) as queue:
        got = forked.run([lambda p, s, i=i: share(i, queue, p, s) for i in range(4)],
                         lambda n: None)
    taken = [x for part in got for x in part]
    assert sorted(taken) == items
    assert all(part == sorted(part, reverse=True) for part in got)
    if count < 100:
        assert len(got[0]) <= 2
    assert _reaped(pids)


def test_a_childs_error_is_raised_as_the_same_error(pids: list[int]) -> None:
    def fails(progress: object, stop: threading.Event) -> None:
        raise OutputError("/out/model.safetensors: no space left on device; free some")

    def waits(progress: object, stop: threading.Event) -> None:
        while not stop.is_set():  # stopped by the child's failure, not by finishing
            time.sleep(0.01)

    with pytest.raises(OutputError, match="^/out/model.safetensors: no space left"):
        forked.run([waits, fails], lambda n: None)
    assert _reaped(pids)


def test_a_child_that_dies_is_a_failure(pids: list[int]) -> None:
    def dies(progress: object, stop: threading.Event) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(forked.WorkerFailed, match="status -9"):
        forked.run([lambda p, s: None, dies], lambda n: None)
    assert _reaped(pids)


def test_a_failure_here_ends_the_children(pids: list[int]) -> None:
    def forever(progress: object, stop: threading.Event) -> None:
        time.sleep(600)

    def fails(progress: object, stop: threading.Event) -> None:
        raise InputError("here")

    started = time.monotonic()
    with pytest.raises(InputError, match="^here$"):
        forked.run([fails, forever, forever], lambda n: None)
    assert time.monotonic() - started < 60
    assert _reaped(pids)


def test_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTTOOL_FORK", "0")
    assert not forked.available()


# --------------------------------------------------------------------------------------------
# merge and verify in forked shares


def test_merge_in_shares_is_bit_exact_and_equals_one_process(
        moe: Path, tmp_path: Path, small_jobs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpttool.merge(moe, tmp_path / "forked", dtype="keep", workers=3, weights_only=True)
    assert small_jobs == [3]
    got = load_out(tmp_path / "forked")
    want = moe_checkpoint.moe_state(LAYERS, EXPERTS)
    assert set(got) == set(want)
    for name, ref in want.items():
        assert torch.equal(got[name].view(torch.uint8), ref.view(torch.uint8)), name
    monkeypatch.setenv("CKPTTOOL_FORK", "0")
    ckpttool.merge(moe, tmp_path / "alone", dtype="keep", workers=3, weights_only=True)
    assert small_jobs == [3]  # not forked again
    for f in (tmp_path / "alone").iterdir():
        assert f.read_bytes() == (tmp_path / "forked" / f.name).read_bytes(), f.name


def test_cast_in_shares_is_exact(moe: Path, tmp_path: Path, small_jobs: list[int]) -> None:
    if "torch" in sys.modules:  # the test process has torch; a share may not inherit it
        ckpttool.merge(moe, tmp_path / "out", dtype="fp32", workers=3, weights_only=True)
        assert small_jobs == []
    got = load_out(tmp_path / "out")
    for name, ref in moe_checkpoint.moe_state(LAYERS, EXPERTS).items():
        assert torch.equal(got[name], ref.float()), name


def _damaged(moe: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy with one late record's dtype changed in its pickle: it no longer matches its
    template and decodes to what the metadata does not promise."""
    damaged = Path(shutil.copytree(moe, tmp_path / "damaged"))
    info = dcp.read_info(damaged)
    t = info.tensor("model.model.layers.2.mlp.experts.3.down_proj.weight")
    c = t.chunks[-1]
    data = bytearray((damaged / c.file).read_bytes())
    record = data[c.offset : c.offset + c.length]
    at = record.find(b"BFloat16Storage")
    assert at > 0
    data[c.offset + at : c.offset + at + len(b"BFloat16Storage")] = b"HalfStorage____"
    (damaged / c.file).write_bytes(bytes(data))
    return damaged, c.file


def test_a_damaged_record_in_a_share_stops_the_merge(moe: Path, tmp_path: Path,
                                                     small_jobs: list[int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    damaged, file = _damaged(moe, tmp_path)
    with pytest.raises(InputError) as forked_error:
        ckpttool.merge(damaged, tmp_path / "out", dtype="keep", workers=3, weights_only=True)
    assert small_jobs == [3]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    monkeypatch.setenv("CKPTTOOL_FORK", "0")
    with pytest.raises(InputError) as alone:
        ckpttool.merge(damaged, tmp_path / "out2", dtype="keep", workers=3, weights_only=True)
    assert str(forked_error.value) == str(alone.value)
    assert file in str(alone.value)


_VERIFY = """
import json, sys
from ckpttool.core.runtime import forked
from ckpttool.core.verify import scan
runs = []
real = forked.run
def counted(shares, report):
    runs.append(len(shares))
    return real(shares, report)
forked.run = counted
scan.GROUP_STORED = 8 << 10
import ckpttool
r = ckpttool.verify(sys.argv[1], workers=3)
print(json.dumps({"runs": runs, "problems": [p.to_json() for p in r.problems],
                  "bytes_read": r.bytes_read}))
"""


def _verify_fresh(path: Path, **env: str) -> dict[str, object]:
    """verify in a process of its own: this one has torch loaded, which a share may not
    inherit, so verify would not fork here."""
    done = subprocess.run([sys.executable, "-c", _VERIFY, str(path)], capture_output=True,
                          text=True, check=True, env={**os.environ, **env},
                          cwd=Path(__file__).resolve().parents[2])
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_verify_in_shares_finds_what_one_process_finds(moe: Path, tmp_path: Path) -> None:
    clean = _verify_fresh(moe)
    assert clean["runs"] == [3] and clean["problems"] == []
    damaged, _ = _damaged(moe, tmp_path)
    # ...and a flipped stored byte elsewhere: a CRC mismatch
    info = dcp.read_info(damaged)
    t = info.tensor("model.model.layers.0.mlp.experts.1.up_proj.weight")
    with dcp.DcpReader(info, templates=False) as r:
        p = r.payload(t, t.chunks[2])
    data = bytearray((damaged / t.chunks[2].file).read_bytes())
    data[p.storage_offset + 1] ^= 0x40
    (damaged / t.chunks[2].file).write_bytes(bytes(data))
    got = _verify_fresh(damaged)
    want = _verify_fresh(damaged, CKPTTOOL_FORK="0")
    assert got["runs"] == [3] and want["runs"] == []
    assert sorted(p["code"] for p in want["problems"]) == ["crc-mismatch", "record-corrupt"]
    assert got["problems"] == want["problems"]
    assert got["bytes_read"] == want["bytes_read"]
