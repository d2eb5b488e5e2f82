import sys

from ckpttool.cli import main, run


def _started_as_module() -> bool:
    """True where this process is ``python [options] -m ckpttool ...`` itself: the process
    is the program, and ends with the command. False where another program runs this module
    as its ``__main__`` and goes on after it (``runpy.run_module(..., alter_sys=True)``,
    ``python -m pdb -m ckpttool``, ``coverage run -m ckpttool``): the command line that
    started the process says which."""
    argv = getattr(sys, "orig_argv", [])
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 1 : i + 2] == ["ckpttool"]
        if not arg.startswith("-") or arg in ("-", "-c"):
            return False  # a script or a command first
        i += 2 if arg in ("-X", "-W", "--check-hash-based-pycs") else 1
    return False


if globals() is vars(sys.modules["__main__"]) and _started_as_module():
    run()
else:
    main()
