"""Writes a run in this folder with Megatron-LM 0.19's own training code, on the CPU.

The same runs as ``generate.py`` (its command lines, CPU stand-ins, gradients and oracle are
imported from it), through the path ``pretrain_gpt.py`` takes at ``core_v0.19.0``:
``parse_and_validate_args`` (``parse_args`` + ``validate_args`` + ``set_global_variables``)
on the run's command line, ``gpt_config_from_args`` and ``pretrain_cfg_container_from_args``,
``initialize_megatron``, ``setup_model_and_optimizer`` with that config container (0.19 builds
the model from it: no model provider), one optimizer step, then
``checkpointing.save_checkpoint`` (``--ckpt-format torch_dist``). The ``args`` Megatron-LM
saves are the namespace that path made; 0.19 writes no ``common.pt``, its common state is
the DCP bytes entry ``common_state/shard_0_1``. The oracle is Megatron-LM 0.19's own
``load_checkpoint`` at TP=PP=EP=1, as in ``generate.py``.

Megatron-LM 0.19 needs Python >= 3.12 (``typing.override``) and is not a wheel: run this
with a Python 3.12 that has torch, numpy, einops, safetensors and psutil (the committed runs:
Python 3.12.1, PyPI's torch 2.13.0, its CUDA build run on the CPU), with the checkout's own
``megatron`` first on the path (``git archive core_v0.19.0 | tar -x -C /work/venvs/mlm-0.19``)::

    PYTHONPATH=/work/venvs/mlm-0.19 python3.12 tests/data/megatron_lm/generate_019.py \\
        --mlm /work/venvs/mlm-0.19 --commit 5be9626709af2722333bf54797c954c09edeada3 \\
        OUT llama-release llama-dp2-dist llama-tp2 llama-pp2 qwen3_moe-ep2 deepseek_v3-ep2 \\
        gpt_oss-ep2

It writes ``OUT/RUN-0.19``: the checkpoint, ``reference.safetensors``, ``logits.safetensors``,
``written_by.json`` and ``args.json`` (the ``args`` it saved, as JSON). ``hf_config.json`` is
``generate.py``'s for the same model: copy it from the 0.16 run of the same name
(transformers is not needed here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
TAG = "core_v0.19.0"
SUFFIX = "-0.19"


def _generate() -> Any:
    """``generate.py`` of this folder: its runs, stand-ins, gradients and oracle."""
    spec = importlib.util.spec_from_file_location("megatron_lm_generate", HERE / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, world: int, port: int, name: str, out: str, mlm: str,
          reference: bool) -> None:
    gen = _generate()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      CUDA_DEVICE_MAX_CONNECTIONS="1")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    sys.path.insert(0, mlm)
    gen._stand_ins()
    run = Path(out) / f"{name}{SUFFIX}"
    sys.argv = gen._argv(name, run, reference=reference)
    import megatron.training.initialize as init
    from megatron.core.enums import ModelType
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import get_args
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import (
        preprocess_common_state_dict,
        setup_model_and_optimizer,
    )

    assert Path(init.__file__).is_relative_to(mlm), init.__file__
    if "--multi-latent-attention" in sys.argv:  # as generate.py: 0.19's local spec is alike
        gen._mla_core_attention()
    # The dataset index helpers (a C++ build) and fused kernels: no data is read here.
    init._compile_dependencies = lambda: None
    # What pretrain_gpt.py's __main__ does, then pretrain()'s first steps.
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    initialize_megatron(allow_no_cuda=True)
    args = get_args()
    model, optimizer, scheduler = setup_model_and_optimizer(
        ModelType.encoder_or_decoder, cfg_container=full_config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    if reference:
        gen._oracle(model, run)
        return
    gen._vary_norms(model)
    for chunk in model:
        chunk.zero_grad_buffer()
    gen._grads(model)
    optimizer.step()
    scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples = args.global_batch_size
    save_checkpoint(1, model, optimizer, scheduler, 1.5e9,
                    preprocess_common_state_dict_fn=preprocess_common_state_dict)
    torch.distributed.barrier()
    if rank == 0:  # what save_checkpoint pickled as state_dict['args'], for the tests
        (run / "args.json").write_text(json.dumps(_as_json(vars(args)), indent=0,
                                                  sort_keys=True) + "\n")


def _as_json(value: Any) -> Any:
    """``args`` as JSON: an Enum member (``signal.SIGTERM``, ``InferenceCudaGraphScope``) as
    its value, a torch dtype as its name (``float32``), a tuple as a list."""
    import enum

    if isinstance(value, enum.Enum):
        return _as_json(value.value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, dict):
        return {str(k): _as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"args holds a {type(value).__name__}: {value!r}")


def _commit(mlm: str) -> str:
    """The checkout's commit when it is a git work tree, else the tag's (git archive)."""
    try:
        return subprocess.run(["git", "-C", mlm, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mlm", required=True, help="a Megatron-LM checkout of core_v0.19.0")
    parser.add_argument("--commit", default="", help="the tag's commit (a git archive has none)")
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+")
    ns = parser.parse_args()
    gen = _generate()
    ns.out.mkdir(parents=True, exist_ok=True)
    for name in ns.runs:
        world = gen.RUNS[name][1]
        for reference in (False, True):
            n = 1 if reference else world
            mp.start_processes(_rank, args=(n, gen._free_port(), name, str(ns.out), ns.mlm,
                                            reference), nprocs=n, join=True,
                               start_method="spawn")
        sys.path.insert(0, ns.mlm)
        import megatron.core

        versions = {"megatron_core": megatron.core.__version__, "megatron_lm_tag": TAG,
                    "megatron_lm_commit": ns.commit or _commit(ns.mlm),
                    "torch": torch.__version__, "python": sys.version.split()[0],
                    "family": gen.RUNS[name][0],
                    "command": " ".join(gen._argv(name, Path("RUN"), reference=False)[1:])}
        (ns.out / f"{name}{SUFFIX}" / "written_by.json").write_text(
            json.dumps(versions, indent=1) + "\n")


if __name__ == "__main__":
    main()
