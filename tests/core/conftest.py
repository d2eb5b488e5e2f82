"""Fixtures shared by the test modules of tests/core."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import runs


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``trained / "run"``: a real training run (:mod:`tests.runs`), checkpoint-1..3
    complete, checkpoint-4 cut before its ``.metadata``; references beside."""
    out = tmp_path_factory.mktemp("training")
    runs.write_run(out)
    return out
