"""Write the torchtune fixtures beside this file (run once, by hand; the output is committed).

torchtune 0.6.1 needs torchao 0.11, which the test environment does not carry, so this runs
in a venv of its own that sees the test environment's packages (torch, transformers):

    python -m venv /work/venvs/torchtune
    cd /work/venvs/torchtune/lib/python3.11/site-packages
    echo <main venv>/lib/python3.11/site-packages > shared.pth
    /work/venvs/torchtune/bin/pip install --no-deps torchtune==0.6.1 torchao==0.11.0 \\
        omegaconf tiktoken sentencepiece blobfile kagglehub
    /work/venvs/torchtune/bin/python tests/data/torchtune/generate.py

For each family (``llama``: torchtune's ``llama3`` builder, interleaved RoPE, untied;
``qwen2``: its ``qwen2`` builder, q/k/v biases, tied embeddings), a tiny seeded model in bf16
is saved by torchtune's own ``FullModelTorchTuneCheckpointer`` (``<family>/epoch_0/
model-00001-of-00001.bin``, torchtune's names), beside ``<family>/hf/config.json`` (the
transformers config of the same model) and ``<family>/reference.safetensors``: what
torchtune's own converter (``convert_weights.tune_to_hf``, ``qwen2_tune_to_hf``) makes of
the state dict, the reference ``ckpttool merge --names torchtune-<family>`` must equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).parent
VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN, MAX_SEQ = 64, 32, 2, 4, 2, 48, 64


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(1234)
    if family == "llama":
        from torchtune.models.llama3._component_builders import llama3

        model = llama3(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS,
                       num_kv_heads=KV_HEADS, embed_dim=DIM, max_seq_len=MAX_SEQ,
                       intermediate_dim=FFN)
    else:
        from torchtune.models.qwen2._component_builders import qwen2

        model = qwen2(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS,
                      num_kv_heads=KV_HEADS, embed_dim=DIM, intermediate_dim=FFN,
                      max_seq_len=MAX_SEQ, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(1235)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases not all ones or zeros
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.to(torch.bfloat16)


def _hf_config(family: str) -> dict[str, object]:
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  intermediate_size=FFN, max_position_embeddings=MAX_SEQ, dtype="bfloat16")
    if family == "llama":
        config = LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        config.architectures = ["LlamaForCausalLM"]
    else:
        config = Qwen2Config(**common, rms_norm_eps=1e-5, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default",
                                              "rope_theta": 1000000.0})
        config.architectures = ["Qwen2ForCausalLM"]
    return dict(config.to_dict())


def _to_hf(family: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if family == "llama":
        from torchtune.models.convert_weights import tune_to_hf

        return tune_to_hf(state, num_heads=HEADS, num_kv_heads=KV_HEADS, dim=DIM)
    from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

    return qwen2_tune_to_hf(state, num_heads=HEADS, num_kv_heads=KV_HEADS, dim=DIM,
                            tie_word_embeddings=True)


def write(family: str) -> None:
    from torchtune.training.checkpointing import FullModelTorchTuneCheckpointer

    out = HERE / family
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    state = {k: v.clone() for k, v in _model(family).state_dict().items()}
    # The checkpointer loads a checkpoint first (the model a run starts from).
    start = out / "start"
    start.mkdir()
    torch.save(state, start / "model.pt")
    checkpointer = FullModelTorchTuneCheckpointer(
        checkpoint_dir=str(start), checkpoint_files=["model.pt"],
        model_type="LLAMA3" if family == "llama" else "QWEN2", output_dir=str(out))
    checkpointer.save_checkpoint({"model": state}, epoch=0)
    shutil.rmtree(start)
    for extra in out.iterdir():  # keep only the model file torchtune wrote
        if extra.name != "epoch_0":
            shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text(json.dumps(_hf_config(family), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in _to_hf(family, state).items()},
              out / "reference.safetensors")


if __name__ == "__main__":
    for name in ("llama", "qwen2"):
        write(name)
    for p in sorted(HERE.rglob("*")):
        if p.is_file():
            print(p.relative_to(HERE), p.stat().st_size)
