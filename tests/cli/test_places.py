"""Issue 34 finding 1 and issue 37 item 1: one classifier (``ckpttool.storage.places``) for
every SRC, OUT, RUN and option path, walked through every command and mode with every scheme.

No server is needed: each case here is refused (or classified) before any byte is read or
written. Remote schemes that do run are covered against moto, fake-gcs-server and Azurite in
``tests/remote`` and ``tests/clouds``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ckpttool
from ckpttool.cli import app
from ckpttool.core.merge import sweep
from ckpttool.errors import UnsupportedError, UsageError
from ckpttool.storage import places

REMOTE = ["s3://bucket/x", "gs://bucket/x", "az://container/x",
          "abfs://c@acct.dfs.core.windows.net/x", "abfss://c@acct.dfs.core.windows.net/x"]
UNSUPPORTED = ["ftp://host/x", "https://host/x", "hdfs://nn/x", "file:///tmp/x"]


def run(*args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None):
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return CliRunner().invoke(app, [str(a) for a in args], env=env)
    finally:
        os.chdir(old)


# --------------------------------------------------------------------------------------------
# The classifier itself


@pytest.mark.parametrize("value", REMOTE)
def test_remote_schemes_are_classified(value: str) -> None:
    place = places.classify(value, what="output")
    assert place.remote and place.scheme == value.split("://")[0] and place.text == value
    assert places.is_remote(value)
    with pytest.raises(UnsupportedError, match="takes a local path, not a"):
        places.classify(value, what="--config", remote_ok=False)


@pytest.mark.parametrize("value", ["out", "./out", "/abs/out", "C:\\x", "a:b", "gs:", "s3"])
def test_local_paths_are_local(value: str) -> None:
    place = places.classify(value, what="output")
    assert not place.remote and place.path == Path(value)


def test_a_path_made_of_a_url_keeps_its_scheme() -> None:
    # Typer parses --config as a Path: "gs://b/k" arrives as "gs:/b/k"
    assert places.scheme_of(Path("gs://b/k")) == "gs"
    with pytest.raises(UnsupportedError):
        places.classify(Path("gs://b/k"), what="--config", remote_ok=False)


@pytest.mark.parametrize("value", UNSUPPORTED)
def test_unsupported_schemes_name_the_supported(value: str) -> None:
    with pytest.raises(UnsupportedError) as e:
        places.classify(value, what="output")
    assert str(e.value) == (f"{value}: {value.split('://')[0]}:// is not a storage ckpttool "
                            "reads or writes (as output); supported: local paths, s3://, "
                            "gs://, az://, abfs://, abfss://")


def test_dash_is_refused() -> None:
    with pytest.raises(UsageError) as e:
        places.classify("-", what="output")
    assert e.value.exit_code == 2
    assert str(e.value).startswith("-: output is a path, not a stream")


# --------------------------------------------------------------------------------------------
# Every command and mode, every scheme


def _modes(src: Path, run_dir: Path, out: Path) -> dict[str, tuple[list[str], bool]]:
    """Mode -> (argv with V where the value goes, whether a remote URL is taken there)."""
    return {
        "merge SRC": (["merge", "V", str(out)], True),
        "merge OUT": (["merge", str(src), "V"], True),
        "merge --dry-run OUT": (["merge", str(src), "V", "--dry-run"], True),
        "merge --slice OUT": (["merge", str(src), "V", "--slice", "0/2"], True),
        "merge --finish OUT": (["merge", str(src), "V", "--finish"], True),
        "merge --config": (["merge", str(src), str(out), "--config", "V"], False),
        "merge --adapter": (["merge", str(src), str(out), "--adapter", "V"], False),
        "merge --all RUN": (["merge", "--all", "V", str(out)], False),
        "merge --all OUT_ROOT": (["merge", "--all", str(run_dir), "V"], False),
        "merge --all --dry-run OUT_ROOT": (["merge", "--all", str(run_dir), "V", "--dry-run"],
                                           False),
        "merge --all --watch OUT_ROOT": (["merge", "--all", str(run_dir), "V", "--watch",
                                          "--poll", "0.1"], False),
        "inspect": (["inspect", "V"], True),
        "verify": (["verify", "V"], True),
        "verify --against": (["verify", str(src), "--against", "V"], True),
        "verify --check-manifest": (["verify", str(src), "--check-manifest", "V"], False),
        "verify --config": (["verify", str(src), "--config", "V"], False),
        "reshard SRC": (["reshard", "V", str(out), "--ranks", "2"], True),
        "reshard OUT": (["reshard", str(src), "V", "--ranks", "2"], True),
    }


MODES = list(_modes(Path("s"), Path("r"), Path("o")))


@pytest.fixture
def where(tmp_path: Path) -> tuple[Path, Path, Path]:
    run_dir = tmp_path / "run"
    src = run_dir / "checkpoint-1"
    src.mkdir(parents=True)
    return src, run_dir, tmp_path / "out"


def _argv(mode: str, value: str, where: tuple[Path, Path, Path]) -> list[str]:
    argv, _ = _modes(*where)[mode]
    return [value if a == "V" else a for a in argv]


def _made_nothing(cwd: Path, value: str) -> None:
    """No local directory named after the value (``./gs:/``, ``./-/``) appeared."""
    first = value.split("/")[0]
    assert not (cwd / first).exists(), sorted(os.listdir(cwd))
    assert not (cwd / "out").exists()


@pytest.mark.parametrize("value", UNSUPPORTED)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_refuses_an_unsupported_scheme(mode: str, value: str, where, tmp_path: Path
                                                  ) -> None:
    r = run(*_argv(mode, value, where), cwd=tmp_path)
    assert r.exit_code == 4, (mode, r.output)
    scheme = value.split("://")[0]
    assert f"{scheme}:// is not a storage" in r.stderr, r.stderr
    assert "supported: local paths, s3://" in r.stderr
    assert "Traceback" not in r.output
    _made_nothing(tmp_path, value)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_refuses_dash(mode: str, where, tmp_path: Path) -> None:
    r = run(*_argv(mode, "-", where), cwd=tmp_path)
    assert r.exit_code == 2, (mode, r.output)
    assert "ckpttool: error: -: " in r.stderr and "not a stream" in r.stderr, r.stderr
    _made_nothing(tmp_path, "-")


@pytest.mark.parametrize("value", REMOTE)
@pytest.mark.parametrize("mode", [m for m in MODES if not _modes(Path(), Path(), Path())[m][1]])
def test_modes_without_object_storage_refuse_it(mode: str, value: str, where, tmp_path: Path
                                                ) -> None:
    """--all (RUN or OUT_ROOT, dry run or watching) and local-only options refuse a
    URL of a served scheme with exit 4: never a local ``gs:/`` directory, never exit 0."""
    r = run(*_argv(mode, value, where), cwd=tmp_path)
    assert r.exit_code == 4, (mode, r.output)
    assert r.stderr.startswith(f"ckpttool: error: {value}"), r.stderr
    assert "\n" not in r.stderr.rstrip("\n")
    _made_nothing(tmp_path, value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("value", ["-", "ftp://host/x"])
def test_torchrun_refuses_before_joining(value: str, where, tmp_path: Path) -> None:
    """Under a launcher (rank 0 of 2, its peer never started), the output is refused before
    the process waits for the others."""
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "CKPTTOOL_DIST_TIMEOUT": "20"}
    r = run("merge", str(where[0]), value, env=env, cwd=tmp_path)
    assert r.exit_code == (2 if value == "-" else 4), r.output
    assert f"ckpttool: error: {value}: " in r.stderr
    _made_nothing(tmp_path, value)


# --------------------------------------------------------------------------------------------
# The library takes the same paths through the same classifier


@pytest.mark.parametrize("value", ["gs://bucket/out", "az://c/out", "ftp://h/out", "-"])
def test_library_sweep_refuses(value: str, where, tmp_path: Path) -> None:
    _, run_dir, _ = where
    error = UsageError if value == "-" else UnsupportedError
    with pytest.raises(error):
        sweep.sweep(run_dir, value)
    with pytest.raises(error):
        sweep.sweep(value, tmp_path / "out")
    assert not (Path.cwd() / value.split("/")[0]).exists() or value.split("/")[0] in ("",)


@pytest.mark.parametrize("call", ["merge", "inspect", "verify", "reshard"])
def test_library_operations_refuse(call: str, where) -> None:
    src = where[0]
    fn = getattr(ckpttool, call)
    for value, error in (("ftp://h/x", UnsupportedError), ("-", UsageError)):
        with pytest.raises(error):
            if call in ("merge", "reshard"):
                fn(src, value)
            else:
                fn(value)


@pytest.mark.parametrize("value,cloud,bucket,key,host", [
    ("s3://b/run/ckpt-1/", "s3", "b", "run/ckpt-1", ""),
    ("gs://b", "gs", "b", "", ""),
    ("az://c/x/y", "az", "c", "x/y", ""),
    ("abfss://c@acct.dfs.core.windows.net/x", "az", "c", "x", "acct.dfs.core.windows.net"),
])
def test_one_url_type_for_every_store(value: str, cloud: str, bucket: str, key: str,
                                      host: str) -> None:
    from ckpttool.storage import objstore, s3

    url = places.parse_url(value)
    assert (url.cloud, url.bucket, url.key, url.host) == (cloud, bucket, key, host)
    assert str(url) == value.rstrip("/")
    assert s3.Url is objstore.Url is places.Url
    backend = s3 if cloud == "s3" else objstore
    assert backend.parse(value) == url
    with pytest.raises(UnsupportedError):
        places.parse_url("ftp://h/x")
