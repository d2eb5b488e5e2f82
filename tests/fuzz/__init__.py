"""The fuzz campaign: seeded mutants of real checkpoints through every command
(:mod:`tests.fuzz.mutate`, :mod:`tests.fuzz.harness`); ``python -m tests.fuzz --n 4000`` runs
it at length and prints the table, ``tests/fuzz/test_fuzz.py`` runs a short one in CI."""
