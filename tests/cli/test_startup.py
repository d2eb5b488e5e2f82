"""The CLI must stay light: shell completion runs it on every TAB."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ckpttool.cli.completions import SHELLS, script

ROOT = Path(__file__).resolve().parents[2]


def test_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom ckpttool.cli import app\nfrom typer.testing import CliRunner\n"
            "r = CliRunner().invoke(app, ['merge', '--help'])\nassert r.exit_code == 0, r.output\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_completion_scripts_are_current() -> None:
    for shell, name in SHELLS.items():
        committed = (ROOT / "completions" / name).read_text()
        assert committed == script(shell), (
            f"completions/{name} is stale; run: python -m ckpttool.cli.completions completions"
        )


def test_python_dash_m_works() -> None:
    r = subprocess.run([sys.executable, "-m", "ckpttool", "--version"], capture_output=True,
                       text=True, check=True)
    assert r.stdout.startswith("ckpttool ")
