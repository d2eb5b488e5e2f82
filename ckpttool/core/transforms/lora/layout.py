"""A LoRA adapter's layout: its tensors by name (PEFT's naming, or an adapter file's),
its ``adapter_config.json``, and where real trainers record the adapter when they write none."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.core.checkpoint import hf
from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats.base import Problem, Tensor, error, warning
from ckpttool.storage.store import LOCAL, Stores

if TYPE_CHECKING:

    from ckpttool.core.checkpoint.discover import Checkpoint


PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
# What PeftModel.save_pretrained writes, by preference: safetensors, or torch.save with
# safe_serialization=False.
ADAPTER_FILES = (ADAPTER_FILE, "adapter_model.bin")
MODES = ("fuse", "adapter")

_LINEAR = {"lora_A": "a", "lora_B": "b"}
_EMBEDDING = {"lora_embedding_A": "a", "lora_embedding_B": "b"}
_PEFT_SEGMENTS = frozenset({*_LINEAR, *_EMBEDDING, "lora_magnitude_vector", "base_layer",
                            "modules_to_save", "original_module"})


@dataclass
class Module:
    """One LoRA target: its adapter matrices, as stored."""

    name: str  # the base model's module name: "model.layers.0.self_attn.q_proj"
    embedding: bool = False
    a: Tensor | None = None
    b: Tensor | None = None
    b_bias: Tensor | None = None  # lora_bias=True
    magnitude: Tensor | None = None  # DoRA

    @property
    def rank(self) -> int | None:
        return self.a.shape[0] if self.a is not None and self.a.shape else None


@dataclass
class Layout:
    """A checkpoint's tensors sorted out: base weights under the base model's names, trained
    copies of ``modules_to_save``, and the LoRA modules."""

    base: list[tuple[str, Tensor]]  # model order, base-model names
    trained: dict[str, Tensor]  # modules_to_save: base-model name -> trained copy
    modules: dict[str, Module]
    adapters: set[str]  # adapter names seen ("default")
    embedding_bases: dict[str, Tensor] = field(default_factory=dict)  # for the adapter file
    plain: set[str] = field(default_factory=set)  # base names stored without PEFT segments

    @property
    def has_base(self) -> bool:
        return bool(self.base)


def parse(tensors: list[tuple[str, Tensor]]) -> Layout | None:
    """Sort a state dict's tensors (canonical names, model order) into a :class:`Layout`;
    None when there is no LoRA adapter in them.

    Raises:
        UnsupportedError: more than one adapter, or PEFT names of another method (IA3,
            LoKr...) with no LoRA matrices.
    """
    layout = Layout([], {}, {}, set())
    peft_named = False
    for name, tensor in tensors:
        plain = name.removeprefix(PREFIX)
        peft_named = peft_named or plain != name
        segs = plain.split(".")
        # A set test first: most names have no PEFT segment (15,000 of a MoE model, twice
        # per inspect), and the search below costs a generator step per segment.
        hit = None if _PEFT_SEGMENTS.isdisjoint(segs) else next(
            i for i, s in enumerate(segs) if s in _PEFT_SEGMENTS)
        if hit is None:
            layout.base.append((plain, tensor))
            layout.plain.add(plain)
            continue
        module, seg, rest = ".".join(segs[:hit]), segs[hit], segs[hit + 1:]
        if seg == "base_layer":
            base_name = ".".join([module, *rest])
            layout.base.append((base_name, tensor))
            if rest == ["weight"]:
                layout.embedding_bases[name] = tensor
            continue
        if seg == "original_module":
            layout.base.append((".".join([module, *rest]), tensor))
            continue
        adapter, tail = _adapter_and_tail(seg, rest)
        layout.adapters.add(adapter)
        if seg == "modules_to_save":
            layout.trained[".".join([module, *tail])] = tensor
            continue
        m = layout.modules.setdefault(module, Module(module))
        if seg == "lora_magnitude_vector":
            m.magnitude = tensor
        elif seg in _EMBEDDING:
            m.embedding = True
            setattr(m, _EMBEDDING[seg], tensor)
        elif tail == ["bias"]:
            if seg == "lora_B":
                m.b_bias = tensor
            else:
                raise UnsupportedError(f"'{name}': a bias on lora_A, which PEFT never writes")
        else:
            setattr(m, _LINEAR[seg], tensor)
    # Embedding base weights matter only to the adapter file (PEFT saves them with the
    # adapter when an embedding is a target).
    layout.embedding_bases = {k: v for k, v in layout.embedding_bases.items()
                              if k.removeprefix(PREFIX).rsplit(".", 2)[0] in {
                                  m.name for m in layout.modules.values() if m.embedding}}
    if not layout.modules:
        if peft_named and not layout.trained and any(
                _PEFT_SEGMENTS.intersection(n.split(".")) for n, _ in tensors):
            raise UnsupportedError(
                "holds a PEFT model without LoRA matrices (another adapter method); ckpttool "
                "merges LoRA adapters only")
        if not layout.trained:
            return None
    if len(layout.adapters) > 1:
        raise UnsupportedError(
            f"holds {len(layout.adapters)} LoRA adapters ({', '.join(sorted(layout.adapters))});"
            " ckpttool merges one adapter at a time")
    return layout


def as_adapter_file(layout: Layout) -> Layout:
    """``layout`` read from an adapter saved alone (``save_pretrained``): a weight under a
    plain name there is a trained copy (``modules_to_save``), and the base weights of targeted
    embeddings are the base model's own, not used."""
    weights = dict(layout.base)
    trained = {**layout.trained, **{n: weights[n] for n in layout.plain}}
    return Layout([], trained, layout.modules, layout.adapters, layout.embedding_bases)


def _adapter_and_tail(seg: str, rest: list[str]) -> tuple[str, list[str]]:
    """The adapter name and what follows it. ``save_pretrained`` files carry no adapter name:
    ``lora_A.weight``, ``lora_embedding_A``, ``lora_magnitude_vector``."""
    if seg in _EMBEDDING or seg == "lora_magnitude_vector":
        return (rest[0], rest[1:]) if rest and rest != ["weight"] else ("", rest)
    if seg in _LINEAR:
        return (rest[0], rest[1:]) if len(rest) > 1 else ("", rest)
    return (rest[0], rest[1:]) if rest else ("", rest)


# --------------------------------------------------------------------------------------------
# adapter_config.json


@dataclass(frozen=True)
class AdapterConfig:
    """What merging needs from PEFT's ``adapter_config.json``."""

    r: int
    alpha: float
    use_rslora: bool
    fan_in_fan_out: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    use_dora: bool
    modules_to_save: tuple[str, ...]
    target_modules: Any
    source: str  # where it was read

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """PEFT's per-module rank and alpha: a ``rank_pattern``/``alpha_pattern`` key matches
        a module whose name ends in it (as a regular expression, at a dot boundary)."""
        r = self.r
        for key, value in self.rank_pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                r = value
                break
        alpha: float = self.alpha
        for key, given in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                alpha = given
                break
        return r, alpha

    def scale(self, module: str, rank: int) -> float:
        """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, as PEFT computes it."""
        _, alpha = self.rank_and_alpha(module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_config(doc: dict[str, Any], source: str) -> AdapterConfig:
    """Parse ``adapter_config.json``.

    Raises:
        InputError: not a LoRA config, or r / lora_alpha missing or not numbers.
    """
    peft_type = doc.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InputError(f"{source}: peft_type is {peft_type!r}, not LORA; ckpttool merges "
                         "LoRA adapters only")

    def number(key: str, kind: type) -> Any:
        value = doc.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind is int and not isinstance(value, int)) or value <= 0:
            raise InputError(f"{source}: '{key}' is {value!r}; it must be a positive "
                             f"{'integer' if kind is int else 'number'} (LoRA never guesses it)")
        return value

    def mapping(key: str) -> dict[str, Any]:
        value = doc.get(key) or {}
        if not isinstance(value, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
            raise InputError(f"{source}: '{key}' must map module patterns to numbers")
        return value

    saved = doc.get("modules_to_save") or ()
    return AdapterConfig(
        r=number("r", int), alpha=number("lora_alpha", float),
        use_rslora=bool(doc.get("use_rslora")), fan_in_fan_out=bool(doc.get("fan_in_fan_out")),
        rank_pattern=mapping("rank_pattern"), alpha_pattern=mapping("alpha_pattern"),
        use_dora=bool(doc.get("use_dora")),
        modules_to_save=tuple(saved) if isinstance(saved, list) else (),
        target_modules=doc.get("target_modules"), source=source)


def missing_config(where: str) -> InputError:
    return InputError(
        f"{where}: holds a LoRA adapter but no adapter_config.json (nor verl's "
        f"{TRAINER_META}) was found beside it or in the run directory, and lora_alpha cannot "
        "be read from the weights (ckpttool never guesses it to fold); pass --adapter-config "
        "PATH (the adapter_config.json written at training time) or --lora-alpha N (the "
        "value training used)")


def adapter_of(ckpt: Checkpoint, explicit: Path | None = None
               ) -> tuple[Layout | None, AdapterConfig | None, list[Problem]]:
    """The LoRA adapter in a model checkpoint and its config, for inspect and verify: what
    merge would raise is returned as problems instead."""
    if ckpt.kind != "model" or ckpt.info is None:
        return None, None, []
    try:
        layout = parse([(t.name, t.tensor) for t in ckpt.tensors])
    except UnsupportedError as e:
        return None, None, [error("lora-unsupported", f"{ckpt.path}: {e}")]
    if layout is None or not layout.modules:
        return layout, None, []
    try:
        known = find_config(ckpt.root if ckpt.stores.is_dir(ckpt.root) else ckpt.info.base,
                            explicit, given=ckpt.path, layout=layout, stores=ckpt.stores)
    except InputError as e:
        return layout, None, [error("lora-config", str(e))]
    if known.config is None:
        # The checkpoint is whole; only folding it needs alpha (--lora adapter assumes one).
        return layout, None, [warning("lora-no-alpha", str(missing_config(str(ckpt.path))))]
    return layout, known.config, []


# --------------------------------------------------------------------------------------------
# Where real trainers record the adapter (they do not all write adapter_config.json)

# verl's FSDP checkpoint manager writes {"r", "lora_alpha", "task_type"} beside its rank files.
TRAINER_META = "lora_train_meta.json"
# A step directory of a run: HF Trainer's checkpoint-<N>, accelerate's checkpoint_<N>, verl's
# global_step_<N>. The run directory above it is where a final save_pretrained writes.
_STEP_DIR = re.compile(r"^(checkpoint|global_step)[-_]\d+$")
MAX_JSON = 1 << 20


@dataclass(frozen=True)
class Known:
    """An adapter's config as found for a checkpoint.

    ``config`` is None when no ``lora_alpha`` is recorded anywhere (folding is impossible);
    ``text`` is the ``adapter_config.json`` that ``--lora adapter`` writes: the file found, or
    one built from what is known, ``assumed`` naming every value that was not recorded."""

    config: AdapterConfig | None
    text: bytes
    source: str | None  # the file it came from; None: from the weights alone
    assumed: tuple[str, ...] = ()


def _trainer_dirs(root: Path) -> list[Path]:
    """Where trainers record the adapter beyond what :func:`hf.find_adapter_config` reads,
    nearest first: the checkpoint's directory and the one above (verl's actor/ holds
    lora_train_meta.json), and the run directory above a step directory (the Trainer's
    output_dir above checkpoint-N, accelerate's project_dir above checkpoints/checkpoint_N)."""
    dirs = [root, root.parent]
    for step in (d for d in (root, root.parent) if _STEP_DIR.match(d.name)):
        dirs.append(step.parent)
        if step.parent.name == "checkpoints":  # accelerate: project_dir/checkpoints/checkpoint_N
            dirs.append(step.parent.parent)
    return list(dict.fromkeys(dirs))


def find_config(root: Path, explicit: Path | None, *, given: Path | None,
                layout: Layout, alpha: float | None = None, stores: Stores = LOCAL) -> Known:
    """The adapter's config: ``--adapter-config``, PEFT's ``adapter_config.json`` beside the
    checkpoint, in the run directory above a step directory, or verl's ``lora_train_meta.json``;
    else only what the weights say (ranks, targets) with ``lora_alpha`` unknown, or ``alpha``
    (``--lora-alpha``: the value the training run used) where it was recorded nowhere.

    Raises:
        InputError: a file found is not valid (not JSON, not LoRA, r or alpha not numbers), or
            records another alpha than ``alpha``.
    """
    import json

    # Each file is read once, through a checked descriptor: the bytes written with --lora
    # adapter are the bytes parsed here, never the name read again.
    found = hf.find_adapter_config(root, explicit, given=given, stores=stores)
    if found is not None:
        return _agrees(Known(read_config(found.doc, str(found.path)), found.data,
                             str(found.path)), alpha)
    dirs = _trainer_dirs(root)
    for d in dirs[2:]:  # the run directories (the nearer ones hf already looked in)
        found = hf.read_record(d / hf.ADAPTER_CONFIG, MAX_JSON, stores=stores)
        if found is not None:
            return _agrees(Known(read_config(found.doc, str(found.path)), found.data,
                                 str(found.path)), alpha)
    for d in dirs:
        record = hf.read_record(d / TRAINER_META, MAX_JSON, stores=stores)
        if record is not None:
            meta, source = record.doc, str(record.path)
            recorded = meta.get("lora_alpha")
            if recorded is None and alpha is None:  # r and the task, but no alpha
                return Known(None, b"", source, ())
            built, assumed = config_from_weights(
                layout, r=meta.get("r"), alpha=recorded if recorded is not None else alpha,
                task_type=meta.get("task_type"))
            text = (json.dumps(built, indent=2) + "\n").encode()
            return _agrees(Known(read_config(built, source), text, source, assumed), alpha)
    if alpha is not None:  # recorded nowhere, given by the user
        built, assumed = config_from_weights(layout, alpha=alpha)
        text = (json.dumps(built, indent=2) + "\n").encode()
        return Known(read_config(built, "--lora-alpha"), text, "--lora-alpha", assumed)
    return Known(None, b"", None, ())


def _agrees(known: Known, alpha: float | None) -> Known:
    """``known``, where ``--lora-alpha`` (if given) says what its record says."""
    if alpha is not None and known.config is not None and known.config.alpha != alpha:
        raise InputError(f"--lora-alpha {alpha:g} differs from the lora_alpha "
                         f"{known.config.alpha:g} that {known.source} records; leave "
                         "--lora-alpha out to use the recorded one")
    return known


def missing_alpha(where: str) -> InputError:
    """An adapter to write whose ``lora_alpha`` no file records: never guessed (PEFT scales
    the update by alpha / r, so a wrong one changes every output)."""
    return InputError(
        f"{where}: holds a LoRA adapter whose lora_alpha is recorded nowhere (no "
        f"adapter_config.json, nor verl's {TRAINER_META}, beside it or in the run "
        "directory) and cannot be read from the weights; ckpttool never guesses it. Pass "
        "the value training used: --lora-alpha N, or --adapter-config PATH")


def config_from_weights(layout: Layout, *, r: Any = None, alpha: Any = None,
                        task_type: Any = None) -> tuple[dict[str, Any], tuple[str, ...]]:
    """An ``adapter_config.json`` from what is known: rank per module from the shapes, target
    modules and ``modules_to_save`` from the names, ``r``/``lora_alpha``/``task_type`` as a
    trainer recorded them. Returns it and what was assumed (PEFT's defaults)."""
    ranks = {m.name: m.rank for m in layout.modules.values() if m.rank is not None}
    counts: dict[int, int] = {}
    for rank in ranks.values():
        counts[rank] = counts.get(rank, 0) + 1
    common = max(counts, key=lambda k: (counts[k], -k)) if counts else None
    assumed = ["use_rslora false", "fan_in_fan_out false", "lora_dropout 0.0", "bias 'none'"]
    # A trainer's recorded r holds for every module (verl has one): shapes that disagree
    # are then reported (lora-rank), not hidden in a rank_pattern.
    pattern = {} if r is not None else {
        name: rank for name, rank in ranks.items() if rank != common}
    if r is None:
        r = common
    if alpha is None:  # never guessed: the callers refuse before building
        raise InputError("lora_alpha is recorded nowhere; pass --lora-alpha N")
    if ranks:
        assumed.append("one lora_alpha for every module (no alpha_pattern)")
    doc: dict[str, Any] = {
        "peft_type": "LORA", "task_type": task_type, "r": r, "lora_alpha": alpha,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in layout.modules}),
        "rank_pattern": pattern, "alpha_pattern": {},
        "modules_to_save": sorted(layout.trained) or None,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": any(m.magnitude is not None for m in layout.modules.values()),
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    return doc, tuple(assumed)
