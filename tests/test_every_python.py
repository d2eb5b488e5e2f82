"""What must hold under every Python the package declares (``requires-python``): each module
imports (Python 3.10 has no ``typing.dataclass_transform``, ``typing.Self``, ``StrEnum``,
``tomllib``, ``ExceptionGroup``, ``datetime.UTC``...) and the CLI answers. ``.ci/pythons``
runs this file on 3.10, 3.12 and 3.13 without torch (the whole suite runs on 3.11; the
checkpoints those Pythons write are read in ``tests/formats/test_pythons.py``)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckpttool

ROOT = Path(__file__).resolve().parents[1]
# Optional dependencies (extras) a module may need; the module is then skipped here.
OPTIONAL = {"boto3", "botocore", "obstore", "zstandard", "zlib_ng", "psutil"}


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(ckpttool.__path__, "ckpttool.")
                  if m.name != "ckpttool.__main__")  # runs the CLI


@pytest.mark.parametrize("name", _modules())
def test_module_imports(name: str) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in OPTIONAL:
            raise
        pytest.skip(f"needs the optional {e.name}")


def test_declared_pythons_include_this_one() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.10"' in text
    assert sys.version_info >= (3, 10)


def test_cli_verifies_a_checkpoint() -> None:
    src = ROOT / "tests" / "data" / "pythons" / "py313" / "dcp"
    r = subprocess.run([sys.executable, "-m", "ckpttool", "verify", str(src)],
                       capture_output=True, text=True, cwd=ROOT, check=False,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("verify OK"), r.stdout
