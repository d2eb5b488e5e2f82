"""Issue 34 ("also found"): one object under a gs/az prefix whose name holds ``//``, a
``..`` segment or a control character, against fake-gcs-server and Azurite. A name with a
control character that the listing returns is skipped and named, as on S3. obstore's listing
stops at a ``//`` or ``..`` name (it cannot address it), so ckpttool cannot skip that one;
every command says so in one line naming it (exit 3), at once: never "listing failed after 5
tries" after minutes of retries. ``merge --all`` into a bucket is refused (exit 4) and makes no
local ``gs:`` directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clouds.conftest import Cloud

BAD = {"empty segment": "a//b.json", "dot-dot segment": "x/../y.json",
       "control character": "c\x01d.json"}


def cli(cloud: Cloud, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **cloud.env, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run([sys.executable, "-m", "ckpttool", *args], capture_output=True,
                          text=True, env=full, timeout=300, cwd=cwd)


@pytest.mark.parametrize("bad", list(BAD))
def test_unaddressable_object_names_are_one_line(bad: str, cloud: Cloud, llama_ckpt: Path,
                                                 tmp_path: Path) -> None:
    prefix = f"boundary/{bad.replace(' ', '-')}"
    url = cloud.upload_dir(llama_ckpt, prefix)
    try:
        cloud.put(f"{prefix}/{BAD[bad]}", b"{}")
    except Exception as e:  # noqa: BLE001 - an emulator that refuses the name: nothing to list
        pytest.skip(f"{cloud.name} refuses the name itself: {e}")
    for args in (["inspect", url], ["verify", url], ["merge", url, str(tmp_path / "out")]):
        r = cli(cloud, *args, cwd=tmp_path)
        if bad == "control character" and r.returncode == 0:  # listed: skipped and named
            assert f"{url}/c\\" in r.stderr, r.stderr  # escaped: \x01, or \ufffd as listed
            assert "d.json: skipped, a control character in its name" in r.stderr, r.stderr
            continue
        assert r.returncode == 3, (args, r.stderr)
        assert "Traceback" not in r.stderr and "tries" not in r.stderr, r.stderr
        (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("ckpttool: error:")]
        assert "cannot address" in line and "rename or remove it" in line, line
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_merge_all_into_a_bucket_is_refused(dry_run: list[str], cloud: Cloud, tmp_path: Path
                                            ) -> None:
    (tmp_path / "run").mkdir()
    url = cloud.url("boundary/sweep")
    r = cli(cloud, "merge", "--all", str(tmp_path / "run"), url, *dry_run, cwd=tmp_path)
    assert r.returncode == 4, r.stderr
    assert f"{url}: merge --all writes its outputs" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["run"]
