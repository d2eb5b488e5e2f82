"""Megatron-Core ``torch_dist`` checkpoints: a run directory, or one ``iter_NNNNNNN/`` in it.

Megatron-LM (and Megatron-Bridge, NeMo, verl's and slime's Megatron backends) save with
``--ckpt-format torch_dist`` through ``megatron.core.dist_checkpointing.save``:

* ``RUN/latest_checkpointed_iteration.txt`` names the last iteration saved (a number, or
  ``release``); ``RUN/iter_0000500/`` holds it (``RUN/release/`` for ``release``);
* in it, a PyTorch DCP checkpoint (``.metadata``, ``__<rank>_<n>.distcp``) of the sharded
  state: the model's tensors as *global* Megatron tensors (tensor-, pipeline- and
  expert-parallel pieces are ordinary DCP chunks), the optimizer's under ``optimizer.*``, the
  RNG state as ``rng_state/shard_*`` bytes entries;
* ``common.pt``: a ``torch.save`` of the state that is not sharded (``args``, an
  ``argparse.Namespace``; ``iteration``; ``checkpoint_version``...); megatron-core 0.19 and
  later write it as the DCP bytes entry ``common_state/shard_0_1`` instead (a ``torch.save``
  record of ``[state]``), read by the same allow-list;
* ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), written last: without it the
  save did not finish.

The DCP part is read by :mod:`ckpttool.formats.dcp.reader` itself, with an allow-list that
adds inert stand-ins for what Megatron pickles into ``.metadata`` beside DCP's own classes
(torch's ``SavePlan`` / ``WriteItem`` of the central plan it caches, and ``MCoreMetadata`` /
``MCoreSavePlan`` of megatron-core 0.15 and older, with their ``mcore_data``). ``common.pt`` is
read by the :mod:`torchsave` allow-list unpickler plus an ``argparse.Namespace`` stand-in and
Megatron's enums as their names; nothing is executed. What the tensors mean (the stacked layer
axis, fused QKV, padded vocabulary) is the business of the name maps, not of this reader.

Not read (refused, exit 4, naming the layout): ``--ckpt-format torch`` (``mp_rank_XX/``
directories of ``model_optim_rng.pt``) and the ``zarr`` backend; and, for ``merge --part
optimizer`` only, the distributed optimizer's pre-0.14 ``flattened_range`` layout (its
``.metadata`` records ``nd_reformulated_orig_global_shape``), whose tensors are not the
parameters' shapes (``storage["unsupported_parts"]``; the model still merges).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

from ckpttool.errors import CkptError, InputError, UnsupportedError, UsageError
from ckpttool.formats.base import (
    CheckpointInfo,
    DataFile,
    ObjectEntry,
    Problem,
    Reader,
    TensorPlaceholder,
    UnreadableObject,
    error,
    warning,
)
from ckpttool.formats.base import info as info_problem
from ckpttool.formats.codecs import archive, policy, torchsave
from ckpttool.formats.dcp import reader
from ckpttool.formats.dcp.columns import METADATA_KIND
from ckpttool.formats.dcp.metadata import allowed_global
from ckpttool.storage import sidefiles
from ckpttool.storage.store import (
    LOCAL,
    Store,
    Stores,
    pread_of,
    read_blocks,
)

NAME = "megatron"
# What docs/formats.md says of it (generated: python -m ckpttool.cli.docs).
SUMMARY = ("a run with `latest_checkpointed_iteration.txt` and `iter_<N>/` holding "
           "`metadata.json` (`torch_dist`), a DCP `.metadata` and `__<rank>_<n>.distcp`")
WRITTEN_BY = ("Megatron-Core `dist_checkpointing` (Megatron-LM, Megatron-Bridge, NeMo, verl's "
              "and slime's Megatron backends)")
TRACKER = "latest_checkpointed_iteration.txt"
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
# An iteration number or "release".
_TRACKER = sidefiles.Kind("tracker file (an iteration number or release)", 64)
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_LEGACY_RE = re.compile(r"^mp_rank_\d\d(?:_\d{3})?$")


# --------------------------------------------------------------------------------------------
# Finding the iteration


def _is_iter_name(name: str) -> bool:
    return bool(_ITER_RE.match(name)) or name == "release"


def iteration_name(number: int | str) -> str:
    """The directory Megatron-LM saves iteration ``number`` in (``iter_0000500``)."""
    return "release" if number == "release" else f"iter_{int(number):07d}"


def _looks_like_iteration(path: Path, stores: Stores) -> bool:
    """An ``iter_*`` directory as a save leaves it, complete or not (names only)."""
    if not _is_iter_name(path.name):
        return False
    names = set(stores.listdir(path))
    return bool(names & {METADATA_JSON, reader.METADATA_FILE, COMMON}) or any(
        n.endswith(reader.DATA_SUFFIX) or _LEGACY_RE.match(n) for n in names)


def _read_tracker(run: Path, *, strict: bool = False, stores: Stores = LOCAL) -> str | None:
    """What the run's tracker says, or None where there is none (or, unless ``strict``, it
    is not a small regular file: recognising never waits on a FIFO).

    Raises:
        InputError: ``strict``, and the tracker is not a regular file within its cap.
    """
    tracker = run / TRACKER
    try:
        data = stores.read_small(tracker, _TRACKER)
    except FileNotFoundError:
        return None
    except InputError:
        if strict:
            raise
        return None
    except OSError:
        return None
    return data.decode("utf-8", "replace").strip()


def iterations(run: Path, stores: Stores = LOCAL) -> list[str]:
    """The ``iter_*`` directories of a run, sorted by iteration."""
    found = [n for n, size in stores.listdir(run).items()
             if size is None and _ITER_RE.match(n) and stores.is_dir(run / n)]
    return sorted(found, key=lambda n: int(n[5:]))


def detect(path: Path, stores: Stores = LOCAL) -> bool:
    """A run directory (``latest_checkpointed_iteration.txt`` beside an ``iter_*``) or an
    ``iter_*`` directory itself, complete or not (``read_info`` says what is missing)."""
    if _looks_like_iteration(path, stores):
        return True
    return stores.is_dir(path) and _read_tracker(path, stores=stores) is not None and (
        bool(iterations(path, stores)) or stores.is_dir(path / "release"))


def pending(path: Path) -> str | None:
    """An ``iter_*`` directory without ``metadata.json`` is a save still going on (Megatron
    writes it last), or one whose writer was killed."""
    if _is_iter_name(path.name) and not (path / METADATA_JSON).is_file():
        return f"no {METADATA_JSON} yet (Megatron writes it after every data file)"
    return None


def resolve(path: Path, iteration: int | None = None, stores: Stores = LOCAL) -> Path:
    """The iteration directory ``path`` means: itself, or the one the tracker (or
    ``iteration``) names in a run directory.

    Raises:
        InputError: the tracker names an iteration that is not there, or ``iteration`` is not.
    """
    if _is_iter_name(path.name) and TRACKER not in stores.listdir(path):
        if iteration is not None:
            raise UsageError(f"{path}: is one iteration already; pass the run directory "
                             f"{path.parent} with --iteration {iteration}")
        return path
    held = iterations(path, stores)
    if iteration is not None:
        chosen = path / iteration_name(iteration)
        if not stores.is_dir(chosen):
            raise InputError(f"{path}: has no iteration {iteration} ({chosen.name}); it holds "
                             f"{_listed(held)}")
        return chosen
    named = _read_tracker(path, strict=True, stores=stores)
    if named is None:
        raise InputError(f"{path}: {TRACKER} is missing or unreadable; pass one iteration "
                         f"directory ({_listed(held)})")
    if named != "release" and sidefiles.ascii_number(named) is None:
        raise InputError(f"{path / TRACKER}: holds {named[:32]!r}, not an iteration number; "
                         f"pass one iteration directory ({_listed(held)})")
    chosen = path / iteration_name(named)
    if not stores.is_dir(chosen):
        raise InputError(f"{path / TRACKER}: names iteration {named}, but {chosen.name}/ is "
                         f"not there; it holds {_listed(held)}: pass one of them")
    return chosen


def _listed(held: list[str]) -> str:
    if not held:
        return "no iter_* directory"
    shown = ", ".join(held[-4:])
    return f"{'..., ' if len(held) > 4 else ''}{shown}"


# --------------------------------------------------------------------------------------------
# The allow-lists: Megatron's additions to a .metadata and to common.pt, as inert stand-ins

_PLANNER = "torch.distributed.checkpoint.planner"
_MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"
_PLAN_CLASSES: dict[tuple[str, str], type[torchsave.PlainStub]] = {
    (_PLANNER, name): torchsave.plain_stub_class(name)
    for name in ("SavePlan", "WriteItem", "TensorWriteData", "LoadPlan", "ReadItem")
}
_PLAN_CLASSES[(_MCORE_TORCH, "MCoreSavePlan")] = torchsave.plain_stub_class("MCoreSavePlan")


def _enum_value(value: Any) -> Any:
    """An enum member as pickle rebuilds it (``Enum(value)``): its plain value."""
    if value is not None and not isinstance(value, (int, str)):
        raise pickle.UnpicklingError(f"enum value {value!r}")
    return value


def metadata_global(module: str, name: str) -> Any | None:
    """The allow-list of a torch_dist ``.metadata``: DCP's, plus torch's save-plan classes
    (Megatron caches its central plan in ``all_local_plans``) and megatron-core's
    ``MCoreMetadata`` (0.15 and older: DCP's ``Metadata`` with ``mcore_data``), each inert."""
    if module == _MCORE_TORCH and name == "MCoreMetadata":
        return allowed_global("torch.distributed.checkpoint.metadata", "Metadata")
    if (module, name) in _PLAN_CLASSES:
        return _PLAN_CLASSES[(module, name)]
    if module == _PLANNER and name in ("WriteItemType", "LoadItemType"):
        return _enum_value
    return allowed_global(module, name)


# Megatron's enums that ``args`` holds (``attention_backend``, ``model_type``...), as values.
_MEGATRON_ENUMS = frozenset({"AttnBackend", "ModelType", "AttnMaskType", "LayerType",
                             "Fp8Recipe", "CudaGraphScope", "PositionEmbeddingType",
                             "InferenceCudaGraphScope"})


def common_global(module: str, name: str) -> Any | None:
    """The allow-list of ``common.pt``: a tensor pickle's, ``argparse.Namespace`` and
    Megatron's enums (as their values)."""
    if module.startswith("megatron.") and name in _MEGATRON_ENUMS:
        return _enum_value
    return torchsave.record_global(module, name)  # argparse.Namespace: the pickle policy


def _plain(value: Any) -> Any:
    """An unpickled common-state value as plain data: ``args`` as a dict, tensors described."""
    if isinstance(value, torchsave.TensorRef):
        return TensorPlaceholder(value.dtype.name, value.shape)
    if isinstance(value, torchsave.UnknownDType):
        return value.torch_name
    if hasattr(value, "torch_name") and hasattr(value, "itemsize"):  # a torch dtype
        return str(value.torch_name)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def read_common(path: Path, stores: Stores = LOCAL) -> dict[str, Any] | UnreadableObject:
    """``common.pt``'s top-level entries as plain values (never executed), or why not.

    Raises:
        InputError: it is not a torch.save file, or is truncated or corrupt.
    """
    try:
        with stores.side_file(path, sidefiles.COMMON_STATE) as f:
            size = f.seek(0, 2)

            def pread(n: int, offset: int) -> bytes:  # never past the end (a damaged size)
                f.seek(offset)
                return f.read(max(0, min(n, size - offset)))

            rb, entries = archive.open_file_archive(
                pread, str(path), "copy it again from the run's iteration directory",
                size=size)
            return _load_common(rb, entries, str(path), wrapped=False)
    except FileNotFoundError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None


# megatron-core 0.19 and later: the common state is one ShardedObject, ``common_state``,
# saved as a DCP bytes entry (a torch.save record of ``[state]``) instead of common.pt.
COMMON_STATE = "common_state"


def common_state_entry(objects: tuple[ObjectEntry, ...] | list[ObjectEntry]
                       ) -> ObjectEntry | None:
    """The ``common_state/shard_*`` entry of a torch_dist ``.metadata``, if it has one."""
    return next((o for o in objects if o.name.startswith(f"{COMMON_STATE}/")
                 and o.file is not None), None)


def read_common_state(root: Path, entry: ObjectEntry, *, stores: Stores = LOCAL
                      ) -> dict[str, Any] | UnreadableObject:
    """The ``common_state`` bytes entry's top-level values (as :func:`read_common`'s), read
    through ``stores`` from a regular file really inside ``root``.

    Raises:
        InputError: its record is truncated or corrupt, or its file not a regular file.
    """
    assert entry.file is not None
    path = root / entry.file
    where = f"{path}: entry '{entry.name}' at byte {entry.offset}"
    try:
        with pread_of(path, stores, inside=os.path.realpath(root)) as pread:
            return _common_record(archive.RecordBytes(pread, entry.offset, entry.length,
                                                      where), where)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None


def _common_record(rb: archive.RecordBytes, where: str) -> dict[str, Any] | UnreadableObject:
    entries = archive.zip_entries(rb)
    archive.check_byteorder(rb, entries)
    return _load_common(rb, entries, where, wrapped=True)


def _load_common(rb: archive.RecordBytes, entries: dict[str, archive.ZipEntry], where: str, *,
                 wrapped: bool) -> dict[str, Any] | UnreadableObject:
    """The common state's pickle, read with :func:`common_global` (``wrapped``: the
    ShardedObject's one-element list around it)."""
    if "data.pkl" not in entries:
        raise InputError(f"{where}: no data.pkl; not a torch.save record of the common state, "
                         "corrupt: copy it again")
    try:
        value = torchsave.load_pickle(rb, entries, lookup=common_global,
                                      max_nodes=torchsave.OBJECT_MAX_NODES)
    except torchsave.Refused as e:
        data = rb.read(entries["data.pkl"].data_offset, entries["data.pkl"].size)
        read = UnreadableObject(e.qualname, names=torchsave.named_globals(data))
        code = runs_code(read)
        if code is not None:
            read.why = (f"the pickle asks for '{code}', which runs code: the file may be "
                        "malicious (nothing was executed)")
        return read
    except torchsave.TooComplex as e:
        return UnreadableObject(None, str(e))
    except torchsave.PICKLE_ERRORS as e:
        raise InputError(f"{where}: corrupt common state ({e}); copy it again") from None
    except RecursionError:
        raise _too_deep(where) from None
    if wrapped and isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        raise InputError(f"{where}: holds a {type(value).__name__}, not Megatron's common "
                         "state dict; corrupt")
    try:
        return {str(k): _plain(v) for k, v in value.items()}
    except RecursionError:
        raise _too_deep(where) from None


def _too_deep(where: str) -> InputError:
    return InputError(f"{where}: the common state's values are nested too deeply to be "
                      "Megatron's; corrupt: copy it again")


# --------------------------------------------------------------------------------------------
# The checkpoint


def _layout(args: dict[str, Any], iteration: Any, backend: str) -> dict[str, Any]:
    """What ``inspect`` shows of the run: iteration, parallel layout and model geometry."""
    def arg(key: str) -> Any:
        value = args.get(key)
        return value if isinstance(value, (int, float, str, bool)) else None

    heads = arg("num_attention_heads")
    groups = arg("num_query_groups") if args.get("group_query_attention") else heads
    return {
        "backend": backend, "iteration": iteration,
        "tensor_parallel": arg("tensor_model_parallel_size"),
        "pipeline_parallel": arg("pipeline_model_parallel_size"),
        "expert_parallel": arg("expert_model_parallel_size"),
        "num_layers": arg("num_layers"), "hidden_size": arg("hidden_size"),
        "ffn_hidden_size": arg("ffn_hidden_size"), "num_attention_heads": heads,
        "num_query_groups": groups, "kv_channels": arg("kv_channels"),
        "padded_vocab_size": arg("padded_vocab_size"), "num_experts": arg("num_experts"),
        "mtp_num_layers": arg("mtp_num_layers"),
        "untie_embeddings_and_output_weights": arg("untie_embeddings_and_output_weights"),
    }


def describe_layout(layout: dict[str, Any]) -> str:
    """``Megatron-Core torch_dist, iteration 500, TP 2 x PP 1 x EP 1, 32 layers...``."""
    words = [f"Megatron-Core {layout['backend']}"]
    if layout.get("iteration") is not None:
        words.append(f"iteration {layout['iteration']}")
    par = [f"{k} {layout[v]}" for k, v in (("TP", "tensor_parallel"), ("PP", "pipeline_parallel"),
                                          ("EP", "expert_parallel")) if layout.get(v)]
    if par:
        words.append(" x ".join(par))
    geometry = [f"{layout[k]} {w}" for k, w in (
        ("num_layers", "layers"), ("hidden_size", "hidden"), ("ffn_hidden_size", "ffn"),
        ("num_attention_heads", "heads"), ("num_query_groups", "query groups"),
        ("kv_channels", "head dim"), ("num_experts", "experts"),
        ("padded_vocab_size", "vocab (padded)"), ("mtp_num_layers", "MTP layers"))
        if layout.get(k)]
    if geometry:
        words.append(", ".join(geometry))
    if layout.get("optimizer_layout") == "flattened_range":
        words.append("optimizer state in the flattened_range layout (merge --part optimizer "
                     "refuses it)")
    return "; ".join(words)


_OPTIMIZER_OBJECT = re.compile(r"(chained_\d+\.)?optimizer\.")


def _path_of(name: str) -> tuple[str, ...]:
    """A key's path for part classification: a sharded object's ``name/shard_*`` suffix is a
    level below its key (``rng_state/shard_0.0_1.1`` is under ``rng_state``)."""
    key, sep, shard = name.partition("/")
    if not sep:
        return (name,)
    # The optimizer's objects (``optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1``,
    # a ChainedOptimizer's ``chained_0.optimizer...``) sit under their first key like its
    # tensors (``optimizer.distributed...bucket_idx_0.exp_avg``), so they share its part.
    top, dot, rest = key.partition(".")
    return (top, rest, shard) if dot and _OPTIMIZER_OBJECT.match(key) else (key, shard)


def read_info(path: str | os.PathLike[str], *, iteration: int | None = None,
              stores: Stores = LOCAL) -> CheckpointInfo:
    """Read a run's (or one iteration's) metadata: DCP's ``.metadata``, ``metadata.json`` and
    the common state. Reads no tensor data.

    Args:
        iteration: read this iteration of a run directory instead of the tracker's.

    Raises:
        InputError: an incomplete save (no ``metadata.json``), a tracker naming a missing
            iteration, damaged or unsafe metadata.
        UnsupportedError: ``--ckpt-format torch`` or another backend than ``torch_dist``.
    """
    given = Path(path)
    root = resolve(given, iteration, stores)
    listed = stores.listdir(root)
    names = sorted(listed)
    if any(_LEGACY_RE.match(n) for n in names):
        raise UnsupportedError(
            f"{root}: a Megatron checkpoint in the legacy --ckpt-format torch layout "
            "(mp_rank_XX/model_optim_rng.pt per rank); not supported yet. Save with "
            "--ckpt-format torch_dist, or convert it with Megatron's checkpoint converter")
    if METADATA_JSON not in names:
        complete = [n for n in iterations(root.parent, stores)
                    if stores.file_size(root.parent / n / METADATA_JSON) is not None]
        hint = f"; complete iterations beside it: {_listed(complete)}" if complete else ""
        raise InputError(
            f"{root}: no {METADATA_JSON}, which Megatron writes last: this save is incomplete "
            f"(interrupted, or only partly copied){hint}")
    config = _read_json(root / METADATA_JSON, stores)
    backend = str(config.get("sharded_backend"))
    if backend != "torch_dist":
        raise UnsupportedError(f"{root}: a Megatron-Core checkpoint with the '{backend}' "
                               "sharded backend; ckpttool reads torch_dist (the default of "
                               "--ckpt-format torch_dist) only")
    # Megatron's ShardedObjects (rng_state/shard_*...) are opaque records of one rank each,
    # not an unflattened state dict: kept whole, as non-tensor entries.
    base = reader.read_info(root, lookup=metadata_global, open_nested=False, stores=stores)
    problems = list(base.problems)
    values = dict(base.values)
    common: dict[str, Any] = {}
    objects = [replace(o, path=_path_of(o.name)) for o in base.objects]
    stored = common_state_entry(base.objects) if COMMON not in names else None
    if stored is not None and stores.file_size(root / (stored.file or "")) is None:
        stored = None  # a missing (or not regular) data file is a structure problem
    if COMMON in names or stored is not None:
        label = COMMON if stored is None else stored.name
        read = (read_common(root / COMMON, stores) if stored is None
                else read_common_state(root, stored, stores=stores))
        if isinstance(read, UnreadableObject):
            values[label] = read
            if stored is None:
                objects.append(ObjectEntry(COMMON, (COMMON,)))
            code = runs_code(read)
            problems.append((info_problem if code is None else warning)(
                "common-not-read", f"{label}: {read.why}; "
                f"{'' if code else 'not executed, so '}args and the iteration are not shown",
                file=COMMON if stored is None else stored.file))
        else:
            common = read
            # Read already: its values stand in for the record, as common.pt's do.
            objects = [o for o in objects if o.name != label]
            for key, value in read.items():
                values[key] = value
                objects.append(ObjectEntry(key, (key,)))
    tensors = [t if len(t.path) != 1 or "/" not in t.name else replace(t, path=_path_of(t.name))
               for t in base.tensors]
    found = common.get("args")
    args: dict[str, Any] = found if isinstance(found, dict) else {}
    layout = _layout(args, common.get("iteration", _iteration_of(root)), backend)
    storage: dict[str, Any] = {}
    if _flattened_optimizer(root / reader.METADATA_FILE, stores):
        layout["optimizer_layout"] = "flattened_range"
        storage["unsupported_parts"] = {"optimizer": (
            f"{root}: the optimizer state is Megatron-Core's distributed optimizer in its "
            "flattened_range layout (N-D flattened shards, 'nd_reformulated_orig_global_shape' "
            "in .metadata, written by megatron-core before 0.14), whose tensors do not have "
            "the parameters' shapes; not supported yet. The model merges without --part "
            "optimizer; for the optimizer state, re-save the run with megatron-core 0.14 or "
            "later, which stores it as plain chunks")}
        problems.append(info_problem(
            "megatron-flattened-optimizer", "the optimizer state is in Megatron-Core's "
            "flattened_range layout (megatron-core before 0.14): merge --part optimizer "
            "refuses it; the model merges", file=reader.METADATA_FILE))
    files = base.files
    if COMMON in names:  # a file of the checkpoint: verify checks it is there, never a side file
        files = (*files, DataFile(COMMON, stores.file_size(root / COMMON)))
    return replace(
        base, format=NAME, tensors=tuple(tensors), objects=tuple(objects), files=files,
        problems=tuple(problems), values=values,
        storage={**base.storage, **storage, "framework": describe_layout(layout),
                 "megatron": layout})


def runs_code(read: UnreadableObject) -> str | None:
    """The first global an unread common state names that runs code (the pickle policy's
    verdict, :func:`ckpttool.formats.codecs.policy.kind`), or None."""
    for name in read.names:
        module, _, attr = name.rpartition(".")
        if module and policy.kind(module, attr) == policy.RUNS_CODE:
            return name
    return None


# What megatron-core before 0.14 recorded in ``MCoreMetadata.mcore_data`` for each N-D
# flattened tensor (the distributed optimizer's ``flattened_range`` shards saved as a
# ``[X // x, ..., x * y * z]`` tensor): the shape it stands for.
_FLATTENED_MARK = b"nd_reformulated_orig_global_shape"


def _flattened_optimizer(metadata: Path, stores: Stores = LOCAL) -> bool:
    """True if the ``.metadata`` records N-D flattened tensors (found in its bytes: the key
    is a pickled string; a local file was read whole already, so it is in the page cache)."""
    import mmap

    try:
        with stores.side_file(metadata, METADATA_KIND) as f:
            try:
                fd = f.fileno()
            except (OSError, io.UnsupportedOperation):  # remote: read by ranged GETs
                return _holds(f, _FLATTENED_MARK)
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
                return m.find(_FLATTENED_MARK) >= 0
    except (OSError, ValueError, CkptError):
        return False


def _holds(f: BinaryIO, mark: bytes) -> bool:
    """Whether the file ``f`` holds the bytes ``mark``, read in blocks."""
    tail = b""
    while block := f.read(16 << 20):
        window = tail + block
        if mark in window:
            return True
        tail = window[-(len(mark) - 1):]
    return False


def _iteration_of(root: Path) -> int | str | None:
    m = _ITER_RE.match(root.name)
    return int(m.group(1)) if m else ("release" if root.name == "release" else None)


def _read_json(path: Path, stores: Stores) -> dict[str, Any]:
    try:
        data = stores.read_small(path, sidefiles.METADATA_JSON)
    except FileNotFoundError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    value = sidefiles.parse_json(data, path, next_step="the save is damaged")
    if not isinstance(value, dict):
        raise InputError(f"{path}: not Megatron's checkpoint metadata (a JSON object)")
    return value


INTEGRITY = "integrity.json"
_HASH_BLOCK = 8 << 20


def _integrity_entries(doc: Any) -> dict[str, str] | None:
    """``{file: sha256 hex}`` from an ``integrity.json``: a mapping of file to digest (a hex
    string, or an object with ``sha256``), at the top level or under ``files``; or a list of
    objects naming the file (``path``/``file``/``name``) and its ``sha256``. None: not one."""
    if isinstance(doc, dict) and isinstance(doc.get("files"), (dict, list)):
        doc = doc["files"]
    out: dict[str, str] = {}
    items: list[tuple[Any, Any]] = []
    if isinstance(doc, dict):
        items = list(doc.items())
    elif isinstance(doc, list):
        for e in doc:
            if not isinstance(e, dict):
                return None
            items.append((e.get("path") or e.get("file") or e.get("name"), e))
    else:
        return None
    for name, value in items:
        digest = value.get("sha256") if isinstance(value, dict) else value
        if not isinstance(name, str) or not isinstance(digest, str) or not re.fullmatch(
                r"[0-9a-fA-F]{64}", digest):
            continue  # other fields (a version, an algorithm name)
        out[name] = digest.lower()
    return out or None


class MegatronReader(reader.DcpReader):
    """DCP's reader; the common state was read with the metadata; ``integrity.json``, where
    the writer left one, is checked by ``verify``."""

    def check_file_digests(self) -> list[Problem]:
        import hashlib

        base = self.info.base
        path = base / INTEGRITY
        try:  # through the store: a remote checkpoint's is an object
            entries = _integrity_entries(sidefiles.parse_json(
                self.store.read_small(INTEGRITY, sidefiles.METADATA_JSON), path,
                next_step="the save is damaged"))
        except FileNotFoundError:
            return []
        except (OSError, InputError) as e:
            return [error("integrity-unreadable", f"{path}: not readable JSON ({e}); the "
                          "file digests were not checked", file=INTEGRITY)]
        if entries is None:
            return [warning("integrity-unknown", f"{path}: no SHA-256 per file found in it; "
                            "not checked", file=INTEGRITY)]
        problems = []
        buf = memoryview(bytearray(_HASH_BLOCK))
        for name, want in sorted(entries.items()):
            target = (base / name).resolve()
            if base.resolve() not in target.parents:
                problems.append(error("integrity-outside", f"{path}: names '{name}', outside "
                                      "the checkpoint; not read", file=INTEGRITY))
                continue
            digest = hashlib.sha256()
            rel = target.relative_to(base.resolve()).as_posix()
            try:
                size = self.store.size(rel)
            except CkptError:  # (the store's own words name the checkpoint's .metadata)
                problems.append(error("integrity-missing", f"{target}: listed in {INTEGRITY} "
                                      "but missing or not a regular file; copy it again",
                                      file=name))
                continue
            # Object storage fetches the blocks ahead, several at a time (a no-op locally).
            self.store.plan_reads([(rel, at, min(_HASH_BLOCK, size - at))
                                   for at in range(0, size, _HASH_BLOCK)])
            done = 0
            try:
                # Through the store (a local file: a regular file inside the checkpoint,
                # checked on its descriptor, as a FIFO would block), into one buffer; not
                # mapped, so a file cut short meanwhile is a short read, not SIGBUS.
                for block in read_blocks(self.store, rel, 0, size, buf, mapped=False):
                    digest.update(block)
                    done += len(block)
            except CkptError as e:
                problems.append(error("integrity-missing", f"{target}: listed in {INTEGRITY} "
                                      f"but not readable ({e}); copy it again", file=name))
                continue
            if done != size:
                problems.append(error("integrity-missing", f"{target}: listed in {INTEGRITY} "
                                      f"but ends at byte {done} of {size}; copy it again",
                                      file=name))
                continue
            if digest.hexdigest() != want:
                problems.append(error("integrity-mismatch", f"{target}: SHA-256 "
                                      f"{digest.hexdigest()[:16]}... is not the "
                                      f"{want[:16]}... {INTEGRITY} records; the file changed "
                                      "since the save: copy it again", file=name))
        return problems

    def read_object(self, entry: ObjectEntry) -> Any:
        if entry.file is None and isinstance(self.info.values.get(entry.name), UnreadableObject):
            raise self.info.values[entry.name]
        return super().read_object(entry)


def open_reader(info: CheckpointInfo, *, store: Store | None = None) -> Reader:
    return MegatronReader(info, store)
