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
