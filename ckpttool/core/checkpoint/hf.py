"""The Hugging Face files (config, tokenizer) that belong beside a model's weights, and what
the config says about them (tied embeddings, the ``FSDP`` class prefix).

Every file beside a checkpoint is found and read through the ``stores`` its checkpoint was
described with (a remote checkpoint's are objects: listed, sized and read by ranged GETs,
never copied to a local disk). A local file is also checked for what only a local file
system has: links that lead out of the checkpoint, FIFOs and devices."""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError, UnreadableError
from ckpttool.formats.safetensors import json_error
from ckpttool.storage import sidefiles, store
from ckpttool.storage.store import LOCAL, Stores

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

# A side file larger than this is not a config or tokenizer (a 100 GB sparse file planted as
# chat_template.jinja would fill memory and the output).
SIDE_FILE_LIMIT = sidefiles.HF_FILE.limit


@dataclass(frozen=True)
class HfFiles:
    config: dict[str, Any] | None
    config_path: Path | None
    files: tuple[Path, ...]  # files to copy beside the weights
    skipped: tuple[str, ...] = ()  # why a file found there is not used (for warnings)
    roots: tuple[Path, ...] = ()  # real directories a file reached through links may lie in
    # Where config.json came from when not beside the checkpoint: "the run directory ..."
    # (None: beside it, or given with --config, or not found)
    found_in: str | None = None
    # The very bytes ``config`` was parsed from (read once, through a checked descriptor):
    # what is copied into an output, never the name read again.
    config_data: bytes | None = None
    # Where the files are read (a remote checkpoint's objects; local files by default).
    stores: Stores = LOCAL

    def named(self) -> list[tuple[str, Path]]:
        """The side files as an output holds them: (name there, where read). The config is
        ``config.json`` whatever the file given with --config is called."""
        return [(HF_FILES[0] if p == self.config_path else p.name, p) for p in self.files]

    def read(self, path: Path) -> bytes:
        """The bytes of the side file ``path`` (one of :attr:`files`) to write beside the
        weights: config.json as it was read and parsed, the others read now as
        :func:`read_side_file` reads.

        Raises:
            InputError: it changed since the checkpoint was read.
        """
        if path == self.config_path and self.config_data is not None:
            return self.config_data
        return read_side_file(path, self.roots, self.stores)


def read_side_file(path: Path, roots: tuple[Path, ...], stores: Stores = LOCAL) -> bytes:
    """The bytes of a side file found by :func:`find_hf_files`, read through ``stores``: a
    local one through one descriptor that is checked itself (never the name again, which may
    have changed since discovery): a regular file of at most :data:`SIDE_FILE_LIMIT` bytes
    that, if reached through links, lies inside ``roots``.

    Raises:
        InputError: it changed since it was found (now a link out, a FIFO, too large, gone).
    """
    again = "it changed since the checkpoint was read; run again when nothing writes to it"
    if not _local(path, stores):  # an object of ``stores``: its failures in its own words
        try:
            return stores.read_small(path, sidefiles.HF_FILE)
        except FileNotFoundError as e:
            raise InputError(f"{path}: cannot be read ({e.strerror}); {again}") from None
    try:
        fd = sidefiles.open_checked(path, sidefiles.HF_FILE)
    except FileNotFoundError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror}); {again}") from None
    except UnreadableError:  # the user's permissions, not a change: says how to fix it
        raise
    except InputError as e:  # it was a small regular file when it was found
        raise InputError(f"{path}: no longer a regular file of at most "
                         f"{SIDE_FILE_LIMIT:,} bytes; {again}") from e
    try:
        real = store.real_path(fd)
        if real is not None and real != os.path.abspath(path) and not any(
                Path(real).is_relative_to(r) for r in roots):
            raise InputError(f"{path}: now a link to {real}, outside the checkpoint; {again}")
        return sidefiles.read_fd(fd, path, sidefiles.HF_FILE)
    finally:
        os.close(fd)


def _local(path: Path, stores: Stores) -> bool:
    """``path`` is the local file system's (read with the local checks: links out, FIFOs,
    devices), not an object of ``stores``: a local entry is there, or ``stores`` reads that
    directory from local files. A local file gone since it was found is never read through
    ``stores``, whose local reads open by name and follow links: one planted since would be
    read unchecked."""
    if stores is LOCAL or os.path.lexists(path):
        return True
    opened = stores.open(path.parent, metadata_name=path.name)
    try:
        return opened.capabilities.local_files
    finally:
        opened.close()


def _exists(path: Path, stores: Stores) -> bool:
    """Something is at ``path``: a local entry (a broken link too), or a file of ``stores``."""
    return os.path.lexists(path) or stores.file_size(path) is not None


def _unsafe(path: Path, roots: list[Path], stores: Stores = LOCAL) -> str | None:
    """Why the side file ``path`` must not be read or copied, or None: a link that leads out
    of the checkpoint's directories (a stranger's checkpoint must not make the user publish
    /etc/passwd or /proc/self/environ with the merge), not a regular file (a FIFO would block),
    or too large to be a config or tokenizer. No local file there: what ``stores`` lists
    (an object store has no links, FIFOs or devices)."""
    if not _local(path, stores):
        size = stores.file_size(path)
        if size is None:
            return f"{path}: not a regular file; not copied"
        if size > SIDE_FILE_LIMIT:
            return (f"{path}: {size:,} bytes, too large for a config or tokenizer file; "
                    "not copied")
        return None
    try:
        target = path.resolve(strict=True)
        st = target.stat()
    except (OSError, RuntimeError):
        return f"{path}: a broken link; not copied"
    through_links = str(target) != os.path.abspath(path)
    if through_links and not any(target.is_relative_to(r) for r in roots):
        return f"{path}: a link to {target}, outside the checkpoint; not copied"
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: not a regular file; not copied"
    if st.st_size > SIDE_FILE_LIMIT:
        return (f"{path}: {st.st_size:,} bytes, too large for a config or tokenizer file; "
                "not copied")
    return None


def find_hf_files(dcp_dir: Path, config: Path | None = None, *, given: Path | None = None,
                  stores: Stores = LOCAL) -> HfFiles:
    """Config and tokenizer files beside the checkpoint (or in ``config``'s directory), found
    and read through ``stores`` (``config``, named by the user, is a local file).

    A file reached through a link (itself, or a linked directory such as ``huggingface/``)
    is used only when it really lies inside the checkpoint directory or the directory the
    user named (``given``): never the user's home or ``/etc`` by way of a stranger's link.

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
        dirs = _beside(dcp_dir)
    roots = [p.resolve() for p in (dcp_dir, given, config.parent if config else None)
             if p is not None and p.is_dir()]
    skipped: list[str] = []

    def usable(path: Path) -> bool:
        if not _exists(path, stores):
            return False
        why = _unsafe(path, roots, stores)
        if why is not None and why not in skipped:
            skipped.append(why)
        return why is None

    if config is not None:  # named by the user: read it wherever it is, if it is a file
        why = _unsafe(config, [config.resolve().parent])
        if why is not None:
            raise InputError(f"{why} (--config)")
    config_path = config or next((d / "config.json" for d in dirs if usable(d / "config.json")),
                                 None)
    found_in = None
    if config_path is None:
        in_run = next(((d, why) for d, why in run_dirs(dcp_dir, stores)
                       if usable(d / "config.json")), None)
        if in_run is not None:
            config_path, found_in = in_run[0] / "config.json", in_run[1]
    parsed: dict[str, Any] | None = None
    data: bytes | None = None
    if config_path is not None:
        data = (_read_json_file(config_path) if config is not None
                else read_side_file(config_path, tuple(roots), stores))
        parsed = _parse_object(data, config_path, "--config")
        dirs = [config_path.parent] + [d for d in dirs if d != config_path.parent]
    # The config used is the one written, named config.json (a --config file may be called
    # anything, and a config.json beside the checkpoint must not replace it).
    files: list[Path] = [config_path] if config_path is not None else []
    for name in HF_FILES[1:]:
        found = next((d / name for d in dirs if usable(d / name)), None)
        if found is not None:
            files.append(found)
    # The config's directory (resolved: not the file, which a link may replace meanwhile).
    return HfFiles(parsed, config_path, tuple(files), tuple(skipped),
                   roots=tuple(roots) + tuple({c.parent.resolve() for c in (config, config_path)
                                               if c is not None}),
                   found_in=found_in, config_data=data, stores=stores)


def no_config_warning(root: Path, given: Path, *, cast_to: str | None = None,
                      stores: Stores = LOCAL) -> str:
    """What a merge without config.json writes, and how to give it one (``cast_to``: the
    dtype that --dtype casts floating tensors to; None: kept as stored; ``stores``: where
    ``root`` is)."""
    looked = [str(d) for d, _ in run_dirs(root, stores)[:1]]
    where = f"beside {root}" + (f" nor in {looked[0]}" if looked else "")
    dtypes = (f"floating tensors are cast to {cast_to} (--dtype)" if cast_to
              else "dtypes are kept as stored")
    return (f"no config.json found {where}: the output is WEIGHTS ONLY, which from_pretrained "
            f"cannot load ('Unrecognized model'); {dtypes} and tied embeddings "
            "are written twice. Pass the model's config.json (the training run's output_dir "
            f"or the base model's): ckpttool merge {given} OUT --config path/to/config.json")


def no_config_error(root: Path, given: Path, out: Path, *, stores: Stores = LOCAL) -> str:
    """A model's merge without config.json: where it was looked for, and the two ways on."""
    looked = [str(d) for d, _ in run_dirs(root, stores)[:1]]
    where = f"beside {root}" + (f" nor in {looked[0]}" if looked else "")
    return (f"no config.json found {where}: without it the output cannot be checked against "
            "the model that loads it, and from_pretrained cannot load it. Pass the model's "
            f"config.json: ckpttool merge {given} {out} --config path/to/config.json, or ask for "
            f"weights only: ckpttool merge {given} {out} --weights-only")


# A training run's checkpoint directories: the HF Trainer's checkpoint-N, verl's and
# DeepSpeed's global_step_N (global_stepN), torchtitan's step-N.
_STEP_DIR = re.compile(r"(checkpoint|global_step|step)[-_]?(\d+)")


def run_dirs(dcp_dir: Path, stores: Stores = LOCAL) -> list[tuple[Path, str]]:
    """Where a run keeps the model's config.json when a checkpoint lacks it (the HF Trainer
    writes none into a SHARDED_STATE_DICT checkpoint), in order, with how to say it: the run
    directory above the step directory (the Trainer's output_dir, where save_model writes it),
    then the other step directories of the run (listed through ``stores``), newest first."""
    step = next((d for d in (dcp_dir, dcp_dir.parent) if _STEP_DIR.fullmatch(d.name)), None)
    if step is None:
        return []
    run = step.parent
    out = [(run, f"the run directory {run}"), (run / "huggingface", f"the run directory {run}")]
    siblings = [(int(m.group(2)), run / name) for name in stores.listdir(run)
                if name != step.name and (m := _STEP_DIR.fullmatch(name))
                and stores.is_dir(run / name)]
    for _, d in sorted(siblings, reverse=True):
        out.append((d, f"{d.name}, another checkpoint of the same run"))
    return out


ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class JsonFile:
    """A small JSON object read once through a checked descriptor: what was parsed and the
    very bytes it was parsed from (what is written on is these, never the name read again)."""

    doc: dict[str, Any]
    path: Path
    data: bytes


def find_adapter_config(dcp_dir: Path, explicit: Path | None = None, *,
                        given: Path | None = None, stores: Stores = LOCAL) -> JsonFile | None:
    """PEFT's ``adapter_config.json``: ``explicit`` (a local file or its directory), else
    beside the checkpoint, in the same places as ``config.json`` and under the same link
    rules; read as :func:`read_side_file` reads (through ``stores``). None when there is none.

    Raises:
        InputError: ``explicit`` is missing, the file found is not a JSON object, or it
            changed between the check by name and the read (a link out, a FIFO, too large).
    """
    if explicit is not None:
        path = explicit / ADAPTER_CONFIG if explicit.is_dir() else explicit
        if not path.is_file():
            raise InputError(f"{path}: no such adapter config file (--adapter-config)")
        roots = [path.resolve().parent]
        why = _unsafe(path, roots)
        if why is not None:
            raise InputError(f"{why} (--adapter-config)")
    else:
        roots = [p.resolve() for p in (dcp_dir, given) if p is not None and p.is_dir()]
        found = next((d / ADAPTER_CONFIG for d in _beside(dcp_dir)
                      if _exists(d / ADAPTER_CONFIG, stores)
                      and _unsafe(d / ADAPTER_CONFIG, roots, stores) is None), None)
        if found is None:
            return None
        path = found
    data = read_side_file(path, tuple(roots), stores if explicit is None else LOCAL)
    return JsonFile(_parse_object(data, path, "--adapter-config"), path, data)


def read_record(path: Path, limit: int = 1 << 20, *, stores: Stores = LOCAL
                ) -> JsonFile | None:
    """A trainer's small JSON record at ``path`` (a run directory's ``adapter_config.json``,
    verl's ``lora_train_meta.json``), or None where there is none: missing, a link (never
    followed: opened with ``O_NOFOLLOW``), or not a regular file (checked on the descriptor,
    opened without blocking). No local file there: the file ``stores`` has, if any.

    Raises:
        InputError: larger than ``limit``, unreadable, or not a JSON object.
    """
    too_large = InputError(f"{path}: more than {limit:,} bytes, too large for a trainer's "
                           "record; fix or remove it, or pass --adapter-config PATH")
    if not _local(path, stores):
        size = stores.file_size(path)
        if size is None:
            return None
        if size > limit:
            raise too_large
        try:
            data = stores.read_small(path, sidefiles.Kind("trainer's record", limit))
        except FileNotFoundError:
            return None
        return JsonFile(_parse_object(data, path, "--adapter-config"), path, data)
    try:  # the kind first: a device is never opened
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, store.READ_FLAGS | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        if os.path.islink(path):  # ELOOP: a link, not read
            return None
        raise InputError(f"{path}: cannot be read ({e.strerror}); fix or remove it, or pass "
                         "--adapter-config PATH") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        data = f.read(limit + 1)
    if len(data) > limit:
        raise too_large
    return JsonFile(_parse_object(data, path, "--adapter-config"), path, data)


def _parse_object(data: bytes | str, path: Path, option: str) -> dict[str, Any]:
    """``data`` (read from ``path``) parsed; it must hold a JSON object.

    Raises:
        InputError: not valid JSON, or not an object (the message names ``option``).
    """
    try:
        parsed = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _not_json(path, option, e) from e
    if not isinstance(parsed, dict):
        raise InputError(f"{path}: not a JSON object; fix it or pass {option}")
    return parsed


def _not_json(path: Path, option: str, e: Exception) -> InputError:
    return InputError(f"{path}: not valid JSON ({json_error(e)}); fix it or pass {option}")


def _beside(dcp_dir: Path) -> list[Path]:
    """Where a checkpoint's side files are looked for, in order. verl keeps the Hugging Face
    files in a huggingface/ directory beside the rank files."""
    return [dcp_dir, dcp_dir / "huggingface", dcp_dir.parent, dcp_dir.parent / "huggingface"]


def _read_json_file(path: Path) -> bytes:
    """The bytes of the JSON file ``path`` named by the user (read wherever it is), read once
    through a checked descriptor.

    Raises:
        UnreadableError: this process may not read it.
        InputError: not a regular file within the cap.
    """
    try:
        return sidefiles.read_checked(path, sidefiles.HF_FILE)
    except FileNotFoundError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror}); pass an existing file") \
            from None


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


def with_written_dtype(config: dict[str, Any], dtype: str | None
                       ) -> tuple[dict[str, Any], list[str]]:
    """``config`` saying the dtype the weights are written in, as ``save_pretrained`` does
    (``config.dtype`` = the model's first floating parameter's dtype), so ``from_pretrained``
    loads the precision that was written. ``torch_dtype`` (the older key, which older
    transformers read) is updated where present, never added.

    Args:
        dtype: a torch dtype name (``"float32"``), or None (no floating tensor: unchanged).
    """
    if dtype is None:
        return config, []
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    changes = [f"{k}: {config.get(k)} -> {dtype}" for k in keys if config.get(k) != dtype]
    if not changes:
        return config, []
    return {**config, **dict.fromkeys(keys, dtype)}, changes


def strip_fsdp_prefix(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Remove the ``FSDP`` class prefix that FSDP wrapping leaks into ``architectures``."""
    arch = config.get("architectures")
    if not isinstance(arch, list):
        return config, []
    fixed = [a[4:] if isinstance(a, str) and a.startswith("FSDP") and len(a) > 4 else a
             for a in arch]
    changed = [f"{a} -> {b}" for a, b in zip(arch, fixed, strict=True) if a != b]
    return ({**config, "architectures": fixed} if changed else config), changed
