"""The one pickle policy (formats/codecs/policy.py): what a global *is* decides, the same for
every reader. Files come from the real writer (``torch.save``, ``dcp.save``, pickling real
classes); hand-made bytes only for the hostile and damaged ones."""

from __future__ import annotations

import argparse
import enum
import importlib
import os
import pathlib
import signal
import struct
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.formats import megatron
from ckpttool.formats.codecs import policy, torchsave


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stderr


@pytest.mark.parametrize(("module", "name", "kind"), [
    ("os", "system", policy.RUNS_CODE),
    ("posix", "system", policy.RUNS_CODE),
    ("builtins", "eval", policy.RUNS_CODE),
    ("builtins", "exec", policy.RUNS_CODE),
    ("builtins", "getattr", policy.RUNS_CODE),
    ("builtins", "__import__", policy.RUNS_CODE),
    ("subprocess", "Popen", policy.RUNS_CODE),
    ("subprocess", "check_output", policy.RUNS_CODE),
    ("functools", "partial", policy.RUNS_CODE),
    ("copyreg", "_reconstructor", policy.RUNS_CODE),
    ("importlib", "import_module", policy.RUNS_CODE),
    ("torch", "load", policy.RUNS_CODE),
    ("collections", "namedtuple", policy.RUNS_CODE),
    ("signal", "signal", policy.RUNS_CODE),
    ("pathlib", "Path.write_text", policy.RUNS_CODE),
    ("pathlib._local", "PosixPath", policy.DATA),
    ("pathlib._local", "PureWindowsPath", policy.DATA),
    ("pathlib", "PosixPath", policy.DATA),
    ("signal", "Signals", policy.DATA),
    ("argparse", "Namespace", policy.DATA),
    ("types", "SimpleNamespace", policy.DATA),
    ("collections", "OrderedDict", policy.DATA),
    ("datetime", "datetime", policy.DATA),
    ("enum", "IntEnum", policy.RUNS_CODE),  # the class itself (its functional API)
    ("ckpttool_no_such_module", "run", policy.UNKNOWN),
    ("ckpttool_no_such_module", "Thing", policy.UNKNOWN),  # an Enum member's shape only
])
def test_the_table(module: str, name: str, kind: str) -> None:
    assert policy.kind(module, name) == kind


def test_an_unknown_module_is_never_imported() -> None:
    name = "ckpttool_policy_probe_module"
    assert policy.kind(name, "Thing") == policy.UNKNOWN
    assert name not in sys.modules


# --------------------------------------------------------------------------------------------
# Real torch.save files holding inert classes, under this Python


class Color(enum.Enum):
    RED = 1
    BLUE = "blue"


class Perm(enum.IntFlag):
    R = 4
    W = 2


def test_inert_classes_read(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    torch.save({
        "w": torch.arange(4.0),
        "path": pathlib.PurePosixPath("/data/run"),
        "local": pathlib.Path("relative/dir"),
        "signal": signal.SIGTERM,
        "args": argparse.Namespace(lr=0.1, exit_signal=signal.SIGTERM),
        "simple": types.SimpleNamespace(a=1),
    }, path)
    code, err = _cli("inspect", str(path))
    assert code == 0, err
    from ckpttool.formats import torchfile

    values = torchfile.read_info(path).values
    assert values["path"] == "/data/run" and values["local"] == "relative/dir"
    assert values["signal"] == int(signal.SIGTERM)


@pytest.fixture
def foreign_module(tmp_path: Path) -> Iterator[types.ModuleType]:
    """A module that the writer has and the reader does not: imported to write, then gone."""
    name = "ckpttool_foreign_writer"
    (tmp_path / f"{name}.py").write_text(
        "import enum\n"
        "class Scope(enum.Enum):\n    full = 1\n    attn = 2\n"
        "class Thing:\n    def __init__(self):\n        self.x = 1\n"
        "def run(cmd):\n    return cmd\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
        policy.data_global.cache_clear()


def test_enum_of_a_module_not_here_reads_as_its_value(tmp_path: Path,
                                                      foreign_module: types.ModuleType) -> None:
    path = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2), "scope": foreign_module.Scope.attn}, path)
    sys.modules.pop(foreign_module.__name__)
    from ckpttool.formats import torchfile

    assert torchfile.read_info(path).values["scope"] == 2
    assert _cli("verify", str(path))[0] == 0


def test_a_class_of_a_module_not_here_is_not_supported(tmp_path: Path,
                                                       foreign_module: types.ModuleType) -> None:
    path = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2), "thing": foreign_module.Thing()}, path)
    sys.modules.pop(foreign_module.__name__)
    code, err = _cli("verify", str(path))
    assert code == 4, err
    assert err.count("\n") == 1 and "not supported yet" in err
    assert "'ckpttool_foreign_writer.Thing'" in err and str(path) in err


class _Runs:
    def __init__(self, func: object, arg: str) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return self.func, (self.arg,)


@pytest.mark.parametrize("func", [os.system, eval, getattr(__builtins__, "exec", exec)])
def test_a_callable_that_runs_code_is_malicious(tmp_path: Path, func: object) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "state.pt"
    arg = f"touch {marker}" if func is os.system else f"open({str(marker)!r}, 'w')"
    torch.save({"w": torch.ones(2), "x": _Runs(func, arg)}, path)
    code, err = _cli("verify", str(path))
    assert code == 3, err
    assert err.count("\n") == 1 and "may be malicious" in err
    assert not marker.exists()


def test_a_decoy_in_front_does_not_hide_what_runs_code(tmp_path: Path,
                                                       foreign_module: types.ModuleType) -> None:
    path = tmp_path / "state.pt"
    torch.save({"a": foreign_module.Thing(), "b": _Runs(os.system, "true")}, path)
    sys.modules.pop(foreign_module.__name__)
    code, err = _cli("verify", str(path))
    assert code == 3 and "'posix.system'" in err and "may be malicious" in err, err


# --------------------------------------------------------------------------------------------
# Megatron-LM's args: exit_signal (signal.Signals, 0.16+) and InferenceCudaGraphScope (0.19)


def test_megatron_args_with_signals_and_a_newer_enum(tmp_path: Path) -> None:
    class InferenceCudaGraphScope(enum.Enum):
        none = 1
        block = 2

    # Pickled under megatron.core's name, as 0.19 writes it; that module is not imported here
    # (or lacks the class: megatron-core 0.16 in the test environment).
    mod = "megatron.core.transformer.enums"
    InferenceCudaGraphScope.__module__ = mod
    InferenceCudaGraphScope.__qualname__ = "InferenceCudaGraphScope"
    fake = types.ModuleType(mod)
    fake.InferenceCudaGraphScope = InferenceCudaGraphScope  # type: ignore[attr-defined]
    saved = {m: sys.modules.get(m) for m in ("megatron", "megatron.core",
                                             "megatron.core.transformer", mod)}
    for parent in ("megatron", "megatron.core", "megatron.core.transformer"):
        sys.modules.setdefault(parent, types.ModuleType(parent))  # where megatron is missing
    sys.modules[mod] = fake
    try:
        args = argparse.Namespace(exit_signal=signal.SIGTERM, hidden_size=8,
                                  inference_cuda_graph_scope=InferenceCudaGraphScope.block)
        torch.save({"args": args, "iteration": 7}, tmp_path / "common.pt")
    finally:
        for m, was in saved.items():
            if was is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = was
        policy.data_global.cache_clear()
    common = megatron.read_common(tmp_path / "common.pt")
    assert isinstance(common, dict), common
    assert common["args"]["exit_signal"] == int(signal.SIGTERM)
    assert common["args"]["inference_cuda_graph_scope"] == 2
    assert common["iteration"] == 7


def test_python_311_signal_by_name(tmp_path: Path) -> None:
    """3.11.x pickles a member as getattr(Class, 'NAME'): signal.Signals too."""
    data = (b"\x80\x04}\x8c\x04args\x8c\x08builtins\x8c"
            b"\x07getattr\x93\x8c\x06signal\x8c\x07Signals\x93\x8c\x07SIGTERM\x86Rs.")
    assert torchsave.record_global("builtins", "getattr") is None  # tensor records: no
    value = torchsave.AllowListUnpickler(
        __import__("io").BytesIO(data), megatron_lookup).load()
    assert value == {"args": int(signal.SIGTERM)}


def megatron_lookup(module: str, name: str) -> object:
    if (module, name) == ("builtins", "getattr"):
        return torchsave.enum_getattr
    return megatron.common_global(module, name)


# --------------------------------------------------------------------------------------------
# DCP .metadata written by this Python's dcp.save, and deep nesting


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as tdcp

    root = tmp_path_factory.mktemp("dcp") / "ckpt"
    tdcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(root))
    return root


def test_checkpoint_id_path_is_read(dcp_dir: Path) -> None:
    assert b"pathlib" in (dcp_dir / ".metadata").read_bytes()
    assert _cli("verify", str(dcp_dir))[0] == 0


def _nest(md: Path, target: bytes, nested: bytes) -> None:
    """``md`` (a protocol-4 pickle in one frame) with the first push of the short string
    ``target`` replaced by ``nested`` (opcodes that build one value), the frame fixed."""
    data = md.read_bytes()
    enc = b"\x8c" + bytes([len(target)]) + target
    i = data.index(enc)
    out = data[:i] + nested + data[i + len(enc):]
    (frame,) = struct.unpack_from("<Q", data, 3)
    md.write_bytes(out[:3] + struct.pack("<Q", frame + len(nested) - len(enc)) + out[11:])


DEEP = 200_000
NESTINGS = {
    "tuple": b")" + b"\x85" * DEEP,  # a tuple in a tuple..., hashed as a dict key
    "list": b"]" * DEEP + b"a" * (DEEP - 1),
}


@pytest.mark.parametrize("nesting", ["tuple", "list"])
def test_deep_metadata_is_one_line(dcp_dir: Path, tmp_path: Path, nesting: str) -> None:
    import shutil

    root = Path(shutil.copytree(dcp_dir, tmp_path / "ckpt"))
    _nest(root / ".metadata", b"w", NESTINGS[nesting])
    code, err = _cli("verify", str(root))
    assert code == 3, err
    assert err.count("\n") == 1 and "Traceback" not in err and "Recursion" not in err


@pytest.mark.parametrize("nesting", ["tuple", "list"])
def test_deep_torch_save_pickle_is_one_line(tmp_path: Path, nesting: str) -> None:
    """200,000 levels as a dict key / value in a torch.save file's data.pkl (hand-made)."""
    path = tmp_path / "deep.pt"
    payload = (b"\x80\x02}" + NESTINGS[nesting] + b"K\x01s." if nesting == "tuple"
               else b"\x80\x02}\x8c\x01k" + NESTINGS[nesting] + b"s.")  # a list: a value
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("deep/data.pkl", payload)
        z.writestr("deep/byteorder", b"little")
        z.writestr("deep/version", b"3\n")
    code, err = _cli("verify", str(path))
    assert code == 3, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_function_of_an_imported_module_runs_code() -> None:
    assert policy.kind("tests.formats.test_pickle_policy", "megatron_lookup") == policy.RUNS_CODE
    assert policy.kind("torch._utils", "_rebuild_qtensor") == policy.UNKNOWN  # torch's own


def test_a_member_named_at_its_module_top_is_data() -> None:
    """Python 3.10 pickles signal.SIGTERM as the global ``signal.SIGTERM``."""
    assert policy.kind("signal", "SIGTERM") == policy.DATA
    assert torchsave.record_global("signal", "SIGTERM") == int(signal.SIGTERM)
    assert policy.kind("signal", "signal") == policy.RUNS_CODE
