"""What ``verify`` says of a non-tensor entry it did not read
(:mod:`ckpttool.core.checkpoint.non_tensor`): whether the pickle asks for code is the one
pickle policy's verdict (:func:`ckpttool.formats.codecs.policy.kind`), the same that merge
and the record readers take, never a list of its own.

Entries are written by torch's own DCP writer (one process, ``no_dist``); the hostile ones
pickle a call (``__reduce__``), nothing in them is ever run."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import ckpttool
from ckpttool.core.checkpoint import non_tensor
from ckpttool.formats.codecs import policy

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Calls:
    """A pickle that calls ``fn(*args)`` when loaded (hostile input: never run here)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.fn, self.args)


def _problems(tmp_path: Path, value: Any) -> list[tuple[str, str, str]]:
    torch_dcp.save({"w": torch.ones(2), "entry": value}, checkpoint_id=tmp_path / "ckpt",
                   no_dist=True)
    report = ckpttool.verify(tmp_path / "ckpt")
    return [(p.severity, p.code, p.message) for p in report.problems if p.severity != "info"]


@pytest.mark.parametrize("call", [
    (shutil.rmtree, "/nonexistent-ckpttool-test"),
    (subprocess.call, ["true"]),
    (eval, "1"),
])
def test_a_call_the_policy_says_runs_code_is_an_error(call: tuple[Any, ...],
                                                      tmp_path: Path) -> None:
    fn = call[0]
    ((severity, code, message),) = _problems(tmp_path, _Calls(*call))
    assert (severity, code) == ("error", "code-in-checkpoint")
    named = message.split("asks for '")[1].split("'")[0]
    module, _, name = named.rpartition(".")
    assert policy.kind(module, name) == policy.RUNS_CODE
    assert name == fn.__name__


def test_a_genuine_unknown_class_holding_bytes_is_not_called_code(tmp_path: Path) -> None:
    """A class the reader does not know (from a module this process has not imported), with
    bytes inside (protocol 2 pickles them through ``_codecs.encode``, which the policy reads
    as data): not read, a warning; never 'runs code' (it is a genuine checkpoint)."""
    module = types.ModuleType("ckpttool_test_elsewhere")

    @dataclasses.dataclass
    class Settings:
        blob: bytes

    Settings.__module__ = module.__name__
    Settings.__qualname__ = "Settings"
    module.Settings = Settings  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        found = _problems(tmp_path, Settings(b"\x00\x01state"))
    finally:
        del sys.modules[module.__name__]
    assert [(s, c) for s, c, _ in found] == [("warning", "object-not-read")]
    assert policy.kind("_codecs", "encode") == policy.DATA


def test_the_verdict_is_the_policys_for_every_global_it_names() -> None:
    """runs_code agrees with policy.kind name by name; the weights-only reader's own
    rebuilders are never what asks for code."""
    names = ("torch._utils._rebuild_tensor_v2", "collections.OrderedDict", "_codecs.encode",
             "argparse.Namespace", "builtins.set", "posix.system")
    assert non_tensor.runs_code(names) == "posix.system"
    assert non_tensor.runs_code(names[:-1]) is None
    for qualname in ("os.system", "subprocess.Popen", "builtins.exec", "copyreg._reconstructor",
                     "genericpath.exists", "pickle.loads", "torch.load"):
        module, _, name = qualname.rpartition(".")
        assert policy.kind(module, name) == policy.RUNS_CODE
        assert non_tensor.runs_code((qualname,)) == qualname
