"""The CLI must stay light: shell completion runs it on every TAB."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ckpttool.cli.completions import SHELLS, script

ROOT = Path(__file__).resolve().parents[2]


def test_help_imports_neither_torch_nor_the_operations() -> None:
    code = ("import sys\nfrom ckpttool.cli import app\nfrom typer.testing import CliRunner\n"
            "for args in (['--help'], ['merge', '--help'], ['reshard', '--help']):\n"
            "    r = CliRunner().invoke(app, args)\n    assert r.exit_code == 0, r.output\n"
            "assert 'torch' not in sys.modules\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('ckpttool.core'))\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_library_api_loads_operations_on_use() -> None:
    import ckpttool

    assert callable(ckpttool.merge) and callable(ckpttool.reshard)
    assert set(ckpttool.__all__) >= {"merge", "inspect", "verify", "reshard", "CkptError"}


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


def test_default_workers_follow_the_cpus_this_process_may_use() -> None:
    code = ("import os\nos.sched_setaffinity(0, {0})\n"
            "from ckpttool.core.runtime.torch_threads import default_workers\n"
            "assert default_workers() == 1, default_workers()\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_typed_package() -> None:
    assert (ROOT / "ckpttool" / "py.typed").exists()


def test_zsh_completion_starts_with_compdef() -> None:
    assert (ROOT / "completions" / "_ckpttool").read_text().startswith("#compdef ckpttool\n")


def test_a_dumb_terminal_gets_plain_progress_lines(monkeypatch, capsys) -> None:
    from ckpttool.cli.common import ProgressBar

    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    ticks = iter(range(0, 1000, 2))  # 2 s between calls
    bar = ProgressBar("merging", enabled=True, mode="auto", clock=lambda: next(ticks))
    on_start, progress = bar.callbacks
    assert on_start is not None and progress is not None
    bar.begin()
    on_start(1000)
    for _ in range(20):
        progress(50)
    bar.stop()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("merging: planning")
    assert lines[1] == "merging: 10% (100 B of 1.00 KB, 25 B/s, 0:00:36 left)"
    assert lines[-1] == "merging: 100% (1.00 KB of 1.00 KB, 25 B/s, done in 0:00:40)"
    assert len(lines) == 11
    assert ProgressBar("merging", enabled=False).callbacks == (None, None)


def test_inspecting_a_file_imports_no_format_of_directories(tmp_path: Path) -> None:
    # The registry imports a format's module when it is tried, and discovery looks for side
    # files only beside sharded checkpoints: `ckpttool inspect x.safetensors` loads none of
    # the directory formats' modules (DCP's reader alone is ~0.05 s).
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, 3)}, tmp_path / "w.safetensors")
    code = ("import sys\nfrom ckpttool.cli import main\n"
            f"sys.argv = ['ckpttool', 'inspect', {str(tmp_path / 'w.safetensors')!r}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('ckpttool.formats.dcp',\n"
            "    'ckpttool.formats.megatron', 'ckpttool.formats.deepspeed',\n"
            "    'ckpttool.formats.rank_files', 'ckpttool.formats.hf_dcp',\n"
            "    'ckpttool.formats.bin_index')))\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
