import sys

from ckpttool.cli import main, run

# ``python -m ckpttool``: the process is the program, and ends with the command (run).
# Executed from another script (runpy.run_module), the caller goes on after it (main).
if globals() is vars(sys.modules["__main__"]):
    run()
else:
    main()
