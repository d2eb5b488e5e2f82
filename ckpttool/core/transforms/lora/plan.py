"""LoRA planning: the checks merge and verify share, the plans (fold into the base or
export the adapter), a merged model that is still its base, and the wiring into ``merge()``
and ``verify()``."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.core.checkpoint import hf, structure
from ckpttool.core.checkpoint.discover import discover, open_reader
from ckpttool.core.transforms.derive import Derived
from ckpttool.core.transforms.lora.fold import fused_bias, fused_weight
from ckpttool.core.transforms.lora.layout import (
    ADAPTER_FILE,
    ADAPTER_FILES,
    MAX_JSON,
    MODES,
    PREFIX,
    AdapterConfig,
    Layout,
    Module,
    adapter_of,
    as_adapter_file,
    find_config,
    missing_alpha,
    missing_config,
    parse,
    read_config,
)
from ckpttool.core.transforms.lora.report import (
    AdapterSummary,
    LoraMerge,
    describe,
    never_trained,
)
from ckpttool.errors import InputError, UnsupportedError, UsageError
from ckpttool.formats.base import Problem, Reader, Tensor, error, info, warning
from ckpttool.storage.store import LOCAL, Stores

if TYPE_CHECKING:

    from ckpttool.core.checkpoint.discover import Checkpoint


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
            out.append((name, fused_weight(name, tensor, m, config, adapter_reader)))
        elif m is not None and leaf == "bias" and m.b_bias is not None:
            out.append((name, fused_bias(name, tensor, m, config, adapter_reader)))
        else:
            out.append((name, tensor))
    return out


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


def merged_adapter_config(root: Path, explicit: Path | None, *, stores: Stores = LOCAL
                          ) -> tuple[dict[str, Any] | None, str | None]:
    """The ``adapter_config.json`` a merged model says it was made from: ``--adapter-config``,
    PEFT's file beside it, or verl's ``lora_adapter/`` inside it (read through ``stores``).
    (None, None) if none.

    Raises:
        InputError: the file is not a JSON object, or ``explicit`` is missing.
    """
    found = (hf.find_adapter_config(root, explicit, given=root, stores=stores)
             or hf.read_record(root / MERGER_ADAPTER_DIR / hf.ADAPTER_CONFIG, MAX_JSON,
                               stores=stores))
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
    known = find_config(ckpt.root if ckpt.stores.is_dir(ckpt.root) else ckpt.info.base,
                        explicit, given=ckpt.path, layout=found, alpha=lora_alpha,
                        stores=ckpt.stores)
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
