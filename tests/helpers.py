"""Helpers shared by test modules: one home, so that no test module imports another
(importing a ``test_*.py`` drags its fixtures and module-level set-up along)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ckpttool.core.checkpoint.names import canonical_fqn
from ckpttool.formats.dcp import reader as dcp
from tests.reference import reference_state_dict

# dtypes a merge never casts (--dtype leaves them as stored).
NEVER_CAST = {torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.uint8, torch.int8,
              torch.int16, torch.int32, torch.int64}
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
               torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL",
               torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def load_out(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a merged safetensors output (one file or an index and shards)."""
    index = out / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    result: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(out / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert key not in result
                result[key] = f.get_tensor(key)
    return result


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaNs and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def expected(dcp_dir: Path, cast_to: torch.dtype | None) -> dict[str, torch.Tensor]:
    """What a merge of ``dcp_dir`` must hold, by PyTorch's own DCP loader, under canonical
    names (cast to ``cast_to`` where a merge casts)."""
    info = dcp.read_info(dcp_dir)
    paths = {t.name: t.path for t in info.tensors}
    ref = reference_state_dict(dcp_dir)
    out = {}
    for key, path in paths.items():
        t = ref[key]
        assert isinstance(t, torch.Tensor)
        if cast_to is not None and t.is_floating_point() and t.dtype not in NEVER_CAST:
            t = t.to(cast_to)
        out[canonical_fqn(path)] = t
    return out


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                     *, cast: bool = False) -> None:
    """Every byte equal. After a cast, NaNs only need to stay NaN: PyTorch's own f64 -> bf16
    kernel gives a NaN 0x7FC0 in its scalar tail and 0xFFFF in its vector loop, so the bit
    pattern of a cast NaN depends on where it falls, not on its value."""
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype, name
        assert tuple(g.shape) == tuple(t.shape), name
        if cast and t.is_floating_point() and t.element_size() > 1:
            nan = torch.isnan(t)
            assert torch.equal(torch.isnan(g), nan), f"{name}: NaNs moved"
            assert torch.equal(bits(g[~nan]), bits(t[~nan])), f"{name} differs"
        else:
            assert torch.equal(bits(g), bits(t)), f"{name} differs"


def as_table(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], str, int]]:
    """Name -> (shape, safetensors dtype, bytes) of real tensors."""
    return {k: (list(v.shape), DTYPE_NAMES[v.dtype], v.numel() * v.element_size())
            for k, v in tensors.items()}


def json_table(doc: dict[str, Any]) -> dict[str, tuple[list[int], str, int]]:
    """The same table from an ``inspect --json`` document."""
    return {t["name"]: (t["shape"], t["dtype"], t["bytes"]) for t in doc["tensors"]}


class RunsCommand:
    """A pickle that runs ``command`` when loaded (hostile input: it must never run)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


def write_malicious(directory: Path, sentinel: Path) -> Path:
    """A DCP directory whose ``.metadata`` would create ``sentinel`` if it were unpickled."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {sentinel}")))
    (directory / "__0_0.distcp").write_bytes(b"\0" * 64)
    return directory


class ForkedCli:
    """``python -m ckpttool *args`` with environment ``env``, in a process forked by the
    rank server of :mod:`examples.fsdp2_checkpoint` (torch imported there already) instead
    of a fresh interpreter: a second or two of imports less per run, for tests that run the
    CLI dozens of times (a kill at every step). What those tests use of ``subprocess.Popen``
    (``stdout=PIPE, stderr=PIPE, text=True``): ``pid``, ``poll``, ``send_signal``,
    ``communicate`` and ``returncode``, negative for a signal."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        import multiprocessing
        import tempfile

        from examples.fsdp2_checkpoint import KINDS, start_rank_server

        self.args = ["ckpttool", *args]
        self._dir = tempfile.TemporaryDirectory(prefix="ckpttool-cli-")
        self._out, self._err = Path(self._dir.name, "stdout"), Path(self._dir.name, "stderr")
        ctx = multiprocessing.get_context(start_rank_server(KINDS))
        self._proc = ctx.Process(target=_cli_child,
                                 args=(list(args), env, str(self._out), str(self._err)))
        self._proc.start()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._proc.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        try:
            return self._out.read_text(), self._err.read_text()
        finally:
            self._dir.cleanup()

    def kill(self) -> None:
        self.send_signal(9)
        self._proc.join()


def run_cli(args: list[str], env: dict[str, str], *, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run([python, "-m", "ckpttool", *args], env=env, capture_output=True,
    text=True, timeout=timeout)`` returns, from a :class:`ForkedCli`."""
    p = ForkedCli(args, env)
    try:
        out, err = p.communicate(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode is not None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)

def _cli_child(args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """The forked process of :class:`ForkedCli`: the environment, argv and standard streams of
    ``python -m ckpttool *args``, then the program (which ends the process itself)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["ckpttool", *args]
    from ckpttool.cli import run

    run()
def same_inspect(url: str, local: Path) -> None:
    """``inspect --json`` of the remote checkpoint ``url`` is that of its local copy (the
    paths aside)."""
    from typer.testing import CliRunner

    from ckpttool.cli import app

    a = CliRunner().invoke(app, ["inspect", url, "--json"])
    b = CliRunner().invoke(app, ["inspect", str(local), "--json"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    da, db = json.loads(a.stdout.replace(url, str(local))), json.loads(b.stdout)
    da.pop("seconds", None), db.pop("seconds", None)
    assert da == db
