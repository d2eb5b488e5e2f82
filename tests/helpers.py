"""Helpers shared by test modules: one home, so that no test module imports another
(importing a ``test_*.py`` drags its fixtures and module-level set-up along)."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpttool.core.checkpoint.names import canonical_fqn
from ckpttool.formats.dcp import reader as dcp
from tests.forked_cli import ForkedCli, run_cli
from tests.reference import reference_state_dict

if TYPE_CHECKING:
    from click.testing import Result

    from tests.remote.conftest import S3

ROOT = Path(__file__).resolve().parents[1]  # the repository: PYTHONPATH of a CLI process
INDEX = "model.safetensors.index.json"

# dtypes a merge never casts (--dtype leaves them as stored).
NEVER_CAST = {torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.uint8, torch.int8,
              torch.int16, torch.int32, torch.int64}
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
               torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL",
               torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def load_out(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a merged safetensors output (one file or an index and shards)."""
    index = out / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    result: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(out / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert key not in result
                result[key] = f.get_tensor(key)
    return result


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaNs and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def expected(dcp_dir: Path, cast_to: torch.dtype | None) -> dict[str, torch.Tensor]:
    """What a merge of ``dcp_dir`` must hold, by PyTorch's own DCP loader, under canonical
    names (cast to ``cast_to`` where a merge casts)."""
    info = dcp.read_info(dcp_dir)
    paths = {t.name: t.path for t in info.tensors}
    ref = reference_state_dict(dcp_dir)
    out = {}
    for key, path in paths.items():
        t = ref[key]
        assert isinstance(t, torch.Tensor)
        if cast_to is not None and t.is_floating_point() and t.dtype not in NEVER_CAST:
            t = t.to(cast_to)
        out[canonical_fqn(path)] = t
    return out


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                     *, cast: bool = False) -> None:
    """Every byte equal. After a cast, NaNs only need to stay NaN: PyTorch's own f64 -> bf16
    kernel gives a NaN 0x7FC0 in its scalar tail and 0xFFFF in its vector loop, so the bit
    pattern of a cast NaN depends on where it falls, not on its value."""
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype, name
        assert tuple(g.shape) == tuple(t.shape), name
        if cast and t.is_floating_point() and t.element_size() > 1:
            nan = torch.isnan(t)
            assert torch.equal(torch.isnan(g), nan), f"{name}: NaNs moved"
            assert torch.equal(bits(g[~nan]), bits(t[~nan])), f"{name} differs"
        else:
            assert torch.equal(bits(g), bits(t)), f"{name} differs"


def as_table(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], str, int]]:
    """Name -> (shape, safetensors dtype, bytes) of real tensors."""
    return {k: (list(v.shape), DTYPE_NAMES[v.dtype], v.numel() * v.element_size())
            for k, v in tensors.items()}


def json_table(doc: dict[str, Any]) -> dict[str, tuple[list[int], str, int]]:
    """The same table from an ``inspect --json`` document."""
    return {t["name"]: (t["shape"], t["dtype"], t["bytes"]) for t in doc["tensors"]}


class RunsCommand:
    """A pickle that runs ``command`` when loaded (hostile input: it must never run)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


def write_malicious(directory: Path, sentinel: Path) -> Path:
    """A DCP directory whose ``.metadata`` would create ``sentinel`` if it were unpickled."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {sentinel}")))
    (directory / "__0_0.distcp").write_bytes(b"\0" * 64)
    return directory


def same_inspect(url: str, local: Path) -> None:
    """``inspect --json`` of the remote checkpoint ``url`` is that of its local copy (the
    paths aside)."""
    from typer.testing import CliRunner

    from ckpttool.cli import app

    a = CliRunner().invoke(app, ["inspect", url, "--json"])
    b = CliRunner().invoke(app, ["inspect", str(local), "--json"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    da, db = json.loads(a.stdout.replace(url, str(local))), json.loads(b.stdout)
    da.pop("seconds", None), db.pop("seconds", None)
    assert da == db


def invoke(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    """``ckpttool *args`` in this process (typer's ``CliRunner``), ``env`` set for the run."""
    from typer.testing import CliRunner

    from ckpttool.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env=env)


# --- diff and apply ---------------------------------------------------------------------------

def diff_pair(tmp_path: Path) -> tuple[Path, Path]:
    """Two safetensors directories ``a`` and ``b`` under ``tmp_path`` that differ in one
    element of ``model.norm.weight``."""
    g = torch.Generator().manual_seed(3)
    a = {"model.embed_tokens.weight": torch.randn(16, 4, generator=g),
         "model.norm.weight": torch.ones(4)}
    b = {k: v.clone() for k, v in a.items()}
    b["model.norm.weight"][1] = 2.0
    for name, sd in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        save_file(sd, tmp_path / name / "model.safetensors")
    return tmp_path / "a", tmp_path / "b"


# --- faults while writing a local output (CKPTTOOL_TEST_FAULT) --------------------------------

def fault_env(fault: str | None = None) -> dict[str, str]:
    """This environment, with the test hook of :mod:`ckpttool.storage.outputs` set to
    ``fault`` (``kill:K`` / ``pause:K:FILE``) or unset."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("CKPTTOOL_TEST_FAULT", None)
    if fault is not None:
        env["CKPTTOOL_TEST_FAULT"] = fault
    return env


def fault_merge(src: Path, out: Path, *args: str, fault: str | None = None
                ) -> subprocess.CompletedProcess[str]:
    """``merge SRC OUT --dtype keep -q --weights-only *args`` run to its end (a forked CLI
    process), under ``fault``."""
    return run_cli(["merge", str(src), str(out), "--dtype", "keep", "-q", "--weights-only",
                    *args], fault_env(fault))


def start_fault_merge(src: Path, out: Path, *args: str, fault: str) -> subprocess.Popen[str]:
    """The same merge started in a fresh interpreter, left running."""
    return subprocess.Popen(
        [sys.executable, "-m", "ckpttool", "merge", str(src), str(out), "--dtype", "keep",
         "-q", "--weights-only", *args], env=fault_env(fault), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True)


def wait_for_pause(path: Path, proc: subprocess.Popen[str]) -> None:
    """Until a ``pause:K:FILE`` fault has written FILE (``path``); fails if ``proc`` ends
    first."""
    for _ in range(1200):
        if path.exists() and path.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before the pause: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.05)
    raise AssertionError("the run never reached the pause")


def _tensor_bytes(path: Path) -> dict[str, bytes]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k).tobytes() for k in f.keys()}  # noqa: SIM118


def output_state(out: Path) -> dict[str, bytes] | None:
    """The model OUT holds, if it looks finished (an index, or model.safetensors alone), after
    checking that it is consistent: an index names shards that hold exactly the tensors it
    lists, and model.safetensors never stands beside an index. None if nothing looks
    finished."""
    index = out / INDEX
    single = out / "model.safetensors"
    if index.exists():
        assert not single.exists(), "model.safetensors beside an index"
        weight_map = json.loads(index.read_text())["weight_map"]
        found: dict[str, bytes] = {}
        for shard in sorted(set(weight_map.values())):
            assert (out / shard).is_file(), f"the index names {shard}, which is missing"
            held = _tensor_bytes(out / shard)
            assert set(held) == {k for k, v in weight_map.items() if v == shard}, shard
            found |= held
        return found
    if single.exists():
        return _tensor_bytes(single)
    return None


# --- a remote output published under faults (CKPTTOOL_TEST_REMOTE_FAULT) ----------------------

# What a remote merge does once its staged output is complete; exit codes as the CLI's.
# ``python -c PUBLISH URL STAGED``.
PUBLISH = """
import sys
from pathlib import Path
from ckpttool.errors import CkptError
from ckpttool.core.runtime import urls
try:
    with urls.claimed(sys.argv[1], overwrite=True) as url:
        urls.upload(url, Path(sys.argv[2]), overwrite=True)
except CkptError as e:
    print(f"ckpttool: error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
except KeyboardInterrupt:
    sys.exit(130)
"""


def start_publish(store_env: dict[str, str], staged: Path, url: str, hook: str | None
                  ) -> ForkedCli:
    """:data:`PUBLISH` of ``staged`` to ``url`` on a store (``store_env``: its emulator's
    settings), started under the fault ``hook`` (a forked ``python -c``)."""
    env = {**os.environ, **store_env, "PYTHONPATH": str(ROOT)}
    env.pop("CKPTTOOL_TEST_REMOTE_FAULT", None)
    if hook is not None:
        env["CKPTTOOL_TEST_REMOTE_FAULT"] = hook
    return ForkedCli([url, str(staged)], env, script=PUBLISH)


def s3_publish(s3: S3, staged: Path, url: str, *, hook: str | None = None) -> ForkedCli:
    """:data:`PUBLISH` of ``staged`` to ``url`` on moto's S3, started under ``hook``."""
    return start_publish(s3.env, staged, url, hook)


def s3_contents(s3: S3, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` of the test bucket, by its name under it."""
    from tests.remote.conftest import BUCKET

    return {k[len(prefix) + 1:]: s3.client.get_object(Bucket=BUCKET, Key=k)["Body"].read()
            for k in s3.keys(BUCKET, prefix)}


def s3_put_all(s3: S3, prefix: str, files: dict[str, bytes]) -> None:
    """``prefix`` of the test bucket holds ``files`` and nothing else."""
    from tests.remote.conftest import BUCKET

    for k in s3.keys(BUCKET, prefix):
        s3.client.delete_object(Bucket=BUCKET, Key=k)
    for name, data in files.items():
        s3.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)


# --- DCP .metadata: the columnar reader against the allow-list unpickler ----------------------

def allow_list_read(md: Path) -> Any:
    """What the allow-list path makes of ``md``: a ``_Read``, or the error it raises."""
    from ckpttool.errors import InputError, UnsupportedError
    from ckpttool.formats.dcp.metadata import _read_unpickled

    try:
        return _read_unpickled(md.parent, md)
    except (InputError, UnsupportedError) as e:
        return e


def columns_agree(md: Path) -> bool:
    """The columnar reader agrees with the allow-list path on ``md``; True if it answered."""
    from ckpttool.formats.dcp import columns
    from ckpttool.formats.dcp.metadata import allowed_global

    fast = columns.read(md, allowed_global)
    if fast is None:
        return False
    slow = allow_list_read(md)
    assert not isinstance(slow, Exception), f"columnar answered where the allow-list raised {slow}"
    assert [t.name for t in fast.tensors] == [t.name for t in slow.tensors]
    for a, b in zip(fast.tensors, slow.tensors, strict=True):
        if a == b:  # chunks included: one pass over them (thousands of chunks, 150 mutants)
            continue
        assert (a.name, a.path, a.dtype, a.shape) == (b.name, b.path, b.dtype, b.shape)
        assert list(a.chunks) == list(b.chunks), a.name
        assert len(a.chunks) == len(b.chunks) and a.files == b.files
        assert a == b
    assert fast.objects == slow.objects
    assert fast.version == slow.version
    assert slow.compressed_all == frozenset() and not slow.nested.records
    return True


# --- quantized weights (issue 39): references in plain torch ----------------------------------

FP8 = torch.float8_e4m3fn
# The modes of merge that change a checkpoint's quantization, and their flags.
QUANT_MODES = {"dequantize": ("--dequantize",), "quantize": ("--quantize", "fp8-block")}


def weight_dequant(x: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek-V3's ``weight_dequant`` kernel as plain torch: every element times its
    block's scale in float32, then bf16."""
    i = torch.arange(x.shape[0])[:, None] // block
    j = torch.arange(x.shape[1])[None, :] // block
    return (x.float() * s[i, j]).to(torch.bfloat16)


def fp8_block_quant(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula of issue 39, block by block: s = amax(|w.float()|) / 448 (1.0 for a zero
    block), q = (w.float() / s) as float8_e4m3fn."""
    rows, cols = w.shape
    grid = (math.ceil(rows / block), math.ceil(cols / block))
    s = torch.empty(grid, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(grid[0]):
        for j in range(grid[1]):
            b = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            amax = b.abs().amax()
            sc = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            s[i, j] = sc
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (b / sc).to(FP8)
    return q, s


def save_quant_llama(tmp: Path, intermediate: int = 320) -> Path:
    """A bf16 Llama written by save_pretrained: 256 wide, 320 in the MLP (an edge block of
    64), one zero 128 x 128 block in layer 0's q_proj."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=intermediate,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[:128, :128] = 0
    out = tmp / f"llama-{intermediate}"
    model.save_pretrained(out)
    return out


def save_fp8_hf(llama_hf: Path, out: Path) -> Path:
    """DeepSeek-V3's layout from the bf16 Llama in ``llama_hf``, in the new directory
    ``out``: decoder Linear weights quantized by the formula, ``weight_scale_inv`` float32,
    config's quantization_config, torch_dtype bf16."""
    state = load_file(llama_hf / "model.safetensors")
    out.mkdir()
    quantized: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, s = fp8_block_quant(t)
            quantized[name], quantized[name + "_scale_inv"] = q, s
        else:
            quantized[name] = t
    # The scale of issue 34 finding 3, which bf16 would round to 0.000507355.
    quantized["model.layers.0.mlp.up_proj.weight_scale_inv"][0, 0] = 0.000509229
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((llama_hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


def check_quantized(out: Path, original: dict[str, torch.Tensor], *,
                    deduplicated: frozenset[str] = frozenset()) -> int:
    """Every decoder-layer Linear weight of ``original`` quantized bit for bit by the
    formula (and, dequantized, within float8's rounding of it), every other tensor kept
    (cast to the output's dtype as a plain merge casts), but ``deduplicated`` (a tied copy
    written once); returns how many were quantized."""
    got = load_file(out / "model.safetensors")
    num = 0
    for name, t in original.items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, s = fp8_block_quant(t)
            assert got[name].dtype == FP8 and got[name + "_scale_inv"].dtype == torch.float32
            assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(got[name + "_scale_inv"], s), name
            # Dequantized, within float8's rounding of the original: half a unit in the last
            # place of 3 mantissa bits, or of the smallest subnormal times the scale.
            back = weight_dequant(got[name], s).float()
            i = torch.arange(t.shape[0])[:, None] // 128
            j = torch.arange(t.shape[1])[None, :] // 128
            bound = t.float().abs() * 2.0 ** -4 + s[i, j] * 2.0 ** -9
            assert ((back - t.float()).abs() <= bound * 1.01 + 1e-30).all(), name
            num += 1
        elif name in deduplicated and name not in got:
            continue
        else:
            assert name in got and (name + "_scale_inv") not in got, name
            assert torch.equal(got[name], t.to(got[name].dtype)), name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert num
    return num


def same_model(got: Path, want: Path) -> None:
    """The same tensors, bit for bit, and the same config.json."""
    a, b = _all_tensors(got), _all_tensors(want)
    assert set(a) == set(b)
    for name, t in b.items():
        assert a[name].dtype == t.dtype and a[name].shape == t.shape, name
        assert torch.equal(a[name].view(torch.uint8), t.view(torch.uint8)), name
    assert json.loads((got / "config.json").read_text()) == json.loads(
        (want / "config.json").read_text())


def _all_tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# --- the output contract on multi-process writers ---------------------------------------------

def assert_taken_whole(report: Any, expected: int) -> None:
    """The merge's output was checked against transformers' Llama and taken whole."""
    c = report.contract
    assert c is not None and c.checked, c
    assert c.ok and not c.extra, c
    assert c.consumer.startswith("LlamaForCausalLM (transformers") and c.expected == expected


def small_llama() -> Any:
    """A small transformers Llama (32 wide, 2 layers, untied), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"]))


def verl_rank_files(rank: int, world_size: int, out: str) -> None:
    """verl's FSDPCheckpointManager layout: each rank's ``model.state_dict()`` (DTensors) as
    ``model_world_size_<W>_rank_<R>.pt``, the config under ``huggingface/``. A rank function
    for :func:`tests.fsdp2_ranks.run_on_ranks`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = small_llama()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    actor = Path(out)
    actor.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), actor / f"model_world_size_{world_size}_rank_{rank}.pt")
    if rank == 0:
        model.config.save_pretrained(actor / "huggingface")


# --- a training run's sweep and a resumed merge (tests.runs) ----------------------------------

# Pieces of 4 KB, so that the runs' small checkpoints have several (model.safetensors: 3).
RESUME_PIECE = "4096"


def assert_step_exact(out: Path, trained: Path, step: int) -> None:
    """``out`` holds checkpoint-``step`` of the run in ``trained``, bit for bit."""
    from tests import runs

    merged = load_file(out / "model.safetensors")
    ref = runs.reference(trained, step)
    assert merged.keys() == ref.keys()
    for name, t in ref.items():
        assert merged[name].dtype == t.dtype and torch.equal(merged[name], t), name


def cut_merge(args: list[str], kill_after: int = 2) -> subprocess.CompletedProcess[str]:
    """A real merge process that kills itself (SIGKILL) after recording ``kill_after``
    pieces."""
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "CKPTTOOL_RESUME_PIECE": RESUME_PIECE, "CKPTTOOL_TEST_RESUME_KILL": str(kill_after)}
    done = subprocess.run([sys.executable, "-m", "ckpttool", "merge", "--weights-only", *args],
                          env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    return done


def same_files(a: Path, b: Path, *, but: tuple[str, ...] = ()) -> None:
    """Directories ``a`` and ``b`` hold the same file names, and the same bytes in each but
    ``but``."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in set(names) - set(but):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def host_cli(store_env: dict[str, str], part_size: str, tmp: Path, *args: str | Path,
             **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m ckpttool ARGS`` as one host of a shared merge into a store (``store_env``:
    its emulator's settings): in a process of its own (forked with torch imported: no state
    of this one's), with a TMPDIR and cwd of its own and parts of ``part_size`` bytes."""
    from ckpttool.core.merge.multihost import FAIL_ENV

    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", FAIL_ENV)}
    full.update(store_env, PYTHONPATH=str(ROOT), TMPDIR=str(tmp / "tmp"), OMP_NUM_THREADS="1",
                CKPTTOOL_PART_SIZE=part_size, **env)
    return run_cli([str(a) for a in args], full, cwd=tmp, timeout=300)


def killed_slice_runs_again(cli: Any, listed: Any, download: Any, tmp_path: Path,
                            args: tuple[str | Path, ...], fault: dict[str, str], whole: Path,
                            *, may_finish: bool = False) -> None:
    """Slice 1 of 2 killed by ``fault`` (``may_finish``: the fault point may come after its
    last step): nothing reads as a model, --finish names the slice, and the slice run again
    completes the output, bit-exact against ``whole``. ``cli(tmp, *args, **env)`` runs a
    host, ``listed()`` gives the output's objects (staging left out), ``download(dir)``
    fetches the output."""
    r = cli(tmp_path / "a", *args, "--slice", "1/2", **fault)
    assert r.returncode == -9 or (may_finish and r.returncode == 0), r.stderr
    assert cli(tmp_path / "b", *args, "--slice", "0/2").returncode == 0
    if r.returncode == -9:
        assert listed() == []
        r = cli(tmp_path / "f", *args, "--finish")
        assert r.returncode == 3 and "--slice 1/2" in r.stderr, r.stderr
        assert listed() == []
        assert cli(tmp_path / "c", *args, "--slice", "1/2").returncode == 0
    r = cli(tmp_path / "f2", *args, "--finish")
    assert r.returncode == 0, r.stderr
    same_files(download(tmp_path / "got"), whole)
