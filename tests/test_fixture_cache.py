"""tests/fixture_cache.py under parallel workers (``pytest -n``, which ``make test`` runs): two
processes asking for the same entry at once run its writer once, and both get it whole."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from tests import fixture_cache


def _write(d: Path, runs: Path) -> None:
    with open(runs, "a") as f:  # one line per run of the writer, whoever runs it
        f.write("run\n")
    (d / "a").write_text("first")
    time.sleep(1.0)  # the other worker asks while this one is half-way
    (d / "b").write_text("second")


def _worker(runs: Path, into: Path) -> None:
    fixture_cache.cached("race", lambda d: _write(d, runs), into)


def test_two_workers_share_one_run_of_a_writer(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTTOOL_TEST_FIXTURES", str(tmp_path / "cache"))
    runs = tmp_path / "runs"
    fork = multiprocessing.get_context("fork")
    workers = [fork.Process(target=_worker, args=(runs, tmp_path / f"w{i}")) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    assert runs.read_text() == "run\n"
    for i in range(2):
        got = tmp_path / f"w{i}"
        assert sorted(p.name for p in got.iterdir()) == ["a", "b"]
        assert (got / "b").read_text() == "second"
    # one entry, no half-written directory and nothing left beside it but its lock
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(names) == 2 and names[1] == names[0] + ".lock", names
    # a later session copies the entry without running the writer
    _worker(runs, tmp_path / "later")
    assert runs.read_text() == "run\n" and (tmp_path / "later" / "b").read_text() == "second"


_RUNS: list[str] = []


@fixture_cache.on_disk()
def _write_beside(out: Path, n: int) -> Path:
    """A writer of ``out/data`` and of ``reference`` beside ``out`` (as ds_layouts does)."""
    _RUNS.append(out.name)
    (out / "data").mkdir(parents=True)
    (out / "data" / "n").write_text(str(n))
    (out.parent / "reference").write_text(f"ref {n}")
    return out / "data"


def test_a_writer_runs_once_whatever_its_output_is_called(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mktemp numbers names per worker: ``zero20`` on one, ``zero21`` on another; two calls
    with the same arguments under different names share one run of the writer, and each gets
    its output under its own name, with what the writer wrote beside it."""
    monkeypatch.setenv("CKPTTOOL_TEST_FIXTURES", str(tmp_path / "cache"))
    _RUNS.clear()
    first = _write_beside(tmp_path / "a" / "ckpt0", 1)
    second = _write_beside(tmp_path / "b" / "ckpt1", 1)
    other = _write_beside(tmp_path / "c" / "ckpt0", 2)
    assert _RUNS == [fixture_cache.OUT, fixture_cache.OUT]  # arguments 1 and 2, once each
    assert first == tmp_path / "a" / "ckpt0" / "data"
    assert second == tmp_path / "b" / "ckpt1" / "data"
    assert (second / "n").read_text() == "1" and (other / "n").read_text() == "2"
    assert (tmp_path / "b" / "reference").read_text() == "ref 1"
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["ckpt1", "reference"]
