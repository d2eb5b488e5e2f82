"""The one recogniser: a path -> the checkpoint(s) in it, with one rule set for every command.

A path is a checkpoint when a format of the registry claims it (by names and first bytes), and
then that format's ``read_info`` describes it or says precisely why it cannot: a claimed
directory whose metadata is missing, truncated or unsafe is an error, never "other". A path no
format claims is a training checkpoint directory (accelerate's ``checkpoint-500/``...): each
entry is listed with what it is, and its single model checkpoint is chosen (or, with no model,
its single optimizer checkpoint). Pickles and unknown files are listed, never opened.

The result is a :class:`Checkpoint`: the neutral description plus what core adds (canonical
names, model or optimizer, the Hugging Face files beside it, the other parts of a training
directory).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from ckpttool.core.checkpoint import hf, names
from ckpttool.core.checkpoint.parts import MODEL, OPTIMIZER, OTHER, Content, Label, classify
from ckpttool.core.checkpoint.parts import contents as contents_of
from ckpttool.core.checkpoint.parts import describe as describe_content
from ckpttool.errors import InputError, UnsupportedError
from ckpttool.formats import registry, safetensors, torchfile
from ckpttool.formats.base import CheckpointInfo, ChunkColumns, ObjectEntry, Reader, Tensor
from ckpttool.formats.codecs.dtypes import DType
from ckpttool.storage.store import LOCAL, Stores

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of one chunk

# Entries of a training directory that are checkpoints a user may mean, by preference: a
# PEFT adapter file (adapter_model.safetensors) beside the model it was trained on is chosen
# only when there is no model.
_CHECKPOINT_KINDS = ("model", "adapter", "optimizer")


@dataclass(frozen=True)
class Part:
    """One entry of a training checkpoint directory and what it is (the same JSON object in
    every report)."""

    path: str  # relative to the directory
    kind: str  # "model", "optimizer", "adapter" (a PEFT adapter file) or "other"
    format: str  # a format's NAME, or "pickle", "json", "directory", "file"
    note: str = ""

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "kind": self.kind, "format": self.format, "note": self.note}


@dataclass(frozen=True)
class TensorView:
    """A stored tensor under its canonical name."""

    name: str  # canonical: wrapper segments and accelerate's "model" level removed
    tensor: Tensor
    part: str = MODEL  # what it is: core.parts.PARTS
    root: str | None = None  # the top-level key nesting it that no name inside its part has

    @property
    def stored_name(self) -> str:
        return self.tensor.name

    @property
    def path(self) -> tuple[str, ...]:
        return self.tensor.path

    @property
    def dtype(self) -> DType:
        return self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    @property
    def boxes(self) -> tuple[Box, ...]:
        chunks = self.tensor.chunks
        if isinstance(chunks, ChunkColumns):  # millions of chunks: no Chunk built
            return chunks.boxes()
        return tuple((c.offsets, c.sizes) for c in chunks)

    @property
    def files(self) -> tuple[str, ...]:
        return self.tensor.files

    @property
    def numel(self) -> int:
        return self.tensor.numel

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


@dataclass(frozen=True)
class ObjectView:
    name: str  # canonical
    entry: ObjectEntry
    part: str = MODEL
    root: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    """What a path holds, from metadata and headers only."""

    path: Path  # as given
    info: CheckpointInfo | None  # None: a directory holding several checkpoints (no choice)
    kind: str  # "model" or "optimizer"
    tensors: tuple[TensorView, ...]  # in stored order
    objects: tuple[ObjectView, ...]
    parts: tuple[Part, ...]  # entries of a training checkpoint directory (empty otherwise)
    hf: hf.HfFiles
    note: str | None = None  # why no checkpoint was chosen
    chosen: str | None = None  # the part chosen from a training directory
    others: tuple[tuple[str, CheckpointInfo], ...] = ()  # its other checkpoints
    top: str | None = None  # the nesting key no name has, when one part was selected
    # Files beside the checkpoint that hold the rest of its training state (Lightning's
    # meta.pt), read weights-only; verified with it, listed in its contents.
    side: tuple[tuple[str, CheckpointInfo], ...] = ()
    side_notes: tuple[str, ...] = ()  # side files that could not be read, and why
    # Where its bytes are: what opens the store its reader is given (an object tree for a
    # checkpoint in object storage).
    stores: Stores = LOCAL

    @property
    def root(self) -> Path:
        return self.info.root if self.info is not None else self.path

    @property
    def format(self) -> str:
        return self.info.format if self.info is not None else "none"

    @property
    def top_level(self) -> str:
        return self.top if self.top is not None else top_level(self.kind)

    def by_name(self) -> dict[str, TensorView]:
        return {t.name: t for t in self.tensors}

    def contents(self) -> list[Content]:
        """Its parts (model, optimizer, lr_scheduler...), with those of its side files."""
        found = contents_of([(t.part, t.path, t.nbytes) for t in self.tensors]
                               + [(o.part, o.entry.path or (o.name,), None)
                                  for o in self.objects])
        for name, info in self.side:
            labels = _labels(info)
            n = len(info.tensors)
            found += contents_of(
                [(lab.part, t.path, t.nbytes)
                 for t, lab in zip(info.tensors, labels[:n], strict=True)]
                + [(lab.part, o.path or (o.name,), None)
                   for o, lab in zip(info.objects, labels[n:], strict=True)], file=name)
        return found

    def has_part(self, part: str) -> bool:
        return any(t.part == part for t in self.tensors)

    def canonical(self) -> dict[str, str]:
        """Stored name -> canonical name."""
        return {t.stored_name: t.name for t in self.tensors}


def _labels(info: CheckpointInfo) -> list[Label]:
    """The part of every tensor, then of every object
    (:func:`ckpttool.core.checkpoint.parts.classify`)."""
    return classify([(t.path or (t.name,), True) for t in info.tensors]
                          + [(o.path or (o.name,), False) for o in info.objects])


def kind_of(info: CheckpointInfo) -> str:
    """``"optimizer"`` when every entry is optimizer state, else ``"model"``."""
    labels = _labels(info)
    if labels and all(lab.part == OPTIMIZER for lab in labels):
        return "optimizer"
    return "model"


def _name(path: tuple[str, ...], stored: str, label: Label, whole: str) -> str:
    """An entry's canonical name: inside its part when that part is what is described
    (``whole``: the checkpoint's kind, or a selected part), else the full key path."""
    if not path:
        return stored
    if label.part == whole:
        return names.canonical_fqn(path, label.root or top_level(whole))
    return names.strip_wrappers(".".join(path))


def top_level(kind: str) -> str:
    """The nesting key that is not part of any name: accelerate's ``model`` for a model."""
    return "optimizer" if kind == "optimizer" else names.TOP_LEVEL_WRAPPER


def describe(path: Path, info: CheckpointInfo, *, config: Path | None = None,
             parts: tuple[Part, ...] = (), chosen: str | None = None,
             others: tuple[tuple[str, CheckpointInfo], ...] = (), stores: Stores = LOCAL
             ) -> Checkpoint:
    """``info`` under canonical names, with its Hugging Face files (``stores``: where its
    bytes are, as for :func:`discover`).

    Raises:
        InputError: two stored names collapse into one canonical name.
    """
    labels = _labels(info)
    kind = ("optimizer" if labels and all(lab.part == OPTIMIZER for lab in labels)
            else "model")
    n = len(info.tensors)
    renamed = names.unique_names((t.name, _name(t.path, t.name, lab, kind))
                                 for t, lab in zip(info.tensors, labels[:n], strict=True))
    tensors = tuple(TensorView(renamed[t.name], t, lab.part, lab.root)
                    for t, lab in zip(info.tensors, labels[:n], strict=True))
    objects = tuple(ObjectView(_name(o.path, o.name, lab, kind), o, lab.part, lab.root)
                    for o, lab in zip(info.objects, labels[n:], strict=True))
    hf_dir = info.root if stores.is_dir(info.root) else info.base
    files = (hf.HfFiles(None, None, ()) if kind == "optimizer" and config is None
             else hf.find_hf_files(hf_dir, config,
                                   given=path if stores.is_dir(path) else path.parent,
                                   stores=stores))
    side, notes = _side_files(info, stores)
    return Checkpoint(path, info, kind, tensors, objects, parts, files, chosen=chosen,
                      others=others, side=side, side_notes=notes, stores=stores)


def select(ckpt: Checkpoint, part: str) -> Checkpoint:
    """``ckpt`` narrowed to one part, named as a merge of that part writes it: the model
    under its canonical names, the optimizer state without its top-level key
    (``state.<fqn>.exp_avg``). Pure.

    Raises:
        InputError: ``ckpt`` holds no tensors of that part (the message says what it holds),
            or two of its names collapse into one.
    """
    tensors = [t for t in ckpt.tensors if t.part == part]
    if not ckpt.tensors:
        return ckpt  # nothing to narrow: the caller says what is there instead
    if not tensors:
        raise InputError(_no_part(ckpt, part))
    if part == ckpt.kind and all(t.part == part for t in ckpt.tensors) and all(
            o.part == part for o in ckpt.objects):
        return ckpt
    renamed = names.unique_names(
        (t.stored_name, _name(t.path, t.stored_name, Label(part, t.root), part))
        for t in tensors)
    chosen = tuple(replace(t, name=renamed[t.stored_name]) for t in tensors)
    objects = tuple(replace(o, name=_name(o.entry.path, o.entry.name, Label(part, o.root),
                                          part))
                    for o in ckpt.objects if o.part == part)
    roots = sorted({t.root for t in chosen if t.root is not None})
    files = ckpt.hf if part == MODEL else hf.HfFiles(None, None, ())
    return replace(ckpt, kind=part, tensors=chosen, objects=objects, hf=files,
                   top=roots[0] if roots else top_level(part))


def _no_part(ckpt: Checkpoint, part: str) -> str:
    held = ckpt.contents()
    what = "; ".join(describe_content(c) for c in held) or "nothing"
    where = ckpt.info.root if ckpt.info is not None else ckpt.path
    hint = ""
    if part == MODEL and any(c.part == OPTIMIZER and c.num_tensors
                             for c in held):
        hint = f"; to merge its optimizer state: ckpttool merge {ckpt.path} OUT --part optimizer"
    stray = [k for c in held if c.part == OTHER and c.num_tensors for k in c.keys]
    if part == MODEL and stray:
        hint += (f"; the tensors under {', '.join(stray)} are not recognised as model weights "
                 "(a model is stored flat, or under a key such as 'model')")
    return f"{where}: holds no {part} tensors; it holds {what}{hint}"


# Side files of a DCP directory that hold the rest of the training state (Lightning's
# fabric.save writes meta.pt beside the .distcp files).
_SIDE_SUFFIXES = (".pt",)


def _side_files(info: CheckpointInfo, stores: Stores
                ) -> tuple[tuple[tuple[str, CheckpointInfo], ...], tuple[str, ...]]:
    if not info.sharded or not stores.is_dir(info.root):
        return (), ()
    # Here, not at the top: only a sharded checkpoint has side files (the registry imports a
    # format when it is tried, and a safetensors file never tries this one).
    from ckpttool.formats import rank_files

    found = []
    notes = []
    own = {f.name for f in info.files}  # the checkpoint's data files are not side files
    # A set of per-rank files beside them (verl's optimizer state): checked as one.
    for rank_set in rank_files.sets_beside(info.root, frozenset(own), stores):
        own.update(name for _, name in rank_set.files)
        try:
            found.append((rank_set.pattern,
                          rank_files.read_archives(info.root, rank_set, stores)))
        except (InputError, UnsupportedError) as e:
            notes.append(f"{rank_set.pattern}: not read ({e})")
    for name in sorted(stores.listdir(info.root)):
        p = info.root / name
        if (p.name in own or p.suffix not in _SIDE_SUFFIXES or p.is_symlink()
                or not torchfile.detect(p, stores)):
            continue
        try:
            found.append((p.name, torchfile.read_info(p, stores=stores)))
        except (InputError, UnsupportedError) as e:
            notes.append(f"{p.name}: not read ({e})")
    return tuple(found), tuple(notes)


def discover(path: str | os.PathLike[str], *, config: str | os.PathLike[str] | None = None,
             require: bool = True, command: str = "inspect", prefer: str | None = None,
             stores: Stores = LOCAL, iteration: int | None = None) -> Checkpoint:
    """Recognise and describe the checkpoint at ``path``. Reads no tensor data.

    Args:
        path: any checkpoint a format reads, or a training checkpoint directory holding one.
        config: a config.json (or its directory) instead of the one found beside it.
        require: raise when a directory holds several checkpoints (else describe its parts,
            with ``info`` None and ``note`` saying why).
        command: the command the user ran, for the next command a message suggests.
        prefer: the kind of checkpoint to take from a training directory that holds one of
            each (``"optimizer"``: accelerate's ``optimizer_0/`` beside the model, for
            ``merge --part optimizer``); default: its model.
        stores: where the bytes below ``path`` are (an object tree of object storage; local files
            by default); the checkpoint keeps it for :func:`open_reader`.
        iteration: of a Megatron-Core run directory, this iteration instead of the one
            ``latest_checkpointed_iteration.txt`` names.

    Raises:
        InputError: nothing readable there, a damaged or unsafe checkpoint, or (``require``)
            several checkpoints to choose from.
        UnsupportedError: a layout a format recognises but does not read yet.
    """
    given = Path(path)
    if iteration is not None:
        if not stores.is_dir(given) and given.name not in stores.listdir(given.parent):
            raise InputError(f"{given}: no such file or directory")
        given = registry.select_iteration(given, iteration, stores)
    return replace(_discover(given, config, require, command, prefer, stores),
                   stores=stores)


def _discover(given: Path, config: str | os.PathLike[str] | None, require: bool, command: str,
              prefer: str | None, stores: Stores) -> Checkpoint:
    config_path = Path(config) if config is not None else None
    is_file, is_dir = stores.file_size(given) is not None, stores.is_dir(given)
    if not (is_file or is_dir):
        if given.name not in stores.listdir(given.parent):
            raise InputError(f"{given}: no such file or directory")
        # A FIFO, a socket, a device: never opened.
        raise InputError(f"{given}: not a regular file or directory; pass the checkpoint "
                         "directory or file")
    piece = _dcp_piece(given) if is_file else None
    if piece is not None:
        raise InputError(piece)
    fmt = registry.detect(given, stores)
    if fmt is not None:
        info = fmt.read_info(given, stores=stores)
        if not is_dir or info.sharded:
            return describe(given, info, config=config_path, stores=stores)
        # Full weights at the top of a training directory (model.safetensors beside
        # optimizer_0/): the other checkpoints there are listed and checked too.
        parts, beside = list_parts(given, stores)
        return describe(given, info, config=config_path, parts=parts if beside else (),
                        others=tuple(beside.items()), stores=stores)
    if is_file:
        raise InputError(_not_a_checkpoint_file(given))
    parts, infos = list_parts(given, stores)
    chosen = _choose(parts, prefer)
    if chosen is None:
        message = _no_choice(given, parts, command, stores)
        if require or not any(registry.is_format(p.format) for p in parts):
            raise InputError(message)
        return Checkpoint(given, None, "model", (), (), parts,
                          hf.find_hf_files(given, config_path, stores=stores), note=message)
    target = given / chosen.path
    info = infos.get(chosen.path) or _read(target, stores)
    others = tuple((name, i) for name, i in infos.items() if name != chosen.path)
    return describe(given, info, config=config_path, parts=parts, chosen=chosen.path,
                    others=others, stores=stores)


def open_reader(ckpt: Checkpoint, *, follow_links: bool = False) -> Reader:
    """The chosen checkpoint's bytes, through its format's reader.

    Args:
        follow_links: read data files that are links out of the checkpoint directory
            (shared-storage layouts); refused otherwise.
    """
    info = ckpt.info
    if info is None:
        raise InputError(f"{ckpt.path}: holds no single checkpoint to read")
    store = ckpt.stores.open(info.base, metadata_name=info.metadata_name,
                             follow_links=follow_links)
    return registry.by_name(info.format).open_reader(info, store=store)


def _read(path: Path, stores: Stores) -> CheckpointInfo:
    fmt = registry.detect(path, stores)
    if fmt is None:  # listed as a checkpoint, so claimed: only a race gets here
        raise InputError(f"{path}: no longer a checkpoint")
    return fmt.read_info(path, stores=stores)


def _dcp_piece(file: Path) -> str | None:
    """Why ``file`` is a piece of a DCP checkpoint (a data file, ``.metadata``), or None;
    DCP's module is loaded only for a name that may be one (``inspect x.safetensors``
    loads no directory format)."""
    if not file.name.endswith((".distcp", ".metadata")):
        return None
    from ckpttool.formats.dcp import reader

    return reader.piece_of(file)


def _not_a_checkpoint_file(file: Path) -> str:
    if file.suffix == ".pkl":
        return (f"{file}: a Python pickle, not a checkpoint; ckpttool never unpickles "
                "arbitrary pickles")
    return (f"{file}: not a checkpoint file (expected .safetensors, or a torch.save .bin/.pt "
            "state dict)")


def _no_choice(given: Path, parts: Iterable[Part], command: str, stores: Stores) -> str:
    from ckpttool.core.checkpoint.runs import run_message

    run = run_message(given, command, stores)
    if run is not None:
        return run
    parts = list(parts)
    out = " OUT" if command in ("merge", "reshard") else ""
    for kind in _CHECKPOINT_KINDS:
        found = [p.path for p in parts if p.kind == kind and registry.is_format(p.format)]
        sets = _shard_sets(found)
        if sets is not None:
            return (f"{given}: holds shards of {sets} and no index: files of two saves, or a "
                    "save that did not finish (the index is written last); keep one complete "
                    "set with its index (copy it again from the source) and pass the "
                    "directory again")
        if len(found) > 1:
            return (f"{given}: holds {len(found)} {kind} checkpoints ({', '.join(found)}); pass "
                    f"one of them, e.g. ckpttool {command} {given / found[0]}{out}")
    return (f"{given}: no checkpoint here (no .metadata, *.safetensors or torch.save file, "
            "here or in a subdirectory); pass the directory training saved, e.g. "
            "checkpoint-500/pytorch_model_fsdp_0")




_SHARD_NAME = re.compile(r"(.+)-\d{5}-of-(\d{5})\.safetensors")


def _shard_sets(names: list[str]) -> str | None:
    """"2 sets: model-*-of-00002 (2 of 2), model-*-of-00003 (1 of 3)" when ``names`` are all
    shards of several sets, one of them incomplete (none has its index, or it would be one
    checkpoint), else None."""
    counts: dict[tuple[str, str], int] = {}
    for name in names:
        m = _SHARD_NAME.fullmatch(name)
        if m is None:
            return None
        counts[(m[1], m[2])] = counts.get((m[1], m[2]), 0) + 1
    if len(counts) < 2 or all(n == int(of) for (_, of), n in counts.items()):
        return None  # complete sets each (files of several writers): named one by one
    listed = ", ".join(f"{stem}-*-of-{of} ({n} of {int(of)})" for (stem, of), n in
                       sorted(counts.items()))
    return f"{len(counts)} sets: {listed}"


def _choose(parts: tuple[Part, ...], prefer: str | None = None) -> Part | None:
    """The one checkpoint a directory holds: its single model, else its single optimizer
    (``prefer`` first, where there is one of that kind); None when there are several or
    none."""
    kinds = sorted(_CHECKPOINT_KINDS, key=lambda k: k != prefer)
    for kind in kinds:
        found = [p for p in parts if p.kind == kind and registry.is_format(p.format)]
        if found:
            return found[0] if len(found) == 1 else None
    return None


# --------------------------------------------------------------------------------------------
# Training checkpoint directories


def list_parts(directory: Path, stores: Stores = LOCAL
               ) -> tuple[tuple[Part, ...], dict[str, CheckpointInfo]]:
    """Every entry of ``directory``, sorted, with its kind and format, and the checkpoints
    read (subdirectories), by entry name. Files are classified by name and first bytes and
    never read here; pickles are never opened.

    Raises:
        InputError, UnsupportedError: a subdirectory a format claims cannot be read (the
            error names the file), so that a damaged model is never taken for "other".
    """
    parts = []
    infos: dict[str, CheckpointInfo] = {}
    for name, size in sorted(stores.listdir(directory).items()):
        p = directory / name
        if size is None and stores.is_dir(p):
            fmt = registry.detect(p, stores)
            if fmt is None:
                parts.append(Part(p.name, "other", "directory"))
                continue
            info = infos[p.name] = fmt.read_info(p, stores=stores)
            parts.append(Part(p.name, kind_of(info), fmt.NAME,
                              f"{_count(len(info.tensors), 'tensor')}, "
                              f"{_count(len(info.files), 'file')}"))
        else:
            parts.append(_file_part(p, stores))
    return tuple(parts), infos


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _file_part(p: Path, stores: Stores) -> Part:
    name = p.name
    stem_kind = ("optimizer" if name.startswith("optimizer")
                 else "model" if name.startswith(("pytorch_model", "model")) else "other")
    if p.suffix in torchfile.SUFFIXES:
        fmt = torchfile.NAME if torchfile.detect(p, stores) else "file"
        return Part(name, stem_kind, fmt)
    if p.suffix == ".safetensors":
        if not safetensors.detect(p, stores):
            return Part(name, "other", "file")
        # Any loose safetensors file may be a model: with another candidate beside it, the
        # user chooses (never a silent pick of the wrong one).
        kind = ("optimizer" if "optimizer" in p.stem
                else "adapter" if p.stem.startswith("adapter_model") else "model")
        return Part(name, kind, safetensors.NAME)
    if p.suffix == ".pkl":
        return Part(name, "other", "pickle", "not unpickled")
    if p.suffix == ".json":
        return Part(name, "other", "json")
    return Part(name, "other", "file")
