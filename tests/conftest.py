"""Session fixtures: real DCP checkpoints written by ``examples/fsdp2_checkpoint.py``.

Each kind is written once per session (by 2-4 real gloo ranks calling ``dcp.save``) into
``tmp_path_factory.mktemp(kind) / "checkpoint-500"``, an accelerate-style training
checkpoint directory whose model DCP directory is ``pytorch_model_fsdp_0``.

* ``make_checkpoint(kind, world_size=None) -> Path``: the training checkpoint dir (cached
  per ``(kind, world_size)``);
* ``llama_ckpt``, ``uneven_ckpt``, ``wrappers_ckpt``, ``mixed_ckpt``, ``placements_ckpt``:
  the same for the default world size of each kind;
* ``tiny_dcp``: a small model DCP directory itself (``uneven_ckpt / "pytorch_model_fsdp_0"``,
  3 ranks, ``__0_0.distcp`` .. ``__2_0.distcp``).

Other formats' real writers (:mod:`tests.layouts`), once per session:

* ``hf_ckpt``: a DCP directory written by PyTorch's ``HuggingFaceStorageWriter`` on 2 ranks
  (per-rank safetensors shards); the reference is :func:`tests.layouts.hf_full_state`.
* ``dcp_options``: DCP directories written with each ``FileSystemWriter`` option
  (safetensors serialization, rank-local metadata, zstd) on 2 ranks, and their reference
  (:func:`tests.layouts.write_dcp_options`).

Every writer runs once per key, not once per session: :mod:`tests.fixture_cache` keeps what
it wrote under ``.cache/fixtures/`` (keyed by the writers' source and package versions) and
each session gets its own copy, in the place named above.

The reference for what a merge must produce is :func:`tests.reference.reference_state_dict`
(PyTorch's own loader), applied to ``ckpt / "pytorch_model_fsdp_0"``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

# The writers (torch, about 5 s) are imported where a fixture first runs: ``pytest -n``'s
# controller loads this file too, before it starts the workers, and runs no test.

# Property tests judge inputs, not speed: a shared or busy machine (CI's two cores, fixture
# writers running beside them) must not fail them on time.
hypothesis_settings.register_profile(
    "ckpttool", deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile("ckpttool")

# Progress goes to stderr as plain lines wherever stderr is not a terminal (issue 38), which
# a test's captured stderr is: tests that pin stderr exactly see none unless they ask for it
# (--progress, or this variable set in their own environment).
os.environ.setdefault("CKPTTOOL_PROGRESS", "none")

# Bytecode is kept (in the git-ignored __pycache__ directories) even where the environment
# says PYTHONDONTWRITEBYTECODE, as these machines' does: a run starts hundreds of interpreters
# (CLI processes, ranks, torchrun's workers), and each compiled ckpttool's modules from source
# again (0.4 s of a 0.6 s merge), as each xdist worker did with every test module it collects.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The output contract keeps what transformers builds for a config under the user's cache
# directory (core.contract_cache): a test session keeps its own, never the developer's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ckpttool-test-cache-")

MakeCheckpoint = Callable[..., Path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n`` (``make test``), run the tests marked ``slow`` first.

    A test of a minute that starts last on one worker decides when the run ends while the
    other workers sit idle; started first, the many short tests fill in around it. pytest's
    order is kept otherwise (the sort is stable), and a serial run is left as collected.
    Every worker sorts the same collection the same way, as xdist requires."""
    if hasattr(config, "workerinput"):  # an xdist worker (only workers collect under -n)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> MakeCheckpoint:
    """``make_checkpoint(kind, world_size=None) -> Path`` of the training checkpoint dir."""
    from examples.fsdp2_checkpoint import KINDS
    from tests import layouts

    cache: dict[tuple[str, int | None], Path] = {}

    def make(kind: str, world_size: int | None = None) -> Path:
        if kind not in KINDS:
            raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {KINDS}")
        key = (kind, world_size)
        if key not in cache:
            name = kind if world_size is None else f"{kind}-ws{world_size}"
            cache[key] = layouts.write_kind(tmp_path_factory.mktemp(name) / "checkpoint-500",
                                            kind, world_size)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_ckpt(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="session")
def uneven_ckpt(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("uneven")


@pytest.fixture(scope="session")
def wrappers_ckpt(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("wrappers")


@pytest.fixture(scope="session")
def mixed_ckpt(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("mixed")


@pytest.fixture(scope="session")
def placements_ckpt(make_checkpoint: MakeCheckpoint) -> Path:
    return make_checkpoint("placements")


@pytest.fixture(scope="session")
def tiny_dcp(uneven_ckpt: Path) -> Path:
    """A small multi-rank model DCP directory (not the training checkpoint around it)."""
    from examples.fsdp2_checkpoint import MODEL_DIR

    return uneven_ckpt / MODEL_DIR


@pytest.fixture(scope="session")
def hf_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HuggingFaceStorageWriter shards of :func:`tests.layouts.hf_full_state` (2 ranks)."""
    from tests import layouts

    return layouts.write_hf_storage(tmp_path_factory.mktemp("hf_storage") / "ckpt")


@pytest.fixture(scope="session")
def lora_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PEFT LoRA models trained one step under FSDP2 (2 ranks), one directory per variant of
    :data:`tests.lora_layouts.VARIANTS` (see :func:`tests.lora_layouts.write_lora`)."""
    from tests import lora_layouts

    return lora_layouts.write_lora(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="session")
def dcp_options(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dcp.save`` with FileSystemWriter's options (:func:`tests.layouts.write_dcp_options`)."""
    from tests import layouts

    return layouts.write_dcp_options(tmp_path_factory.mktemp("dcp_options"))


@pytest.fixture(scope="session")
def megatron_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Megatron-Core torch_dist runs written by megatron-core itself on 2 gloo ranks
    (:mod:`tests.megatron_layouts`), one directory per variant, each with its
    ``reference.pt`` and ``config.json``; skipped where megatron-core is not installed."""
    from tests import megatron_layouts

    if not megatron_layouts.MEGATRON:
        pytest.skip("megatron-core is not installed")
    return megatron_layouts.write_runs(tmp_path_factory.mktemp("megatron"))


# A 24 MB single-file model (its upload takes several 5 MiB parts) and merges made alone, for
# the object-store and shared-merge tests of every store.
@pytest.fixture(scope="session")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("big") / "model"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(6)},
              str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="session")
def big_alone(big_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import ckpttool

    out = tmp_path_factory.mktemp("alone") / "out"
    ckpttool.merge(big_model, out, weights_only=True)
    return out


@pytest.fixture(scope="session")
def llama_alone(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import ckpttool

    out = tmp_path_factory.mktemp("alone") / "out"
    ckpttool.merge(llama_ckpt, out, max_shard_size="20KB")
    return out


# Quantized weights (issue 39), written per module as the tests of tests/core/test_quantization*.py
# and tests/remote/test_quantized_remote.py expect.

@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 Llama by save_pretrained (:func:`tests.helpers.save_quant_llama`)."""
    from tests.helpers import save_quant_llama

    return save_quant_llama(tmp_path_factory.mktemp("q-llama"))


@pytest.fixture(scope="module")
def fp8_hf(llama_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3's block-FP8 layout of ``llama_hf`` (:func:`tests.helpers.save_fp8_hf`)."""
    from tests.helpers import save_fp8_hf

    return save_fp8_hf(llama_hf, tmp_path_factory.mktemp("q-fp8") / "fp8")


@pytest.fixture(scope="module")
def fp8_dcp(fp8_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same block-FP8 model saved by ``torch.distributed.checkpoint.save`` (one
    process), config.json beside it."""
    import torch.distributed.checkpoint as torch_dcp
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("q-fp8-dcp") / "checkpoint"
    torch_dcp.save({"model": load_file(fp8_hf / "model.safetensors")}, checkpoint_id=out)
    return out
