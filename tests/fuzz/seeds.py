"""Seed checkpoints for the fuzz campaign, written by the real writers.

Every seed is a directory that ``inspect``, ``verify`` and ``merge`` (or ``reshard``) accept
whole; the mutator damages one file of a copy at a time. Seeds are small (kilobytes), so a
mutant is a cheap copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

SEEDS_DONE = ".seeds-complete-3"  # bumped when a seed is added: written again
PY311_DCP = Path(__file__).resolve().parents[1] / "data" / "py311" / "dcp"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 12, generator=g),
        "model.norm.weight": torch.ones(8, dtype=torch.float16),
        "model.ids": torch.arange(6, dtype=torch.int64),
        "lm_head.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
    }


def write_seeds(root: Path, *, deepspeed: bool = False) -> dict[str, Path]:
    """Write every seed under ``root`` (once: a marker file says they are complete) and return
    ``{name: path}``, the path each command is given."""
    root.mkdir(parents=True, exist_ok=True)
    seeds = _seed_paths(root, deepspeed=deepspeed)
    if (root / SEEDS_DONE).exists():
        return seeds
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    from examples.fsdp2_checkpoint import MODEL_DIR
    from tests import layouts

    for p in root.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
    layouts.write_kind(root / "uneven", "uneven")  # 3-rank FSDP2 DCP, zip records, CRCs
    assert seeds["dcp"] == root / "uneven" / MODEL_DIR
    layouts.write_dcp_options(root / "options")  # safetensors records, rank-local, zstd
    layouts.write_fsdp2(root / "verl", 2)  # per-rank torch.save files of DTensors
    layouts.write_hf_storage(root / "hf_storage" / "ckpt")  # HuggingFaceStorageWriter shards
    state = _state()
    for name in ("st_sharded", "bin_sharded", "st_single", "bin_single"):
        (root / name).mkdir()
    save_torch_state_dict(state, root / "st_sharded", max_shard_size=600)
    save_torch_state_dict(state, root / "bin_sharded", max_shard_size=600,
                          safe_serialization=False)
    save_file(state, str(root / "st_single" / "model.safetensors"), metadata={"format": "pt"})
    torch.save(state, root / "bin_single" / "pytorch_model.bin")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    for name in ("st_sharded", "bin_sharded", "st_single", "bin_single"):
        (root / name / "config.json").write_text(json.dumps(config))
    # DCP under Python 3.11.2 (Enum members pickled by name: builtins.getattr), committed.
    shutil.copytree(PY311_DCP, root / "py311" / "dcp")
    if deepspeed:
        from tests import ds_layouts

        ds_layouts.write_zero(root / "zero2", 2, 2)
    (root / SEEDS_DONE).touch()
    return seeds


def _seed_paths(root: Path, *, deepspeed: bool) -> dict[str, Path]:
    from examples.fsdp2_checkpoint import MODEL_DIR
    from tests.layouts import CKPT_DIR

    seeds = {
        "dcp": root / "uneven" / MODEL_DIR,
        "dcp-safetensors-records": root / "options" / "safetensors",
        "dcp-rank-local": root / "options" / "rank_local",
        "dcp-zstd": root / "options" / "zstd",
        "rank-files": root / "verl" / CKPT_DIR,
        "dcp-hf-storage": root / "hf_storage" / "ckpt",
        "safetensors-sharded": root / "st_sharded",
        "bin-sharded": root / "bin_sharded",
        "safetensors": root / "st_single",
        "torch-save": root / "bin_single",
        "dcp-py311": root / "py311" / "dcp",
    }
    if deepspeed:
        seeds["deepspeed"] = root / "zero2"
    return seeds
