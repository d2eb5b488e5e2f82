"""LoRA adapters (PEFT) in a checkpoint: recognised by their names, then exported as a PEFT
adapter or folded into the base weights.

A PEFT model's state dict names every tensor under ``base_model.model.``: a target module's
weight as ``<module>.base_layer.weight`` beside ``<module>.lora_A.<adapter>.weight`` (``[r,
in]``) and ``<module>.lora_B.<adapter>.weight`` (``[out, r]``); an embedding's as
``lora_embedding_A/B.<adapter>`` (no ``.weight``); a ``modules_to_save`` module twice, as
``<module>.original_module.*`` and ``<module>.modules_to_save.<adapter>.*``; DoRA adds
``lora_magnitude_vector``. ``PeftModel.save_pretrained`` writes the adapter alone, without
the adapter name (``lora_A.weight``) and with a trained copy under its base name.

Planning here is pure: it turns names, shapes and ``adapter_config.json`` into merge sources
(:class:`~ckpttool.core.transforms.derive.Derived` for a folded weight). Nothing is guessed: rank
comes
from the shapes and must agree with the config; alpha comes from the config or nowhere.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.core.checkpoint import hf, structure, tensors
from ckpttool.core.checkpoint.discover import discover, open_reader
from ckpttool.core.runtime.report import Section, section
from ckpttool.core.transforms.derive import Derived, scratch, scratch_bytes
from ckpttool.errors import InputError, UnsupportedError, UsageError
from ckpttool.formats.base import Problem, Reader, Tensor, error, info, warning

if TYPE_CHECKING:
    import torch

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
        known = find_config(ckpt.root if ckpt.root.is_dir() else ckpt.info.base, explicit,
                            given=ckpt.path, layout=layout)
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
_MAX_JSON = 1 << 20


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
                layout: Layout, alpha: float | None = None) -> Known:
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
    found = hf.find_adapter_config(root, explicit, given=given)
    if found is not None:
        return _agrees(Known(read_config(found.doc, str(found.path)), found.data,
                             str(found.path)), alpha)
    dirs = _trainer_dirs(root)
    for d in dirs[2:]:  # the run directories (the nearer ones hf already looked in)
        found = hf.read_record(d / hf.ADAPTER_CONFIG, _MAX_JSON)
        if found is not None:
            return _agrees(Known(read_config(found.doc, str(found.path)), found.data,
                                 str(found.path)), alpha)
    for d in dirs:
        record = hf.read_record(d / TRAINER_META, _MAX_JSON)
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


def assumed_warning(report: LoraMerge) -> str:
    """One line for a merge that wrote an ``adapter_config.json`` it partly assumed."""
    source = report.config_from
    built = f"built from {source} and the weights" if source else "built from the weights"
    return (f"{hf.ADAPTER_CONFIG} {built}; assumed: {'; '.join(report.assumed)}. Check "
            "them against the training run and edit the file if they differ")


# --------------------------------------------------------------------------------------------
# Checks, shared by merge (errors) and verify (problems)


def problems(layout: Layout, config: AdapterConfig | None,
             base: dict[str, Tensor] | None = None) -> list[Problem]:
    """What is wrong with the adapter, from names, shapes and the config alone.

    Args:
        base: the base weights to check shapes against (default: the layout's own).
    """
    found: list[Problem] = []
    weights = dict(layout.base) if base is None else base
    for m in layout.modules.values():
        where = m.name
        if m.magnitude is not None or (config is not None and config.use_dora):
            # The adapter is intact: a note, never an integrity error (the fold refuses it).
            found.append(info("lora-dora", f"'{where}': DoRA (lora_magnitude_vector); "
                              "ckpttool does not fold DoRA adapters yet: merge --lora adapter "
                              "writes the adapter with its magnitudes"))
        if m.a is None or m.b is None:
            have, lack = ("lora_A", "lora_B") if m.a is not None else ("lora_B", "lora_A")
            found.append(error("lora-unpaired", f"'{where}': has {have} but no {lack}; the "
                               "adapter is incomplete"))
            continue
        a, b = m.a.shape, m.b.shape
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            found.append(error("lora-shape", f"'{where}': lora_A {list(a)} and lora_B "
                               f"{list(b)} do not multiply (A is [r, in], B is [out, r])"))
            continue
        if config is not None:
            want, _ = config.rank_and_alpha(m.name)
            if want != a[0]:
                found.append(error("lora-rank", f"'{where}': the adapter has rank {a[0]} but "
                                   f"{config.source} says r={want}; it belongs to another "
                                   "adapter"))
        weight = weights.get(f"{m.name}.weight")
        if weight is None:
            if layout.has_base or base is not None:
                found.append(error("lora-no-base", f"'{where}': no base weight "
                                   f"'{m.name}.weight' to apply the adapter to"))
            continue
        expect = _delta_shape(m, config)
        if weight.shape != expect:
            found.append(error("lora-shape", f"'{where}': base weight {list(weight.shape)} "
                               f"does not match lora_B @ lora_A {list(expect)}"))
        if m.b_bias is not None and f"{m.name}.bias" not in weights:
            found.append(error("lora-no-base", f"'{where}': lora_bias without a base bias"))
    return found


def _delta_shape(m: Module, config: AdapterConfig | None) -> tuple[int, ...]:
    assert m.a is not None and m.b is not None
    out, into = m.b.shape[0], m.a.shape[1]
    if m.embedding or (config is not None and config.fan_in_fan_out):
        return (into, out)
    return (out, into)


def raise_first(found: list[Problem]) -> None:
    for p in found:
        if p.severity == "error":
            raise InputError(p.message)


def refuse_dora(found: list[Problem]) -> None:
    """The fold of a DoRA adapter: not supported yet (exit 4)."""
    dora = next((p for p in found if p.code == "lora-dora"), None)
    if dora is not None:
        raise UnsupportedError(f"{dora.message.split(';')[0]}; ckpttool does not fold DoRA "
                               "adapters yet; write the adapter alone with --lora adapter")


# --------------------------------------------------------------------------------------------
# Plans


def plan_fuse(layout: Layout, config: AdapterConfig,
              base: list[tuple[str, Tensor]] | None = None,
              adapter_reader: Reader | None = None) -> list[tuple[str, Tensor | Derived]]:
    """The merge sources of the fused model, in model order, under the base model's names.

    Args:
        base: the base model's tensors, when the adapter came alone (``--adapter``); the
            layout's own base weights otherwise.
        adapter_reader: the reader of the adapter's tensors when they are not in the same
            checkpoint as ``base``.

    Raises:
        InputError / UnsupportedError: the first of :func:`problems`.
    """
    weights = base if base is not None else layout.base
    by_name = dict(weights)
    found = problems(layout, config, by_name)
    refuse_dora(found)
    raise_first(found)
    for name, tensor in layout.trained.items():
        if name not in by_name:
            raise InputError(f"'{name}': a trained copy (modules_to_save) of a weight the base "
                             "model does not have")
        if by_name[name].shape != tensor.shape:
            raise InputError(f"'{name}': the trained copy is {list(tensor.shape)} but the base "
                             f"weight is {list(by_name[name].shape)}")
    out: list[tuple[str, Tensor | Derived]] = []
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        m = layout.modules.get(module)
        if name in layout.trained:
            copy = layout.trained[name]
            # From a separate adapter file: read through its own reader.
            out.append((name, copy if adapter_reader is None else Derived(
                name, (copy,), copy.dtype, copy.shape, lambda ts: ts[0],
                "trained copy (modules_to_save)", readers=(adapter_reader,))))
        elif m is not None and leaf == "weight":
            out.append((name, _fused_weight(name, tensor, m, config, adapter_reader)))
        elif m is not None and leaf == "bias" and m.b_bias is not None:
            out.append((name, _fused_bias(name, tensor, m, config, adapter_reader)))
        else:
            out.append((name, tensor))
    return out


def _float_base(name: str, tensor: Tensor) -> None:
    if not tensor.dtype.is_float or tensor.dtype.name.startswith("float8"):
        raise UnsupportedError(f"'{name}': a {tensor.dtype.name} base weight; LoRA is folded "
                               "into floating-point (bf16, fp16, fp32) weights only")


def _fused_weight(name: str, weight: Tensor, m: Module, config: AdapterConfig,
                  reader: Reader | None) -> Derived:
    _float_base(name, weight)
    assert m.a is not None and m.b is not None
    rank = m.a.shape[0]
    scale = config.scale(m.name, rank)
    transpose = m.embedding or config.fan_in_fan_out

    # PEFT's own order, so that an fp32 fold equals merge_and_unload() to the bit:
    # W + transpose(B @ A) * scale, in fp32. That is PEFT's arithmetic for an adapter it
    # holds in fp32: PeftModel.from_pretrained upcasts a half-precision adapter by default
    # (autocast_adapter_dtype=True). One loaded with autocast_adapter_dtype=False has its
    # product rounded to the adapter's dtype before the add on CPU; its merge differs.
    # In place where the values are the same (one rounding per step either way): memory is
    # the weight in fp32 and one delta, not four temporaries.
    def compute(ts: list[torch.Tensor]) -> torch.Tensor:
        w, a, b = ts
        delta = b.float() @ a.float()
        if transpose:
            delta = delta.T
        return w.float().add_(delta.mul_(scale))

    # The same operations, each element's exactly as above, a block of the weight's rows at a
    # time, in the core's cache: the product of those rows (torch.mm), times the scale, plus
    # the weight's rows (read where they lie in the page cache), cast into the output piece
    # that the merge writes at once. Nothing the size of the weight is ever made (the whole
    # product cost two passes over memory and its write from memory cost twice one from
    # cache: measured, 5632 x 2048 bf16, 53 -> 37 ms of CPU with the write). The weight's
    # rows are widened into a buffer of this thread's (an add of a bf16 operand made a new
    # float32 copy of it per block), and where the scale is a power of two the product is
    # scaled and added in one pass (:func:`fma_exact`: the same bits).
    def pieces(ts: list[torch.Tensor], target: torch.dtype) -> Iterator[memoryview]:
        import torch

        w, a, b = ts
        if w.dtype.itemsize > 4:  # float64: in float32 first, as ``compute`` has it
            w = w.float()
        b32, a32 = b.float(), a.float()
        rows, cols = b32.shape[0], a32.shape[1]
        shape = (cols, rows) if transpose else (rows, cols)
        if shape != tuple(w.shape) or w.dim() != 2:
            raise InputError(f"'{name}': the LoRA product is {list(shape)}, the weight "
                             f"{list(w.shape)}")
        bounds = row_blocks(w.shape[0], w.shape[1])
        most = max(hi - lo for lo, hi in itertools.pairwise(bounds)) * w.shape[1]
        full = None if not transpose and blocks_exact(b32, a32, bounds) else \
            torch.mm(b32, a32, out=scratch("lora-delta", rows * cols).view(rows, cols))
        delta = None if full is None else full.T if transpose else full
        fused = fma_exact(scale, a32, b32)
        block = scratch("lora-rows", most)
        # Where the sum is made: the weight's rows widened (the product is added to them),
        # or, for a float32 weight whose product is scaled apart, the product's block.
        wide = scratch("lora-wide", most) if fused or w.dtype != torch.float32 else None
        out = None if target == torch.float32 else scratch("lora-out", most, target)
        # Per number of rows (blocks have two sizes at most): the product's block, the sum's,
        # the output piece and its bytes, made once (a view costs microseconds, a block of
        # rows about 300: several per block added up to a few percent).
        views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, memoryview]] = {}
        for lo, hi in itertools.pairwise(bounds):
            got = views.get(hi - lo)
            if got is None:
                numel = (hi - lo) * w.shape[1]
                part = block[:numel].view(hi - lo, w.shape[1])
                total = part if wide is None else wide[:numel].view(hi - lo, w.shape[1])
                piece = (scratch_bytes("lora-rows" if wide is None else "lora-wide", numel * 4)
                         if out is None else scratch_bytes("lora-out", numel * target.itemsize))
                got = views[hi - lo] = (part, total, None if out is None else out[:numel],
                                        piece)
            part, total, out_piece, piece = got
            if delta is None:
                torch.mm(b32[lo:hi], a32, out=part)
            else:
                part.copy_(delta[lo:hi])
            # PEFT's order, w + d: the same sum either way, but where both are NaN, the
            # first operand's NaN is the one that comes out.
            if wide is None:
                torch.add(w[lo:hi], part.mul_(scale), out=part)  # one rounding
            else:
                total.copy_(w[lo:hi])  # exactly widened to float32
                if fused:
                    total.add_(part, alpha=scale)
                else:
                    total.add_(part.mul_(scale))  # one rounding
            if out_piece is not None:
                out_piece.copy_(total.view(-1))
            yield piece  # float32 out: the sum's own bytes

    what = f"lora fused: rank {rank}, scale {scale:g}"
    return Derived(name, (weight, m.a, m.b), weight.dtype, weight.shape, compute, what,
                   readers=(None, reader, reader),
                   pieces=pieces if len(weight.shape) == 2 else None)


# Elements of a weight folded per block (float32): the block and its output piece stay in
# the core's cache. A block holds at least FOLD_ROWS rows: torch.mm of a few rows (1 to 3,
# measured) may take another kernel than the whole product's, with other bits.
FOLD_BLOCK = 1 << 18
FOLD_ROWS = 16


def row_blocks(rows: int, cols: int) -> list[int]:
    """Where a weight's blocks of rows begin, and its end: blocks of about
    :data:`FOLD_BLOCK` elements and at least :data:`FOLD_ROWS` rows (one block below that),
    of sizes that differ by one row at most (no short last block)."""
    step = max(FOLD_ROWS, FOLD_BLOCK // max(1, cols))
    count = max(1, rows // step)
    return [rows * k // count for k in range(count + 1)]


# A power-of-two scale is fused with the add only while the product times the scale stays
# below this (float32's largest finite value is just under 2**128).
FMA_LIMIT = 2.0**126


def fma_exact(scale: float, a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if ``w + (b @ a) * scale``, as PEFT rounds it (the product times the scale
    rounded to float32, then the sum), has the bits of ``torch.add(w, b @ a, alpha=scale)``
    for every float32 ``w``, so that the fold may scale and add in one pass (which torch makes
    a fused multiply-add, rounded once).

    That holds when the scale is ``2**k`` with ``k >= 0`` and no product element times the
    scale can overflow: multiplying a finite float32 by such a scale is then exact (normal
    and subnormal values alike: only the exponent grows), so rounding it changes nothing and
    both ways round the same exact sum once. ``a`` and ``b`` must be finite (an infinite or
    NaN product could meet a NaN weight: which NaN comes out would depend on the order), and
    ``rank * max|a| * max|b| * scale`` (a bound on every product element, with room for its
    roundings) below :data:`FMA_LIMIT`. Any other scale (``alpha / r`` of 0.5, rsLoRA's
    ``alpha / sqrt(r)``) is multiplied and added apart."""

    mantissa, exponent = math.frexp(scale)
    # 2**0 .. 2**127: float32's own (a scale beyond is no float32: torch refuses the alpha).
    if mantissa != 0.5 or not 1 <= exponent <= 128 or not a.numel() or not b.numel():
        return False
    bound = a.shape[0] * _max_abs(a) * _max_abs(b) * scale
    return bound < FMA_LIMIT


def _max_abs(t: torch.Tensor) -> float:
    """The largest magnitude in ``t`` (one pass, no temporary); infinite where ``t`` holds an
    infinity or a NaN."""
    import torch

    lo, hi = (float(x) for x in torch.aminmax(t))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return math.inf
    return max(-lo, hi)


# Whether torch.mm of blocks of rows gave the whole product's bits, per (rows, rank, cols,
# blocks): checked on the first weight of each shape, then trusted for the others.
_exact: dict[tuple[int, ...], bool] = {}


def blocks_exact(b: torch.Tensor, a: torch.Tensor, bounds: list[int]) -> bool:
    """True if ``b[lo:hi] @ a`` equals the rows ``lo:hi`` of ``b @ a`` to the bit for every
    block of ``bounds``, as PEFT computes it: whole. Each row's elements are the same sums of
    ``rank`` products, but the library may pick its kernel (and so the order of the sums) by
    the number of rows; this compares once per shape and block sizes, on the first weight of
    that shape (a whole product then, in a buffer kept per thread), and the fold uses whole
    products for a shape where any block differed."""
    import torch

    key = (b.shape[0], b.shape[1], a.shape[1], *bounds)
    known = _exact.get(key)
    if known is not None:
        return known
    rows, cols = b.shape[0], a.shape[1]
    whole = torch.mm(b, a, out=scratch("lora-delta", rows * cols).view(rows, cols))
    most = max(hi - lo for lo, hi in itertools.pairwise(bounds))
    part = scratch("lora-rows", most * cols)
    same = all(torch.equal(torch.mm(b[lo:hi], a, out=part[:(hi - lo) * cols].view(hi - lo, cols)),
                           whole[lo:hi]) for lo, hi in itertools.pairwise(bounds))
    _exact[key] = same
    return same


def _fused_bias(name: str, bias: Tensor, m: Module, config: AdapterConfig,
                reader: Reader | None) -> Derived:
    _float_base(name, bias)
    assert m.a is not None and m.b_bias is not None
    scale = config.scale(m.name, m.a.shape[0])

    def compute(ts: list[torch.Tensor]) -> torch.Tensor:
        return ts[0].float() + ts[1].float() * scale

    return Derived(name, (bias, m.b_bias), bias.dtype, bias.shape, compute,
                   f"lora bias fused: scale {scale:g}", readers=(None, reader))


def plan_adapter(layout: Layout) -> list[tuple[str, Tensor]]:
    """The tensors of ``adapter_model.safetensors`` under the names ``save_pretrained``
    writes: no adapter name, ``base_model.model.`` kept, a trained copy under its base name,
    and the base weights of targeted embeddings.

    Raises:
        InputError / UnsupportedError: an incomplete or DoRA adapter.
    """
    raise_first([p for p in problems(layout, None) if p.code == "lora-unpaired"])
    out: list[tuple[str, Tensor]] = []
    for m in layout.modules.values():
        if m.embedding:
            assert m.a is not None and m.b is not None
            out += [(f"{PREFIX}{m.name}.lora_embedding_A", m.a),
                    (f"{PREFIX}{m.name}.lora_embedding_B", m.b)]
            continue
        for role, tensor in (("lora_A.weight", m.a), ("lora_B.weight", m.b),
                             ("lora_B.bias", m.b_bias)):
            if tensor is not None:
                out.append((f"{PREFIX}{m.name}.{role}", tensor))
        if m.magnitude is not None:  # DoRA: beside A and B, as save_pretrained writes it
            out.append((f"{PREFIX}{m.name}.lora_magnitude_vector", m.magnitude))
    out += [(k, v) for k, v in layout.embedding_bases.items()]
    out += [(PREFIX + name, tensor) for name, tensor in layout.trained.items()]
    return out


# --------------------------------------------------------------------------------------------
# A merged model that is still its base (verl#7285: a merge that never applied the adapter)

# verl's model merger writes the adapter it folded under <target_dir>/lora_adapter/.
MERGER_ADAPTER_DIR = "lora_adapter"


def merged_adapter_config(root: Path, explicit: Path | None
                          ) -> tuple[dict[str, Any] | None, str | None]:
    """The ``adapter_config.json`` a merged model says it was made from: ``--adapter-config``,
    PEFT's file beside it, or verl's ``lora_adapter/`` inside it. (None, None) if none.

    Raises:
        InputError: the file is not a JSON object, or ``explicit`` is missing.
    """
    found = (hf.find_adapter_config(root, explicit, given=root)
             or hf.read_record(root / MERGER_ADAPTER_DIR / hf.ADAPTER_CONFIG, _MAX_JSON))
    return (found.doc, str(found.path)) if found is not None else (None, None)


def _is_target(module: str, targets: Any) -> bool:
    """PEFT's rule: a string is a regular expression the whole module name must match; a list
    holds module names or name suffixes at a dot boundary."""
    if isinstance(targets, str):
        if targets == "all-linear":
            return not module.endswith(("lm_head", "embed_tokens"))
        return re.fullmatch(targets, module) is not None
    if isinstance(targets, (list, tuple)):
        return any(isinstance(t, str) and (module == t or module.endswith("." + t))
                   for t in targets)
    return False


def unchanged_from_base(compared: dict[str, tuple[int, ...]], unchanged: set[str],
                        doc: dict[str, Any], source: str, model: str, base: str
                        ) -> list[Problem]:
    """A warning when every LoRA target weight of a merged model is bit-identical to its
    base: the adapter was not folded in. Pure.

    Args:
        compared: the merged model's weights compared with the base, name -> shape.
        unchanged: those whose bytes were equal.
        doc: the adapter_config.json the merge says it used (``target_modules``).
    """
    targets = [n for n, shape in compared.items() if n.endswith(".weight") and len(shape) == 2
               and _is_target(n.removesuffix(".weight"), doc.get("target_modules"))]
    if not targets or any(n not in unchanged for n in targets):
        return []
    return [warning(
        "unchanged-from-base",
        f"{model}: all {len(targets)} LoRA target weights (target_modules in {source}) are "
        f"bit-identical to {base}: the adapter was never folded in, or never trained. Merge "
        "again from the training checkpoint (ckpttool merge CKPT OUT folds it) and check the "
        "adapter with ckpttool verify CKPT",
        tensor=targets[0])]


# --------------------------------------------------------------------------------------------
# Reports


@section
class AdapterSummary(Section):
    """An adapter in a few fields, for inspect, merge and verify reports (``lora``)."""

    modules: int
    targets: list[str]
    rank: int | list[int]
    alpha: float | None
    alpha_pattern: dict[str, float] | None
    rank_pattern: dict[str, int] | None
    variant: str  # lora, rslora or dora
    modules_to_save: list[str]
    config: str | None  # where adapter_config.json came from (or what was done instead)
    parameters: int

    def line(self) -> str:
        """The adapter in one line: rank, alpha, variant, targets."""
        rank = self.rank if isinstance(self.rank, int) else "/".join(map(str, self.rank))
        alpha = ("unknown (no adapter_config.json)" if self.alpha is None
                 else f"{self.alpha:g}")
        return (f"LoRA adapter: rank {rank}, alpha {alpha}, {self.variant}, {self.modules} "
                f"modules ({', '.join(self.targets)})"
                + (f", modules_to_save {', '.join(self.modules_to_save)}"
                   if self.modules_to_save else ""))


@section
class LoraMerge(Section):
    """merge's ``lora``: what was done with the adapter (``mode``: ``fuse`` or ``adapter``),
    the adapter (``summary``: its fields are this section's), the ``--adapter`` path, the
    tensors folded, the other way to merge it, and for a written adapter where its
    adapter_config.json came from and what was assumed in it."""

    mode: str
    summary: AdapterSummary
    adapter: str | None = None  # --adapter, as given
    fused: int = 0
    other: str | None = None
    config_from: str | None = None
    assumed: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"mode": self.mode}
        if self.adapter is not None:
            doc["adapter"] = self.adapter
        doc.update(self.summary.to_json())
        if self.mode == "fuse":
            doc["fused"] = self.fused
            if self.other is not None:
                doc["other"] = self.other
        else:
            doc.update(other=self.other, config_from=self.config_from, assumed=self.assumed)
        return doc


def describe(layout: Layout, config: AdapterConfig | None) -> AdapterSummary:
    """The adapter in a few fields, for inspect and merge reports."""
    ranks = sorted({m.rank for m in layout.modules.values() if m.rank is not None})
    targets = sorted({m.name.rsplit(".", 1)[-1] for m in layout.modules.values()})
    variant = ("dora" if any(m.magnitude is not None for m in layout.modules.values())
               or (config is not None and config.use_dora)
               else "rslora" if config is not None and config.use_rslora else "lora")
    return AdapterSummary(
        modules=len(layout.modules),
        targets=targets,
        rank=ranks[0] if len(ranks) == 1 else ranks,
        alpha=None if config is None else config.alpha,
        alpha_pattern=None if config is None else config.alpha_pattern or None,
        rank_pattern=None if config is None else config.rank_pattern or None,
        variant=variant,
        modules_to_save=sorted(layout.trained),
        config=None if config is None else config.source,
        parameters=sum(t.numel for m in layout.modules.values()
                       for t in (m.a, m.b, m.b_bias) if t is not None),
    )


def never_trained(reader: Reader, layout: Layout) -> list[Problem]:
    """A warning when lora_B is all zeros: PEFT initialises B to zero, so such an adapter
    never trained and folding it changes nothing."""
    zero = [m.name for m in layout.modules.values() if m.b is not None and _all_zero(reader, m.b)]
    if not zero:
        return []
    return [warning("lora-untrained",
                    f"lora_B is all zeros in {len(zero)} of {len(layout.modules)} modules "
                    f"(first: '{zero[0]}'): the adapter never trained, and folding it leaves "
                    "the base weights unchanged")]


def _all_zero(reader: Reader, tensor: Tensor) -> bool:
    """Every byte of ``tensor`` is zero (+0.0 in any float dtype), read block by block."""
    return all(block.count(0) == len(block) for _, block in tensors.blocks(reader, tensor))


# --------------------------------------------------------------------------------------------
# The LoRA wiring of a merge


@dataclass
class Adapted:
    """A LoRA adapter found for this merge, and what it turns the merge into."""

    mode: str  # "fuse" or "adapter"
    sources: list[tuple[str, Tensor | Derived]]
    report: LoraMerge
    config_bytes: bytes = b""
    reader: Reader | None = None  # the adapter's, when it is not in SRC (--adapter)


def plan_for_merge(ckpt: Checkpoint, named: list[tuple[str, Tensor]], mode: str | None,
                   adapter: str | os.PathLike[str] | None,
                   adapter_config: str | os.PathLike[str] | None,
                   lora_alpha: float | None = None) -> Adapted | None:
    """The LoRA adapter in ``ckpt`` (or given with ``adapter``) planned into merge sources;
    None for a checkpoint without one.

    Raises:
        InputError: no alpha anywhere, an incomplete adapter, shapes that disagree, or a mode
            that cannot apply.
        UnsupportedError: DoRA, several adapters, another PEFT method.
    """
    if mode is not None and mode not in MODES:
        raise InputError(f"unknown --lora '{mode}'; use one of: {', '.join(MODES)}")
    explicit = Path(adapter_config) if adapter_config is not None else None
    found = parse(named)
    other = "--lora adapter"
    if adapter is not None:
        if found is not None:
            raise InputError(f"{ckpt.path}: holds a LoRA adapter itself; --adapter folds an "
                             "adapter into a model with plain weights")
        if mode == "adapter":
            raise UsageError("--adapter folds an adapter into SRC; --lora adapter would write "
                             "the adapter alone: use one or the other")
        given = Path(adapter)
        target = (next((given / n for n in ADAPTER_FILES if (given / n).exists()),
                       given / ADAPTER_FILE) if given.is_dir() else given)
        adapter_ckpt = discover(target, command="merge")
        structure.raise_first(structure.check(adapter_ckpt.info, adapter_ckpt.canonical())
                              if adapter_ckpt.info is not None else [])
        found = parse([(t.name, t.tensor) for t in adapter_ckpt.tensors])
        if found is None or not found.modules:
            raise InputError(f"{target}: holds no LoRA matrices (lora_A / lora_B); pass a PEFT "
                             "adapter directory to --adapter")
        found = as_adapter_file(found)
        found_config = hf.find_adapter_config(target.parent, explicit, given=given)
        if found_config is None:
            raise missing_config(str(given))
        config = read_config(found_config.doc, str(found_config.path))
        reader = open_reader(adapter_ckpt)
        try:
            sources = plan_fuse(found, config, base=named, adapter_reader=reader)
        except BaseException:
            reader.close()
            raise
        report = LoraMerge("fuse", describe(found, config), adapter=str(given),
                           fused=sum(isinstance(s, Derived) for _, s in sources))
        return Adapted("fuse", sources, report, reader=reader)
    if found is None:
        if mode is not None:
            raise InputError(f"{ckpt.path}: holds no LoRA adapter (no lora_A / lora_B "
                             "tensors); --lora applies to PEFT checkpoints only")
        return None
    assert ckpt.info is not None
    known = find_config(ckpt.root if ckpt.root.is_dir() else ckpt.info.base, explicit,
                        given=ckpt.path, layout=found, alpha=lora_alpha)
    chosen = mode or ("fuse" if found.has_base else "adapter")
    if known.config is None and chosen == "fuse":
        raise missing_config(str(ckpt.path))
    if known.config is None:
        raise missing_alpha(str(ckpt.path))
    if chosen == "fuse":
        assert known.config is not None
        config = known.config
        if not found.has_base:
            raise InputError(
                f"{ckpt.path}: holds the LoRA adapter alone, no base weights to fold it into; "
                f"write it with --lora adapter, then fold it into the base model with: "
                f"ckpttool merge BASE OUT --adapter ADAPTER_OUT")
        sources = plan_fuse(found, config)
        report = LoraMerge("fuse", describe(found, config),
                           fused=sum(isinstance(s, Derived) for _, s in sources),
                           other=f"the adapter alone instead: {other}")
        return Adapted("fuse", sources, report)
    adapter_sources: list[tuple[str, Tensor | Derived]] = list(plan_adapter(found))
    report = LoraMerge("adapter", describe(found, known.config),
                       other=("a full model with the adapter folded in instead: --lora fuse")
                       if found.has_base else None,
                       config_from=known.source, assumed=list(known.assumed))
    return Adapted("adapter", adapter_sources, report, config_bytes=known.text)


def verify_adapter(ckpt: Checkpoint, model: Checkpoint, explicit: Path | None, *,
                   follow_links: bool) -> tuple[AdapterSummary | None, list[Problem]]:
    """verify's LoRA checks: the adapter's description (None without one) and its problems
    (no alpha, shapes against the config, matrices never trained)."""
    layout, config, found = adapter_of(model, explicit)
    if layout is None or not layout.modules:
        return None, found
    found = found + problems(layout, config)
    with open_reader(ckpt, follow_links=follow_links) as reader:
        found += never_trained(reader, layout)
    return describe(layout, config), found
