"""Generate the shell completion scripts kept in ``completions/``.

    python -m ckpttool.cli.completions completions/

Each script is what the program itself prints for ``_CKPTTOOL_COMPLETE=source_<shell>``, the
documented completion hook. A test checks the committed scripts are current.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SHELLS = {"bash": "ckpttool.bash", "zsh": "_ckpttool", "fish": "ckpttool.fish"}


def script(shell: str) -> str:
    """The completion script for ``shell``."""
    env = {**os.environ, "_CKPTTOOL_COMPLETE": f"source_{shell}"}
    text = subprocess.run([sys.executable, "-m", "ckpttool"], env=env, check=True,
                          capture_output=True, text=True).stdout
    text = text.lstrip("\n")
    if shell == "zsh":
        # zsh autoloads a function file from $fpath only when "#compdef" is its very first
        # line, and then runs the file as the function _ckpttool on the first TAB: that run
        # must complete too (not merely register the completer for the next TAB). Sourced,
        # the file registers it as before.
        register = "compdef _ckpttool_completion ckpttool"
        if register in text:
            text = text.replace(register, (
                'if [[ "${funcstack[1]}" == _ckpttool ]]; then\n'
                '  _ckpttool_completion "$@"\n'
                "else\n"
                f"  {register}\n"
                "fi"))
    return text


def main(argv: list[str]) -> None:
    out = Path(argv[0] if argv else "completions")
    out.mkdir(parents=True, exist_ok=True)
    for shell, name in SHELLS.items():
        (out / name).write_text(script(shell))
        print(out / name)


if __name__ == "__main__":
    main(sys.argv[1:])
