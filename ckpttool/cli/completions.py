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
    if shell == "fish":
        text = FISH
    return text


# Typer's fish script runs the program twice per TAB (once to ask whether to offer files,
# once for the candidates: each run ~0.2 s). This one runs it once and offers files when the
# program has no candidate (an argument, a --config PATH...).
FISH = """\
function __ckpttool_complete
    set -l found (env _CKPTTOOL_COMPLETE=complete_fish _TYPER_COMPLETE_FISH_ACTION=get-args \\
        _TYPER_COMPLETE_ARGS=(commandline -cp) ckpttool)
    if test -n "$found"  # one empty line when it has no candidate
        printf '%s\\n' $found
    else
        __fish_complete_path (commandline -ct)
    end
end
complete --command ckpttool --no-files --arguments '(__ckpttool_complete)'
"""


def main(argv: list[str]) -> None:
    out = Path(argv[0] if argv else "completions")
    out.mkdir(parents=True, exist_ok=True)
    for shell, name in SHELLS.items():
        (out / name).write_text(script(shell))
        print(out / name)


if __name__ == "__main__":
    main(sys.argv[1:])
