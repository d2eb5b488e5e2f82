"""Finding what the user pointed at: the model checkpoint inside a training directory, and the
Hugging Face files (config, tokenizer) that belong beside the merged weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError
from ckpttool.formats import dcp, hf_dcp, rank_files

# Files a Hugging Face model directory carries besides its weights.
HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)

_OPTIMIZER_ROOTS = frozenset({"optimizer", "optim", "state", "param_groups"})


@dataclass(frozen=True)
class Located:
    dcp_dir: Path
    info: dcp.DcpInfo
    skipped: tuple[tuple[Path, str], ...]  # other checkpoints seen there, and what they are


def kind_of(info: dcp.DcpInfo) -> str:
    """``"optimizer"`` when every entry sits under optimizer state keys, else ``"model"``."""
    paths = [t.path for t in info.tensors] + [o.path for o in info.objects]
    if paths and all(p[0] in _OPTIMIZER_ROOTS for p in paths):
        return "optimizer"
    return "model"


def checkpoint_at(path: Path) -> dcp.DcpInfo | None:
    """The DCP checkpoint in directory ``path`` (FileSystemWriter's ``.metadata`` layout,
    HuggingFaceStorageWriter's safetensors shards, or per-rank ``torch.save`` files of DTensor
    state dicts), or None if it holds none of them."""
    if dcp.is_dcp_dir(path):
        return dcp.read_info(path)
    if hf_dcp.is_hf_dcp_dir(path):
        return hf_dcp.read_info(path)
    if rank_files.is_rank_files_dir(path):
        return rank_files.read_info(path)
    return None


def locate_model(src: Path) -> Located:
    """The model DCP checkpoint at ``src``, or the single one directly inside it.

    Raises:
        InputError: ``src`` is missing, holds no model checkpoint, or holds several.
    """
    if not src.exists():
        raise InputError(f"{src}: no such file or directory")
    if not src.is_dir():
        raise InputError(f"{src}: is a file; pass the DCP checkpoint directory (the one holding "
                         ".metadata and *.distcp files)")
    info = checkpoint_at(src)
    if info is not None:
        return Located(src, info, ())
    if (src / dcp.METADATA_FILE).exists():
        dcp.read_info(src)  # raises the precise reason the .metadata is unreadable
    if any(src.glob("*" + dcp.DATA_SUFFIX)):
        raise InputError(
            f"{src}: has .distcp data files but no {dcp.METADATA_FILE}; the copy is incomplete "
            "(copy .metadata too)"
        )
    models: list[tuple[Path, dcp.DcpInfo]] = []
    others: list[tuple[Path, str]] = []
    for sub in sorted(p for p in src.iterdir() if p.is_dir()):
        info = checkpoint_at(sub)
        if info is None:
            continue
        if kind_of(info) == "model":
            models.append((sub, info))
        else:
            others.append((sub, "optimizer"))
    if len(models) == 1:
        sub, info = models[0]
        return Located(sub, info, tuple(others))
    if len(models) > 1:
        names = ", ".join(p.name for p, _ in models)
        raise InputError(
            f"{src}: holds {len(models)} model checkpoints ({names}); pass one of them, "
            f"e.g. ckpttool merge {models[0][0]} OUT"
        )
    if others:
        raise InputError(
            f"{src}: holds only optimizer state ({', '.join(p.name for p, _ in others)}), "
            f"no model checkpoint; to merge the optimizer state, pass its directory: "
            f"ckpttool merge {others[0][0]} OUT"
        )
    raise InputError(
        f"{src}: not a DCP checkpoint (no {dcp.METADATA_FILE} here or in a subdirectory); pass "
        "the directory that training saved, e.g. checkpoint-500/pytorch_model_fsdp_0"
    )


@dataclass(frozen=True)
class HfFiles:
    config: dict[str, Any] | None
    config_path: Path | None
    files: tuple[Path, ...]  # files to copy beside the weights


def find_hf_files(dcp_dir: Path, config: Path | None = None) -> HfFiles:
    """Config and tokenizer files beside the checkpoint (or in ``config``'s directory).

    Raises:
        InputError: ``config`` was given but is missing or not valid JSON.
    """
    if config is not None:
        if config.is_dir():
            config = config / "config.json"
        if not config.is_file():
            raise InputError(f"{config}: no such config file (--config)")
        dirs = [config.parent]
    else:
        # verl keeps the Hugging Face files in a huggingface/ directory beside the rank files.
        dirs = [dcp_dir, dcp_dir / "huggingface", dcp_dir.parent, dcp_dir.parent / "huggingface"]
    config_path = config or next((d / "config.json" for d in dirs if (d / "config.json").is_file()),
                                 None)
    parsed: dict[str, Any] | None = None
    if config_path is not None:
        try:
            parsed = json.loads(config_path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError(
                f"{config_path}: not valid JSON ({e}); fix it or pass --config") from None
        if not isinstance(parsed, dict):
            raise InputError(f"{config_path}: not a JSON object; fix it or pass --config")
        dirs = [config_path.parent] + [d for d in dirs if d != config_path.parent]
    files: list[Path] = []
    for name in HF_FILES:
        found = next((d / name for d in dirs if (d / name).is_file()), None)
        if found is not None:
            files.append(found)
    return HfFiles(parsed, config_path, tuple(files))


def ties_word_embeddings(config: dict[str, Any] | None) -> bool | None:
    """What the config says about tied embeddings; None without a config."""
    if config is None:
        return None
    value = config.get("tie_word_embeddings")
    if value is None:
        text = config.get("text_config")
        if isinstance(text, dict):
            value = text.get("tie_word_embeddings")
    return bool(value)


def strip_fsdp_prefix(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Remove the ``FSDP`` class prefix that FSDP wrapping leaks into ``architectures``."""
    arch = config.get("architectures")
    if not isinstance(arch, list):
        return config, []
    fixed = [a[4:] if isinstance(a, str) and a.startswith("FSDP") and len(a) > 4 else a
             for a in arch]
    changed = [f"{a} -> {b}" for a, b in zip(arch, fixed, strict=True) if a != b]
    return ({**config, "architectures": fixed} if changed else config), changed
