"""``merge RUN OUT_ROOT --all`` on a real training run (:mod:`tests.runs`: FSDP2 on 2 gloo
ranks, a DCP checkpoint per step, the last one cut before its ``.metadata``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as hs
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.core import dtype_policy
from ckpttool.core.merge import resume
from ckpttool.core.merge import sweep as sweeps
from ckpttool.core.merge.operation import merge, plan_merge
from ckpttool.core.merge.options import MergeOptions
from ckpttool.core.verify import receipt
from ckpttool.core.verify.operation import verify
from ckpttool.errors import InputError
from ckpttool.formats.base import RAW, Chunk, Tensor
from ckpttool.formats.codecs import dtypes
from tests.helpers import RESUME_PIECE, assert_step_exact, cut_merge

STEPS = (1, 2, 3)
CUT = 4  # the checkpoint whose writer stopped before .metadata


# The runs' model is no transformers model (and has no config.json): weights only.
WEIGHTS = MergeOptions.of(weights_only=True)
REDO = MergeOptions.of(weights_only=True, overwrite=True)


@pytest.fixture
def run_copy(trained: Path, tmp_path: Path) -> Path:
    """A copy of the run this test may change (times kept: a copy is not a new write)."""
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "run"


def _states(outcomes: list[sweeps.Outcome]) -> dict[str, str]:
    return {o.found.name: o.status for o in outcomes}


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_all_merges_every_complete_checkpoint_bit_exact_and_waits_for_the_cut_one(
        trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    report = sweeps.sweep(trained / "run", out, settle=0, options=WEIGHTS)
    assert _states(report.outcomes) == {"checkpoint-1": "merged", "checkpoint-2": "merged",
                                        "checkpoint-3": "merged", "checkpoint-4": "waiting"}
    assert [o.found.step for o in report.outcomes] == [1, 2, 3, 4]  # step order
    assert report.exit_code == 0
    for step in STEPS:
        assert_step_exact(out / f"checkpoint-{step}", trained, step)
        assert (out / f"checkpoint-{step}" / receipt.RECEIPT_NAME).is_file()
    cut = report.outcomes[-1]
    assert cut.reason == "pytorch_model_fsdp_0: no .metadata yet (dcp.save writes it after " \
                         "every data file)"
    assert not (out / f"checkpoint-{CUT}").exists()  # never merged, nothing made

    # A re-run does nothing, writes nothing, and says so.
    before = _mtimes(out)
    again = sweeps.sweep(trained / "run", out, settle=0, options=WEIGHTS)
    assert _states(again.outcomes) == {"checkpoint-1": "done", "checkpoint-2": "done",
                                       "checkpoint-3": "done", "checkpoint-4": "waiting"}
    assert _mtimes(out) == before
    result = CliRunner().invoke(app, ["merge", "--weights-only", str(trained / "run"), str(out),
                                      "--all",
                                      "--settle", "0"])
    assert result.exit_code == 0, result.output
    assert "nothing to do: every complete checkpoint is merged already" in result.output
    assert _mtimes(out) == before

    # verify OUT checks the output against its receipt: whole, then with a flipped byte.
    ok = verify(out / "checkpoint-2")
    assert ok.ok and "receipt" in ok.checks
    weights = out / "checkpoint-2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x40
    weights.write_bytes(bytes(data))
    bad = verify(out / "checkpoint-2")
    assert not bad.ok
    assert {p.code for p in bad.problems if p.severity == "error"} == {"manifest-mismatch"}


def test_a_changed_source_is_left_unless_overwrite(run_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    sweeps.sweep(run_copy, out, settle=0, options=WEIGHTS,
                 steps=sweeps.parse_steps("2"))
    config = run_copy / "checkpoint-2" / "config.json"
    config.write_text("{}\n")  # training wrote a file into it afterwards
    left = sweeps.sweep(run_copy, out, settle=0, options=WEIGHTS,
                 steps=sweeps.parse_steps("2"))
    (o,) = left.outcomes
    assert (o.status, o.reason) == ("changed", "the source changed since (config.json); pass "
                                    "--overwrite to merge it again")
    redo = sweeps.sweep(run_copy, out, settle=0, options=REDO,
                 steps=sweeps.parse_steps("2"))
    assert _states(redo.outcomes) == {"checkpoint-2": "merged"}
    # An output without its receipt (a sweep cut just before writing it) is left too.
    (out / "checkpoint-2" / receipt.RECEIPT_NAME).unlink()
    bare = sweeps.sweep(run_copy, out, settle=0, options=WEIGHTS,
                 steps=sweeps.parse_steps("2"))
    assert bare.outcomes[0].status == "changed" and bare.exit_code == 0
    assert f"holds an output without a {receipt.RECEIPT_NAME}" in (bare.outcomes[0].reason or "")
    sweeps.sweep(run_copy, out, settle=0, options=REDO,
                 steps=sweeps.parse_steps("2"))
    # Other options make another output: not done either.
    other = sweeps.sweep(run_copy, out, settle=0, steps=sweeps.parse_steps("2"),
                         options=MergeOptions.of(dtype="bf16", weights_only=True))
    assert other.outcomes[0].status == "changed"
    assert "made with other options (dtype)" in (other.outcomes[0].reason or "")


def test_one_failure_does_not_stop_the_others(run_copy: Path, tmp_path: Path) -> None:
    # Damaged in place (a file cut short moments ago is a copy still going on: waiting, see
    # tests/core/test_sweep_boundary.py).
    damaged = run_copy / "checkpoint-2" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    with open(damaged, "r+b") as f:
        f.write(b"\0" * 64)
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["merge", "--weights-only", str(run_copy), str(out), "--all",
                                      "--settle",
                                      "0", "--json"])
    assert result.exit_code == 3, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(d["checkpoint"], d["status"]) for d in lines] == [
        ("checkpoint-1", "merged"), ("checkpoint-2", "failed"), ("checkpoint-3", "merged"),
        ("checkpoint-4", "waiting")]
    assert lines[1]["exit_code"] == 3 and "__1_0.distcp" in lines[1]["reason"]
    assert "failed: checkpoint-2 (exit 3): " in result.stderr
    assert not (out / "checkpoint-2" / "model.safetensors").exists()


def test_only_stepped_checkpoints_are_the_runs(run_copy: Path, trained: Path) -> None:
    """HF Trainer leaves its final model and training_args.bin beside checkpoint-N/; accelerate
    nests checkpoints/checkpoint_N/. Neither the final model nor the pickle is a step."""
    torch.save({"learning_rate": 0.1}, run_copy / "training_args.bin")
    shutil.copy2(run_copy / "checkpoint-1" / "pytorch_model_fsdp_0" / "__0_0.distcp",
                 run_copy / "model-00001-of-00002.safetensors")
    (run_copy / "checkpoints").mkdir()
    shutil.copytree(trained / "run" / "checkpoint-2", run_copy / "checkpoints" / "checkpoint_7")
    names = [f.name for f in sweeps.find(run_copy)]
    assert names == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4",
                     "checkpoints/checkpoint_7"]


def test_files_still_changing_wait_for_settle(trained: Path) -> None:
    found = sweeps.find(trained / "run", settle=0)
    newest = max(f.mtime_ns for f in receipt.source_files(found[0].path)) / 1e9
    late = sweeps.find(trained / "run", settle=10, now=newest + 2)[0]
    assert late.pending is not None and late.pending.startswith("a file changed 2.0 s ago")
    assert sweeps.find(trained / "run", settle=10, now=newest + 11)[0].pending is None


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_task_shares_are_disjoint_and_complete(trained: Path, count: int) -> None:
    names = []
    for i in range(count):
        result = CliRunner().invoke(app, ["merge", "--weights-only", str(trained / "run"),
                                          "unused", "--all",
                                          "--dry-run", "--json", "--settle", "0", "--task",
                                          f"{i}/{count}"])
        assert result.exit_code == 0, result.output
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        assert all(d["task"] == i for d in lines)
        names += [d["checkpoint"] for d in lines]
    assert sorted(names) == [f"checkpoint-{s}" for s in (*STEPS, CUT)]


def test_assign_balances_bytes() -> None:
    found = [sweeps.Found(f"c{i}", Path(f"c{i}"), i, size, None)
             for i, size in enumerate([90, 10, 50, 50, 30, 70])]
    tasks = sweeps.assign(found, 3)
    loads = [sum(f.num_bytes for f, t in zip(found, tasks, strict=True) if t == k)
             for k in range(3)]
    assert sorted(loads) == [100, 100, 100]
    assert tasks == sweeps.assign(list(found), 3)  # the same on every task


def test_steps_select() -> None:
    found = [sweeps.Found(f"checkpoint-{s}", Path("x"), s, 1, None if s < 4000 else "busy")
             for s in (500, 1000, 1500, 2000, 3000, 4000)]

    def pick(text: str) -> list[int | None]:
        return [f.step for f in sweeps.select(found, sweeps.parse_steps(text))]

    assert pick("1000-2000") == [1000, 1500, 2000]
    assert pick("every 1000") == [1000, 2000, 3000, 4000]
    assert pick("1000-3000,every 1000") == [1000, 2000, 3000]
    assert pick("500,3000") == [500, 3000]
    assert pick("latest") == [3000]  # 4000 is still being written
    with pytest.raises(InputError, match="is not a step selection"):
        sweeps.parse_steps("recent")
    assert sweeps.step_of("epoch=2-step=300.ckpt") == 300
    assert sweeps.step_of("iter_0001000") == 1000


@pytest.mark.parametrize("flag", [["--watch"], ["--steps", "1"], ["--task", "0/2"],
                                  ["--then", "true"]])
def test_sweep_flags_need_all(flag: list[str], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["merge", "--weights-only", str(tmp_path),
                                      str(tmp_path / "o"), *flag])
    assert result.exit_code == 2
    assert "applies to merge --all" in result.output


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_watch_merges_checkpoints_as_they_appear(trained: Path, tmp_path: Path) -> None:
    """A real ``--watch`` process: checkpoint-2 appears while it runs, its data files first
    and its .metadata seconds later, as dcp.save writes them."""
    run, out, log = tmp_path / "run", tmp_path / "merged", tmp_path / "then.log"
    run.mkdir()
    shutil.copytree(trained / "run" / "checkpoint-1", run / "checkpoint-1")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpttool", "merge", "--weights-only", str(run), str(out), "--all",
         "--watch", "--poll", "0.2", "--settle", "0", "--json",
         "--then", f'echo "$CKPTTOOL_STEP" "$CKPTTOOL_OUT" >> {log}'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    lines: list[dict[str, str]] = []
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: lines.extend(
        json.loads(line) for line in iter(stdout.readline, "")), daemon=True)
    reader.start()
    try:
        _wait_for(lambda: (out / "checkpoint-1" / receipt.RECEIPT_NAME).exists(),
                  "checkpoint-1's merge")
        model = "pytorch_model_fsdp_0"
        src, dst = trained / "run" / "checkpoint-2", run / "checkpoint-2"
        dst.mkdir()
        shutil.copytree(src / "optimizer_0", dst / "optimizer_0")
        (dst / model).mkdir()
        for p in (src / model).glob("*.distcp"):
            shutil.copy2(p, dst / model / p.name)
        time.sleep(1.5)  # several polls with the .metadata missing
        assert not (out / "checkpoint-2").exists()
        # As dcp.save does: written under another name, renamed into place.
        shutil.copy2(src / model / ".metadata", dst / model / ".metadata.tmp")
        os.replace(dst / model / ".metadata.tmp", dst / model / ".metadata")
        _wait_for(lambda: len(lines) == 3, "checkpoint-2's merge")
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        reader.join(timeout=10)
    assert proc.returncode == 130, stderr
    states = [(d["checkpoint"], d["status"]) for d in lines]
    assert states == [("checkpoint-1", "merged"), ("checkpoint-2", "waiting"),
                      ("checkpoint-2", "merged")]
    for step in (1, 2):
        assert_step_exact(out / f"checkpoint-{step}", trained, step)
    assert log.read_text().split("\n")[:2] == [f"1 {out / 'checkpoint-1'}",
                                               f"2 {out / 'checkpoint-2'}"]


# --------------------------------------------------------------------------------------------
# Resuming a cut merge (core.merge.resume): pieces of 4 KB (tests.helpers.RESUME_PIECE), so that
# these small checkpoints have several (model.safetensors: 3 pieces).

def test_a_killed_merge_resumes_bit_exact_writing_only_what_was_missing(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, out = trained / "run" / "checkpoint-3", tmp_path / "out"
    cut_merge([str(src), str(out)])
    assert not (out / "model.safetensors").exists()  # nothing looks finished
    assert len(list(out.glob(".*.ckpttool-tmp"))) == 2  # the file, and its journal

    monkeypatch.setenv("CKPTTOOL_RESUME_PIECE", RESUME_PIECE)
    written: list[int] = []
    report = merge(src, out, progress=written.append, weights_only=True)
    assert report.resumed is not None
    assert report.resumed.pieces == 3 and report.resumed.done_before == 2
    assert sum(written) == report.total_bytes - report.resumed.bytes_skipped > 0
    assert_step_exact(out, trained, 3)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # journal gone


@pytest.mark.parametrize("doubt", ["source changed", "journal line cut", "file replaced"])
def test_a_doubtful_cut_merge_is_redone(trained: Path, tmp_path: Path, doubt: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    src, out = tmp_path / "checkpoint-3", tmp_path / "out"
    shutil.copytree(trained / "run" / "checkpoint-3", src)
    cut_merge([str(src), str(out)])
    (journal,) = out.glob(".*.journal.ckpttool-tmp")
    (temp,) = out.glob(".model.safetensors.*.ckpttool-tmp")
    if doubt == "source changed":
        data = src / "pytorch_model_fsdp_0" / "__0_0.distcp"
        os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
        redone = 0
    elif doubt == "journal line cut":
        journal.write_text(journal.read_text()[:-10])  # the second piece's line cut short
        redone = 1
    else:
        other = temp.with_name("other")
        other.write_bytes(temp.read_bytes())
        os.replace(other, temp)  # another file (inode) with the same bytes
        redone = 0
    monkeypatch.setenv("CKPTTOOL_RESUME_PIECE", RESUME_PIECE)
    report = merge(src, out, weights_only=True)
    assert report.resumed is not None and report.resumed.done_before == redone
    assert_step_exact(out, trained, 3)


def test_all_resumes_the_checkpoint_it_was_merging(trained: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "merged"
    cut_merge([str(trained / "run"), str(out), "--all", "--settle", "0"])
    monkeypatch.setenv("CKPTTOOL_RESUME_PIECE", RESUME_PIECE)
    report = sweeps.sweep(trained / "run", out, settle=0, options=WEIGHTS)
    assert _states(report.outcomes) == {"checkpoint-1": "merged", "checkpoint-2": "merged",
                                        "checkpoint-3": "merged", "checkpoint-4": "waiting"}
    first = report.outcomes[0].merge
    assert first is not None and first.resumed is not None and first.resumed.done_before == 2
    for step in STEPS:
        assert_step_exact(out / f"checkpoint-{step}", trained, step)


@given(rows=hs.lists(hs.integers(1, 64), min_size=1, max_size=20),
       piece=hs.integers(8, 2048), shard=hs.sampled_from([256, 1024, 1 << 40]))
def test_pieces_tile_every_file_in_order(rows: list[int], piece: int, shard: int) -> None:
    """Pieces cover every tensor of every output file exactly once, consecutive, and each but
    a file's last holds at least ``piece`` bytes (a resumed merge writes the rest)."""
    f32 = dtypes.get("F32")
    tensors: list[tuple[str, Any]] = [
        (f"t{i}", Tensor(f"t{i}", (f"t{i}",), f32, (n, 2),
                         (Chunk((0, 0), (n, 2), "f", 0, n * 8, RAW),)))
        for i, n in enumerate(rows)]
    plan = plan_merge(tensors, policy=dtype_policy.resolve("keep", None), max_shard_size=shard)
    found = resume.pieces(plan, piece)
    for i, f in enumerate(plan.files):
        mine = [p for p in found if p.file == i]
        assert [p.first for p in mine] == [0] + [p.end for p in mine[:-1]]
        assert mine[-1].end == len(f.tensors)
        assert all(p.nbytes >= piece for p in mine[:-1])
        assert sum(p.nbytes for p in mine) == sum(t.slot.nbytes for t in f.tensors)
    assert resume.pieces(plan, piece) == found  # the same for every run
