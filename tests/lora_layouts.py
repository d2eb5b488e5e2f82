"""Real LoRA checkpoints: PEFT models trained one step under FSDP2 and saved with ``dcp.save``.

:func:`write_lora` ``(out)`` runs :data:`WORLD` gloo ranks that each build the same tiny
``LlamaForCausalLM``, wrap it with ``peft.get_peft_model`` for every variant in
:data:`VARIANTS`, ``fully_shard`` each decoder layer and the root, take one AdamW step on the
trainable (adapter) parameters, and save as accelerate does:

* ``out/<variant>/pytorch_model_fsdp_0``: ``dcp.save({"model": model.state_dict()})`` (PEFT
  names: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``...);
* ``out/<variant>/adapter_config.json`` (PEFT's own ``LoraConfig.save_pretrained``) and
  ``config.json`` (the base model's, ``dtype`` float32);
* ``out/<variant>/full.pt``: the gathered full state dict (rank 0), from which
  :func:`reference` builds the trained PEFT model in the test process.

Variants: ``lora`` targets every attention and MLP projection and the input embedding, with a
``rank_pattern`` and an ``alpha_pattern`` and ``modules_to_save=["lm_head"]``; ``rslora``
uses rsLoRA with ``lora_bias=True`` on biased attention projections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.fixture_cache import on_disk
from tests.layouts import _full, _run

WORLD = 2
SEED = 4321
MODEL_DIR = "pytorch_model_fsdp_0"


def _configs() -> dict[str, tuple[Any, Any]]:
    from peft import LoraConfig
    from transformers import LlamaConfig

    def llama(**kw: Any) -> Any:
        return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, tie_word_embeddings=False,
                           dtype="float32", **kw)

    return {
        "lora": (llama(), LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj", "embed_tokens"],
            rank_pattern={"o_proj": 2}, alpha_pattern={"v_proj": 24},
            modules_to_save=["lm_head"])),
        "trainer": (llama(), LoraConfig(
            r=4, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "v_proj", "down_proj"])),
        "rslora": (llama(attention_bias=True), LoraConfig(
            r=8, lora_alpha=4, lora_dropout=0.0, use_rslora=True, lora_bias=True,
            target_modules=["q_proj", "v_proj"])),
    }


VARIANTS = ("lora", "rslora")


def build(variant: str) -> Any:
    """The untrained PEFT model every rank (and the reference) starts from."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    base_config, lora_config = _configs()[variant]
    torch.manual_seed(SEED)
    base = LlamaForCausalLM(base_config).to(torch.float32)
    return get_peft_model(base, lora_config)


def build_base(variant: str) -> Any:
    """The base model alone, with the same weights as :func:`build`'s."""
    from transformers import LlamaForCausalLM

    base_config, _ = _configs()[variant]
    torch.manual_seed(SEED)
    return LlamaForCausalLM(base_config).to(torch.float32)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(training batch, reference input ids), the same everywhere."""
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(3, 96, (2, 8), generator=g), torch.randint(3, 96, (2, 8), generator=g)


def _job(rank: int, world_size: int, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for variant in VARIANTS:
        model = build(variant)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        train, _ = batch()
        model(input_ids=train, labels=train).loss.backward()
        optim.step()
        state = model.state_dict()
        target = out / variant
        dcp.save({"model": state}, checkpoint_id=target / MODEL_DIR)
        full = _full(state)
        if rank == 0:
            torch.save(full, target / "full.pt")
            model.peft_config["default"].save_pretrained(str(target))
            build_base(variant).config.save_pretrained(str(target))


@on_disk()
def write_lora(out: Path) -> Path:
    _run(_job, WORLD, out)
    return out


def reference(variant_dir: Path) -> Any:
    """The trained PEFT model (unsharded, eval mode), from the writer's full state dict."""
    model = build(variant_dir.name)
    full = torch.load(variant_dir / "full.pt", weights_only=True)
    missing, unexpected = model.load_state_dict(full, strict=True)
    assert not missing and not unexpected
    return model.eval()


# --------------------------------------------------------------------------------------------
# Trainers that write no adapter_config.json (variant "trainer": r 4, alpha 16)

TRAINER = "trainer"


def _verl_job(rank: int, world_size: int, out: Path) -> None:
    """verl's FSDP checkpoint manager with a PEFT model: each rank saves its
    ``model.state_dict()`` (DTensors, PEFT names) as ``model_world_size_<W>_rank_<R>.pt``; rank 0
    writes ``lora_train_meta.json`` ({"r", "lora_alpha", "task_type"}, verl's fields) and the
    base config under ``huggingface/``. No adapter_config.json."""
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = build(TRAINER)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train, _ = batch()
    model(input_ids=train, labels=train).loss.backward()
    optim.step()
    actor = out / "global_step_1" / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    torch.save(state, actor / f"model_world_size_{world_size}_rank_{rank}.pt")
    full = _full(state)
    if rank == 0:
        lora = model.peft_config["default"]
        (actor / "lora_train_meta.json").write_text(json.dumps(
            {"r": lora.r, "lora_alpha": lora.lora_alpha, "task_type": lora.task_type}))
        build_base(TRAINER).config.save_pretrained(str(actor / "huggingface"))
        torch.save(full, out / "full.pt")


@on_disk()
def write_verl_lora(out: Path) -> Path:
    """:func:`_verl_job` on :data:`WORLD` ranks: ``out/global_step_1/actor``, reference
    ``out/full.pt`` (the trained PEFT model's full state dict). Returns ``out``."""
    _run(_verl_job, WORLD, out)
    return out


@on_disk()
def write_accelerate_lora(out: Path) -> Path:
    """accelerate's ``save_state`` of a PEFT model after one step, in this process (CPU, no
    FSDP), with automatic checkpoint naming: ``out/checkpoints/checkpoint_0/model.safetensors``
    (PEFT names, base weights and adapter), optimizer, scheduler and RNG files; no
    adapter_config.json. Reference ``out/full.pt``. Returns ``out``."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(out), automatic_checkpoint_naming=True))
    model = build(TRAINER)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optim = accelerator.prepare(model, optim)
    train, _ = batch()
    accelerator.backward(model(input_ids=train, labels=train).loss)
    optim.step()
    accelerator.save_state()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "full.pt")
    return out


def trained(full: Path) -> Any:
    """The trained PEFT model of variant "trainer" from a writer's full state dict."""
    model = build(TRAINER)
    missing, unexpected = model.load_state_dict(torch.load(full, weights_only=True),
                                                strict=True)
    assert not missing and not unexpected
    return model.eval()
