"""reshard, checked against the real writers and loaders: ``dcp.save`` for the inputs,
``dcp.load`` into ``fully_shard`` models on M gloo ranks, PyTorch's own DCP loader and
transformers for the outputs, bit for bit."""

from __future__ import annotations

import json
import math
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckpttool
from ckpttool.core.checkpoint.geometry import coverage_problem
from ckpttool.core.reshard import plan_chunks, reshard
from ckpttool.errors import InputError, OutputError
from ckpttool.formats.dcp import reader as dcp
from examples.fsdp2_checkpoint import MODEL_DIR, OPTIMIZER_DIR
from tests.fsdp2_ranks import run_on_ranks
from tests.helpers import assert_bit_exact, load_out
from tests.reference import reference_state_dict

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool, torch.float8_e4m3fn)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaNs, -0.0 and float8 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensors(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype, name
        assert tuple(g.shape) == tuple(t.shape), name
        assert torch.equal(bits(g), bits(t)), f"{name} differs"


def assert_same_entries(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Tensors bit for bit, non-tensor entries (step, param_groups, ...) equal."""
    assert sorted(got) == sorted(want)
    assert_same_tensors({k: v for k, v in got.items() if isinstance(v, torch.Tensor)},
                        {k: v for k, v in want.items() if isinstance(v, torch.Tensor)})
    assert {k: v for k, v in got.items() if not isinstance(v, torch.Tensor)} == \
        {k: v for k, v in want.items() if not isinstance(v, torch.Tensor)}


def data_files(dcp_dir: Path) -> list[str]:
    return sorted(p.name for p in dcp_dir.iterdir())


def rank_files(num_ranks: int) -> list[str]:
    return sorted([".metadata", *(f"__{r}_0.distcp" for r in range(num_ranks))])


def nonempty_chunks(dcp_dir: Path) -> dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Per tensor, the (offsets, sizes) of its chunks holding data, from torch's metadata."""
    md = FileSystemReader(dcp_dir).read_metadata()
    return {k: {(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks if math.prod(c.sizes)}
            for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


# --------------------------------------------------------------------------------------
# 1. properties: plan_chunks tiles like FSDP2; reshard then merge round-trips exactly


shapes = st.integers(0, 3).flatmap(lambda n: st.lists(st.integers(0, 6), min_size=n, max_size=n))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(shapes, st.sampled_from([1, 2, 4, 8]), st.booleans()), max_size=6),
       st.integers(1, 8))
def test_plan_chunks_tiles_every_tensor_as_fsdp2_splits_it(specs, num_ranks: int) -> None:
    plans = plan_chunks([(tuple(s), item, whole) for s, item, whole in specs], num_ranks)
    assert len(plans) == len(specs)
    for (shape, _, whole), chunks in zip(specs, plans, strict=True):
        shape = tuple(shape)
        assert coverage_problem(shape, [(c.offsets, c.sizes) for c in chunks]) is None
        assert all(0 <= c.rank < num_ranks for c in chunks)
        assert len({c.rank for c in chunks}) == len(chunks)  # one chunk per rank at most
        for c in chunks:  # element ranges in the C-ordered full tensor
            assert c.start == sum(o * s for o, s in zip(c.offsets, _strides(shape), strict=True))
            assert c.stop - c.start == math.prod(c.sizes)
        if whole or not shape or shape[0] == 0:
            assert [(c.offsets, c.sizes) for c in chunks] == [((0,) * len(shape), shape)]
            continue
        pieces = torch.chunk(torch.empty(shape), num_ranks, dim=0)
        want, first = [], 0
        for i, p in enumerate(pieces):
            want.append((i, (first,) + (0,) * (len(shape) - 1), tuple(p.shape)))
            first += p.shape[0]
        assert [(c.rank, c.offsets, c.sizes) for c in chunks] == want


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


@st.composite
def random_tensor(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(shapes))
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:  # a bool byte other than 0 or 1 is not a valid bool
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        n = numel * torch.empty((), dtype=dtype).element_size()
        raw = draw(st.binary(min_size=n, max_size=n))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


@st.composite
def state_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.from_regex(r"[a-z]{1,3}(\.[a-z0-9]{1,3}){0,2}", fullmatch=True),
                          min_size=1, max_size=6, unique=True))
    return {n: draw(random_tensor()) for n in names}


@settings(max_examples=25, deadline=None)
@given(state_dicts(), st.booleans(), st.integers(1, 5))
def test_reshard_then_merge_round_trips_bit_for_bit(tensors: dict[str, torch.Tensor],
                                                    nested: bool, num_ranks: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, out, merged = Path(tmp, "src"), Path(tmp, "out"), Path(tmp, "merged")
        with warnings.catch_warnings():
            # "torch.distributed is disabled ... assuming ... a single process": intended.
            warnings.simplefilter("ignore", UserWarning)
            torch_dcp.save({"model": tensors} if nested else dict(tensors), checkpoint_id=src)
        report = reshard(src, out, ranks=num_ranks)
        assert report.ranks == num_ranks and report.num_tensors == len(tensors)
        assert report.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
        assert set(data_files(out)) <= set(rank_files(num_ranks))

        prefix = "model." if nested else ""
        assert_same_tensors(reference_state_dict(out),
                            {prefix + k: t for k, t in tensors.items()})
        ckpttool.merge(out, merged, dtype="keep", weights_only=True)
        assert_same_tensors(load_out(merged), tensors)


# --------------------------------------------------------------------------------------
# DCP -> DCP on every real fixture, read back by PyTorch's loader


@pytest.mark.parametrize("kind", ["uneven", "mixed", "placements", "wrappers"])
@pytest.mark.parametrize("num_ranks", [1, 3, 5])
def test_every_fixture_reshards_to_m_ranks_as_pytorch_reads_it(
    kind: str, num_ranks: int, make_checkpoint, tmp_path: Path
) -> None:
    """Split sources (Shard(0), Shard(1), empty shards, 12 dtypes, non-tensor entries)."""
    src = make_checkpoint(kind) / MODEL_DIR
    report = reshard(src, tmp_path / "out", ranks=num_ranks)
    assert report.format_in == report.format_out == "dcp"
    assert data_files(tmp_path / "out") == rank_files(num_ranks)
    assert_same_entries(reference_state_dict(tmp_path / "out"), reference_state_dict(src))


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["uneven", "mixed", "placements"]),
       chain=st.lists(st.integers(1, 6), min_size=2, max_size=3))
def test_resharding_again_and_again_reads_back_the_same(kind: str, chain: list[int],
                                                        make_checkpoint) -> None:
    """Resharded outputs are split sources too: every hop re-cuts chunks written by the last."""
    src = make_checkpoint(kind) / MODEL_DIR
    with tempfile.TemporaryDirectory() as tmp:
        at = src
        for hop, num_ranks in enumerate(chain):
            reshard(at, Path(tmp, str(hop)), ranks=num_ranks)
            at = Path(tmp, str(hop))
        assert_same_entries(reference_state_dict(at), reference_state_dict(src))


# --------------------------------------------------------------------------------------
# 2. an FSDP2 checkpoint of 4 ranks loads into fully_shard models on 3 and 2 ranks


def _load_uneven(rank: int, world_size: int, ckpt: str, resave: str) -> Any:
    """On each rank: a fresh ``fully_shard`` model, the checkpoint loaded as accelerate nests
    it, full weights gathered; and that model saved again by FSDP2 itself, for its layout."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from examples.fsdp2_checkpoint import build_uneven

    model = build_uneven(world_size)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(float("nan"))  # a weight the load missed cannot pass
    state = get_model_state_dict(model)
    torch_dcp.load({"model": state}, checkpoint_id=ckpt)
    set_model_state_dict(model, state)
    full = {k: _full(v) for k, v in model.state_dict().items()}
    torch_dcp.save({"model": model.state_dict()}, checkpoint_id=resave)
    return full if rank == 0 else None


@pytest.fixture(scope="module")
def uneven4(make_checkpoint) -> Path:
    return make_checkpoint("uneven", world_size=4) / MODEL_DIR


@pytest.mark.parametrize("num_ranks", [3, 2])
def test_fsdp2_checkpoint_of_4_ranks_loads_into_fully_shard_on_fewer(
    uneven4: Path, num_ranks: int, tmp_path: Path
) -> None:
    out = tmp_path / "resharded"
    report = reshard(uneven4, out, ranks=num_ranks)
    assert data_files(out) == rank_files(num_ranks)
    assert sorted(f.name for f in report.files) == rank_files(num_ranks)

    full = run_on_ranks(_load_uneven, num_ranks, str(out), str(tmp_path / "fsdp2"))[0]
    want = reference_state_dict(uneven4)
    assert_same_tensors({f"model.{k}": v for k, v in full.items()}, want)
    # Laid out as FSDP2 on num_ranks saves it (empty shards aside).
    assert nonempty_chunks(out) == nonempty_chunks(tmp_path / "fsdp2")


# --------------------------------------------------------------------------------------
# 3. resume: merged weights resharded back to DCP train on as the original checkpoint does


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    # A copy: on one rank full_tensor() can hand back the parameter's own storage.
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def _fsdp2_llama(config_dir: str, world_size: int) -> Any:
    """The tiny Llama of the checkpoint's config.json under FSDP2, as the writer shards it,
    every weight NaN until loaded (a weight a load misses cannot pass)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, LlamaForCausalLM

    # config.json names FSDPLlamaForCausalLM (accelerate's class name leaks into it): take the
    # config, build the plain class.
    model = LlamaForCausalLM(AutoConfig.from_pretrained(config_dir)).to(torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(float("nan"))
    return model


def _accelerate_fsdp2() -> tuple[Any, Any]:
    """accelerate's FSDP2 plugin and an Accelerator, for its own load_fsdp_* functions (what
    Accelerator.load_state calls). On CPU accelerate runs MULTI_CPU, not its FSDP mode (that
    wants an accelerator device), so models are sharded by hand and the plugin is handed over
    directly; of the Accelerator the loaders only use wait_for_everyone()."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    return plugin, Accelerator(cpu=True)


def _llama_resume(rank: int, world_size: int, config_dir: str,
                  loads: list[tuple[str, str, str | None, str]]) -> Any:
    """For each (label, model DCP dir, optimizer DCP dir or None, loader): the tiny Llama
    under FSDP2 on ``world_size`` ranks, loaded from there (``loader``: ``dcp`` or
    ``accelerate``); its full weights, its logits on ``reference.pt``'s input, the loss on a
    fixed batch, then one AdamW step (the saved optimizer state, else a fresh one) and the
    loss and full weights after it."""
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    reference = torch.load(Path(config_dir) / "reference.pt")
    g = torch.Generator().manual_seed(7)
    batch = torch.randint(3, 128, (2, 8), generator=g)
    results = {}
    for label, model_dir, optim_dir, loader in loads:
        model = _fsdp2_llama(config_dir, world_size)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        if loader == "accelerate":
            plugin, accelerator = _accelerate_fsdp2()
            # Both take the training checkpoint directory and add their own directory names.
            load_fsdp_model(plugin, accelerator, model, str(Path(model_dir).parent))
            if optim_dir is not None:
                load_fsdp_optimizer(plugin, accelerator, optim, model, str(Path(optim_dir).parent))
        else:
            state = get_model_state_dict(model)
            torch_dcp.load({"model": state}, checkpoint_id=model_dir)
            set_model_state_dict(model, state)
            if optim_dir is not None:
                optim_state = get_optimizer_state_dict(model, optim)
                torch_dcp.load({"optimizer": optim_state}, checkpoint_id=optim_dir)
                set_optimizer_state_dict(model, optim, optim_state)
        full = {k: _full(v) for k, v in model.state_dict().items()}
        optim_full = None
        if optim_dir is not None:  # keyed as PyTorch's loader reads optimizer_0
            optim_state = get_optimizer_state_dict(model, optim)
            optim_full = {f"optimizer.state.{fqn}.{k}": _full(v)
                          for fqn, entries in optim_state["state"].items()
                          for k, v in entries.items()}
            optim_full.update({f"optimizer.param_groups.{i}.{k}": v
                               for i, group in enumerate(optim_state["param_groups"])
                               for k, v in group.items()})
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=reference["input_ids"]).logits
        model.train()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            next_loss = model(input_ids=batch, labels=batch).loss
        after = {k: _full(v) for k, v in model.state_dict().items()}
        results[label] = {"weights": full, "optimizer": optim_full, "logits": logits,
                          "loss": loss.detach(), "next_loss": next_loss, "after": after}
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def llama_merged(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama-merged") / "merged"
    ckpttool.merge(llama_ckpt, out, dtype="keep", keep_tied=True)  # fp32: nothing lost
    return out


@pytest.fixture(scope="module")
def resumed(llama_ckpt: Path, llama_merged: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("llama-resharded")
    # Into training checkpoint directories, as accelerate lays them out.
    one, two = root / "one" / MODEL_DIR, root / "two" / MODEL_DIR
    report_one = reshard(llama_merged, one, to="dcp", prefix="model")
    report_two = reshard(llama_merged, two, to="dcp", prefix="model", ranks=2)
    assert report_one.format_in == "safetensors" and report_one.ranks == 1
    assert report_two.ranks == 2
    assert data_files(one) == rank_files(1)
    assert data_files(two) == rank_files(2)
    loads = [("original", str(llama_ckpt / MODEL_DIR), None, "dcp"),
             ("one", str(one), None, "dcp"),
             ("two", str(two), None, "accelerate"),
             # For resumed_on below: the original with its optimizer state, on its 2 ranks.
             ("original+optimizer", str(llama_ckpt / MODEL_DIR),
              str(llama_ckpt / OPTIMIZER_DIR), "dcp")]
    return {"dirs": {"one": one, "two": two},
            "runs": run_on_ranks(_llama_resume, 2, str(llama_ckpt), loads)[0]}


def test_merged_and_resharded_back_keeps_the_weights(llama_ckpt: Path,
                                                     resumed: dict[str, Any]) -> None:
    want = {k.removeprefix("model."): v
            for k, v in reference_state_dict(llama_ckpt / MODEL_DIR).items()}
    for label in ("original", "one", "two"):
        assert_same_tensors(resumed["runs"][label]["weights"], want)
    for label in ("one", "two"):  # PyTorch's loader reads the same keys as the original has
        assert_same_tensors(reference_state_dict(resumed["dirs"][label]),
                            reference_state_dict(llama_ckpt / MODEL_DIR))


def test_merged_and_resharded_back_trains_on_with_the_same_loss(llama_ckpt: Path,
                                                                resumed: dict[str, Any]) -> None:
    runs = resumed["runs"]
    reference = torch.load(llama_ckpt / "reference.pt")
    for label in ("original", "one", "two"):
        assert torch.equal(runs[label]["logits"], reference["logits"]), label
    for key in ("loss", "next_loss"):
        assert torch.isfinite(runs["original"][key])
        assert bits(runs["one"][key]).tolist() == bits(runs["original"][key]).tolist()
        assert bits(runs["two"][key]).tolist() == bits(runs["original"][key]).tolist()


def test_full_weights_to_m_ranks_are_laid_out_as_fsdp2_saves_them(
    llama_ckpt: Path, llama_merged: Path, tmp_path: Path
) -> None:
    reshard(llama_merged, tmp_path / "out", to="dcp", prefix="model", ranks=2)
    # The original checkpoint is FSDP2's own save of this model on 2 ranks.
    assert nonempty_chunks(tmp_path / "out") == nonempty_chunks(llama_ckpt / MODEL_DIR)


def test_merged_and_resharded_back_keeps_the_weights_after_a_step(
        resumed: dict[str, Any]) -> None:
    runs = resumed["runs"]
    for label in ("one", "two"):
        assert_same_tensors(runs[label]["after"], runs["original"]["after"])


# A training checkpoint (model and optimizer, 2 ranks) resharded DCP -> DCP to 1 and 3 ranks:
# training goes on from it as it does from the original on 2.


@pytest.fixture(scope="module")
def resumed_on(llama_ckpt: Path, resumed: dict[str, Any],
               tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    root = tmp_path_factory.mktemp("llama-train-resharded")
    runs = {2: resumed["runs"]["original+optimizer"]}
    for num_ranks, loader in ((1, "dcp"), (3, "accelerate")):
        ckpt = root / f"ranks{num_ranks}"
        for name in (MODEL_DIR, OPTIMIZER_DIR):
            reshard(llama_ckpt / name, ckpt / name, ranks=num_ranks)
            assert data_files(ckpt / name) == rank_files(num_ranks)
        runs[num_ranks] = run_on_ranks(_llama_resume, num_ranks, str(llama_ckpt), [
            ("run", str(ckpt / MODEL_DIR), str(ckpt / OPTIMIZER_DIR), loader)])[0]["run"]
    return runs


def test_training_checkpoint_resharded_to_1_and_3_ranks_trains_on(llama_ckpt: Path,
                                                                   resumed_on) -> None:
    weights = {k.removeprefix("model."): v
               for k, v in reference_state_dict(llama_ckpt / MODEL_DIR).items()}
    optimizer = reference_state_dict(llama_ckpt / OPTIMIZER_DIR)
    for n in (1, 2, 3):
        run = resumed_on[n]
        assert_same_tensors(run["weights"], weights)
        assert_same_entries(run["optimizer"], optimizer)
        assert bits(run["loss"]).tolist() == bits(resumed_on[2]["loss"]).tolist()
    # One rank sums the same gradients as two (each rank sees the whole batch: g + g halves
    # exactly), so the step is bit for bit the original's.
    assert_same_tensors(resumed_on[1]["after"], resumed_on[2]["after"])
    assert bits(resumed_on[1]["next_loss"]).tolist() == bits(resumed_on[2]["next_loss"]).tolist()
    # Three ranks average three copies of each gradient: the last bit may move.
    for k, v in resumed_on[3]["after"].items():
        torch.testing.assert_close(v, resumed_on[2]["after"][k], rtol=0, atol=1e-7)
    torch.testing.assert_close(resumed_on[3]["next_loss"], resumed_on[2]["next_loss"])


# --------------------------------------------------------------------------------------
# 4. safetensors re-split, byte for byte


@pytest.fixture(scope="module")
def llama_sharded(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama-sharded") / "merged"
    ckpttool.merge(llama_ckpt, out, dtype="keep", max_shard_size="20KB")
    return out


def _check_index(out: Path, limit: int) -> None:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(set(weight_map.values())) == shards
    total = 0
    for name in shards:
        with safe_open(out / name, "pt") as f:
            keys = set(f.keys())
            sizes = [t.numel() * t.element_size() for t in map(f.get_tensor, keys)]
        assert keys == {k for k, v in weight_map.items() if v == name}
        assert sum(sizes) <= limit or len(sizes) == 1
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total


@pytest.mark.parametrize("max_shard_size", ["5GB", "50KB", "8KB"])
def test_safetensors_resplit_is_byte_identical_and_loads(
    llama_ckpt: Path, llama_sharded: Path, max_shard_size: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    assert (llama_sharded / "model.safetensors.index.json").exists()
    out = tmp_path / "out"
    report = reshard(llama_sharded, out, to="safetensors", max_shard_size=max_shard_size)
    assert report.format_in == report.format_out == "safetensors"
    before = load_out(llama_sharded)
    assert_same_tensors(load_out(out), before)
    assert report.num_tensors == len(before)
    assert {"config.json", "generation_config.json"} <= set(data_files(out))
    if max_shard_size == "5GB":
        assert [f for f in data_files(out) if f.endswith(".safetensors")] == ["model.safetensors"]
    else:
        limit = {"50KB": 50_000, "8KB": 8_000}[max_shard_size]
        _check_index(out, limit)
        num_shards = len(list(out.glob("*.safetensors")))
        assert num_shards != len(list(llama_sharded.glob("*.safetensors")))

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = torch.load(llama_ckpt / "reference.pt")
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    assert torch.equal(logits, reference["logits"])


def test_safetensors_resplit_of_a_model_directory_is_a_model_directory(
    llama_sharded: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    reshard(llama_sharded, tmp_path / "out", to="safetensors")
    for name in ("config.json", "generation_config.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        assert (tmp_path / "out" / name).read_bytes() == (llama_sharded / name).read_bytes()
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


# --------------------------------------------------------------------------------------
# 5. errors, through the library


def test_dcp_to_dcp_needs_ranks(tiny_dcp: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--ranks") as e:
        reshard(tiny_dcp, tmp_path / "out")
    assert str(e.value) == ("DCP to DCP needs --ranks M (the number of ranks to lay the "
                            "checkpoint out for)")
    with pytest.raises(InputError, match="--ranks must be at least 1, got -1"):
        reshard(tiny_dcp, tmp_path / "out", ranks=-1)


def test_zero_ranks_is_an_input_error(tiny_dcp: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--ranks must be at least 1, got 0"):
        reshard(tiny_dcp, tmp_path / "out", ranks=0)


def test_existing_output_needs_overwrite_which_removes_stale_rank_files(
    uneven4: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    reshard(uneven4, out, ranks=5)
    assert data_files(out) == rank_files(5)
    with pytest.raises(OutputError) as e:
        reshard(uneven4, out, ranks=2)
    assert str(e.value).startswith(f"{out}: ")
    assert "already holds a DCP checkpoint" in str(e.value)
    assert "--overwrite" in str(e.value)
    assert data_files(out) == rank_files(5)  # untouched

    reshard(uneven4, out, ranks=2, overwrite=True)
    assert data_files(out) == rank_files(2)
    assert_same_tensors(reference_state_dict(out), reference_state_dict(uneven4))


def test_other_misuse_is_an_input_error(tiny_dcp: Path, llama_sharded: Path,
                                        tmp_path: Path) -> None:
    with pytest.raises(InputError, match="ckpttool merge"):
        reshard(tiny_dcp, tmp_path / "a", to="safetensors")
    with pytest.raises(InputError, match="--prefix"):
        reshard(tiny_dcp, tmp_path / "b", ranks=2, prefix="model")
    with pytest.raises(InputError, match="unknown --to 'gguf'"):
        reshard(tiny_dcp, tmp_path / "c", to="gguf")
    with pytest.raises(InputError, match="no such file or directory"):
        reshard(tmp_path / "missing", tmp_path / "d", ranks=2)
    reshard(llama_sharded, tmp_path / "e", to="safetensors")
    with pytest.raises(OutputError, match="already holds model.safetensors"):
        reshard(llama_sharded, tmp_path / "e", to="safetensors")


def test_torch_save_full_weights_to_dcp_round_trip(tmp_path: Path) -> None:
    """A weights-only torch.save state dict -> DCP on 3 ranks (split on dim 0) -> merge."""
    g = torch.Generator().manual_seed(3)
    state = {"embed.weight": torch.randn(7, 4, generator=g),
             "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
             "ids": torch.arange(5), "scale": torch.tensor(2.5)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    report = reshard(tmp_path / "pytorch_model.bin", tmp_path / "dcp", ranks=3, prefix="model")
    assert report.format_in == "torch-save" and report.ranks == 3
    loaded = reference_state_dict(tmp_path / "dcp")
    assert set(loaded) == {f"model.{k}" for k in state}
    info = dcp.read_info(tmp_path / "dcp")
    assert len(info.tensor("model.embed.weight").chunks) == 3  # 3, 3, 1 rows
    ckpttool.merge(tmp_path / "dcp", tmp_path / "merged", dtype="keep", weights_only=True)
    assert_bit_exact(load_out(tmp_path / "merged"), state)


def test_resplit_overwrite_from_shards_to_one_file_leaves_no_stale_index(
        llama_sharded: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    reshard(llama_sharded, out, to="safetensors", max_shard_size="8KB")
    assert (out / "model.safetensors.index.json").exists()
    reshard(llama_sharded, out, to="safetensors", overwrite=True)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_resplit_refuses_a_directory_at_an_output_name(llama_sharded: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "model.safetensors").mkdir(parents=True)
    with pytest.raises(OutputError, match="is not a regular file"):
        reshard(llama_sharded, out, to="safetensors", overwrite=True)
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
