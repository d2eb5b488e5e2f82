"""The output's contract: the tensors its consumer takes, held against what a merge plans.

A merge's output is read by a known consumer: the model class its config.json names, as
``from_pretrained`` builds it. Before anything is published, :func:`check` builds that class
on the meta device (no weight in memory, none read), takes its state dict's names and shapes
(parameters and persistent buffers), lets go of what the config ties and what the class
itself ignores on load, and compares them with the planned tensors: a missing or misshapen
tensor is an error (the model would start with it randomly initialised, or refuse it),
a tensor the model does not take is a warning.

Hub layouts are held as transformers converts them on load: a runtime tensor that
:mod:`~ckpttool.core.transforms.hub_layout` splits (fused experts) or renames (vision-language
prefixes) is satisfied by its save_pretrained parts, and transformers 4.5x's
``_checkpoint_conversion_mapping`` renames are applied to the planned names first.

Consumers are a small registry (:data:`LOADERS`): ``transformers`` today; a loader for vLLM or
SGLang (their weight-name maps, on CPU) is one more entry where the package is importable.

Private upstream attributes are read here only (``_keys_to_ignore_on_load_*``,
``_checkpoint_conversion_mapping``, 4.x's ``_tied_weights_keys``): they are how
``from_pretrained`` itself decides what is missing; ``tests/core/test_contract.py`` fails
loudly when an upgrade moves them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from ckpttool.core import contract_cache, quantization
from ckpttool.core.runtime import forked
from ckpttool.core.runtime.report import Section, section
from ckpttool.core.transforms import hub_layout
from ckpttool.errors import InputError, UnsupportedError, UsageError
from ckpttool.formats.base import Problem, Tensor, error, warning
from ckpttool.formats.codecs.dtypes import BY_NAME

Shapes = Mapping[str, tuple[int, ...]]

INSTALL_HINT = "pip install transformers"


@dataclass(frozen=True)
class Expected:
    """What a consumer takes: its tensors (runtime names and shapes), which of them are tied
    copies of another, and the names it lets go of on load."""

    consumer: str  # "LlamaForCausalLM (transformers 5.23.0)"
    tensors: dict[str, tuple[int, ...]]
    tied: dict[str, str] = field(default_factory=dict)  # target -> source
    ignore_missing: tuple[str, ...] = ()  # regexes
    ignore_unexpected: tuple[str, ...] = ()  # regexes
    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement), applied on load


class Unavailable(Exception):
    """The consumer cannot be built here (its package is missing, the config names no model
    it knows): the contract is not checked, and the report says why and how to get it
    (``missing``: a package to install)."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Loader:
    """One consumer: its name, and how it builds :class:`Expected` from a config."""

    name: str
    expected: Callable[[Mapping[str, Any]], Expected]
    # The packages ``expected`` imports, whose installed versions (with the config) key what
    # it gave on disk (:mod:`~ckpttool.core.contract_cache`); empty: not kept.
    packages: tuple[str, ...] = ()
    # What to run where ``expected`` finds its package missing (Unavailable(missing=True)).
    install: str = INSTALL_HINT


@section
class Mismatch(Section):
    """A tensor written in one shape that its consumer expects in another."""

    name: str
    shape: list[int]
    expected: list[int]


@section
class Contract(Section):
    """The output held against its consumer: ``checked`` False says why not (``reason``) and
    how to get the check (``hint``)."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"reason", "hint", "consumer"})

    loader: str
    checked: bool
    consumer: str | None = None
    reason: str | None = None
    hint: str | None = None
    expected: int = 0
    missing: list[str] = field(default_factory=list)
    misshapen: list[Mismatch] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # not taken: a warning
    ignored: list[str] = field(default_factory=list)  # not taken, and ignored by the loader
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.missing and not self.misshapen

    def problems(self, where: str) -> list[Problem]:
        """Each finding as a verify problem (missing and misshapen: errors; extra: a warning;
        not checked: a warning saying how to get the check)."""
        if not self.checked:
            return [warning("contract-unchecked", self.not_checked(where))]
        who = self.consumer or self.loader
        out = [error("contract-missing", f"{where}: '{n}' is missing; {who} expects it (it "
                     "would be left randomly initialised)", tensor=n) for n in self.missing]
        out += [error("contract-shape", f"{where}: '{m.name}' has shape {m.shape}; {who} "
                      f"expects {m.expected}", tensor=m.name) for m in self.misshapen]
        if self.extra:
            out.append(warning("contract-extra", self.extra_message(where),
                               tensor=self.extra[0]))
        return out

    def not_checked(self, where: str) -> str:
        return (f"{where}: not checked against its consumer ({self.reason})"
                + (f"; to check it: {self.hint}" if self.hint else ""))

    def extra_message(self, where: str) -> str:
        who = self.consumer or self.loader
        return (f"{where}: {len(self.extra)} tensor(s) that {who} does not take, e.g. "
                f"'{self.extra[0]}' (loaded, they would be dropped)")

    def raise_if_broken(self, where: str, *, next_step: str) -> None:
        """An :class:`InputError` naming the first missing or misshapen tensor and what
        expected it; nothing when the consumer takes it whole (or it was not checked)."""
        if self.ok:
            return
        who = self.consumer or self.loader
        more = len(self.missing) + len(self.misshapen) - 1
        also = f" (and {more} more problem(s))" if more > 0 else ""
        if self.missing:
            what = f"'{self.missing[0]}' is missing, which {who} expects"
        else:
            m = self.misshapen[0]
            what = f"'{m.name}' has shape {m.shape}, where {who} expects {m.expected}"
        raise InputError(f"{where}: {what}{also}; nothing was written. {next_step}")


# --------------------------------------------------------------------------------------------
# The transformers loader


def _transformers_expected(config: Mapping[str, Any]) -> Expected:
    """The model class ``config`` names, built on the meta device by transformers."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise Unavailable(f"transformers (with torch) is not installed here ({e})",
                          missing=True) from None
    model = _build(transformers, torch, config)
    version = transformers.__version__
    tensors = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    tied = _tied(model, config)
    return Expected(
        consumer=f"{type(model).__name__} (transformers {version})",
        tensors=tensors, tied=tied,
        ignore_missing=tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
        ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                or ()) + _legacy_buffers(tensors, model),
        renames=tuple((str(k), str(v)) for k, v in
                      (getattr(model, "_checkpoint_conversion_mapping", None) or {}).items()))


def _build(transformers: Any, torch: Any, config: Mapping[str, Any]) -> Any:
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise Unavailable("config.json names no model_type")
    with _quiet(transformers):
        try:
            cfg = transformers.AutoConfig.for_model(
                model_type, **{k: v for k, v in config.items() if k != "model_type"})
        except (ValueError, KeyError) as e:
            raise Unavailable(f"transformers {transformers.__version__} does not know "
                              f"model_type {model_type!r} ({_first_line(e)})") from None
        cls = _model_class(transformers, config, cfg)
        try:
            with torch.device("meta"), _no_init(transformers):
                return cls(cfg) if cls is not None else _auto(transformers, cfg)
        except Unavailable:
            raise
        except Exception as e:  # a config the class cannot be built from
            raise Unavailable(f"{_name(config)} cannot be built from this config by "
                              f"transformers {transformers.__version__} "
                              f"({type(e).__name__}: {_first_line(e)})") from None


@contextlib.contextmanager
def _no_init(transformers: Any) -> Iterator[None]:
    """transformers' own context that skips weight initialisation while a model is built
    (torch's ``nn.init`` functions and the class's ``init_weights``): on the meta device
    they compute nothing, but cost most of a large model's build (a 405B Llama: 1.1 s of
    1.5). Names and shapes do not depend on it (``tests/core/test_contract.py`` builds
    each family both ways). 5.x has it in ``initialization``, 4.x in ``modeling_utils``;
    like from_pretrained's, it swaps those functions process-wide while it is held."""
    for where in ("initialization", "modeling_utils"):
        try:
            module = importlib.import_module(f"transformers.{where}")
        except ImportError:
            continue
        no_init = getattr(module, "no_init_weights", None)
        if no_init is not None:
            with no_init():
                yield
            return
    yield


def _model_class(transformers: Any, config: Mapping[str, Any], cfg: Any) -> Any:
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch is None:
        return None
    if arch.startswith("FSDP"):  # accelerate's wrapper class name (hf.strip_fsdp_prefix)
        arch = arch[len("FSDP"):]
    cls = getattr(transformers, arch, None)
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        return cls
    return None  # a class transformers lacks (remote code): its family's auto class


def _auto(transformers: Any, cfg: Any) -> Any:
    # A config without architectures: what from_pretrained's usual auto class for its
    # family builds (a language model, else a vision-language one, else the base model).
    autos = [getattr(transformers, name, None) for name in (
        "AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel")]
    for auto in (a for a in autos if a is not None):
        try:
            return auto.from_config(cfg)
        except ValueError:
            continue
    raise Unavailable(f"transformers has no model class for model_type {cfg.model_type!r}")


def _tied(model: Any, config: Mapping[str, Any]) -> dict[str, str]:
    expanded = getattr(model, "all_tied_weights_keys", None)  # transformers 5: target->source
    if isinstance(expanded, Mapping):
        return {str(k): str(v) for k, v in expanded.items()}
    keys = getattr(model, "_tied_weights_keys", None)  # 4.x: targets, tied to the input
    if not keys or not getattr(model.config, "tie_word_embeddings", False):
        return {}
    embed = model.get_input_embeddings()
    source = next((n for n, p in model.named_parameters() if p is embed.weight), None)
    return {str(k): source for k in keys if source is not None and str(k) != source}


def _legacy_buffers(tensors: Mapping[str, Any], model: Any) -> tuple[str, ...]:
    """Names transformers lets go of although no class lists them: old per-layer rotary
    buffers and ``position_ids`` (persistent once, not any more)."""
    buffers = [n for n, _ in model.named_buffers()]
    out = []
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        out.append(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        out.append(r"(^|\.)position_ids$")
    return tuple(out)


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    logging = transformers.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _name(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else str(config.get("model_type"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


# The consumers a check can be held against; vLLM and SGLang are addable here (their
# weight-name maps, on CPU) where they are importable: one entry each, which ``--loader NAME``
# takes with no other change (a loader whose package is missing raises Unavailable(missing=
# True): the report says how to install it).
LOADERS: dict[str, Loader] = {
    "transformers": Loader("transformers", _transformers_expected,
                           packages=("transformers", "torch")),
}


# --------------------------------------------------------------------------------------------
# The check


@functools.lru_cache(maxsize=8)
def _expected_cached(loader: str, config_json: str) -> Expected:
    """What ``loader`` takes for the config, from the disk cache where the same config and
    package versions were seen before (no import at all), else built and kept."""
    spec = LOADERS[loader]
    name = contract_cache.key(loader, config_json, spec.packages) if spec.packages else None
    kept = contract_cache.load(name) if name is not None else None
    found = _from_json(kept) if kept is not None else None
    if found is not None:
        return found
    built = spec.expected(json.loads(config_json))
    if name is not None:
        contract_cache.store(name, _to_json(built))
    return built


def _to_json(exp: Expected) -> dict[str, Any]:
    return {"consumer": exp.consumer, "tensors": [[n, list(s)] for n, s in exp.tensors.items()],
            "tied": exp.tied, "ignore_missing": list(exp.ignore_missing),
            "ignore_unexpected": list(exp.ignore_unexpected),
            "renames": [list(r) for r in exp.renames]}


def _from_json(doc: Mapping[str, Any]) -> Expected | None:
    """:func:`_to_json`'s document back, or None where any field is not what it writes."""
    def strings(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(v, str) for v in x)

    consumer, tensors, tied = doc.get("consumer"), doc.get("tensors"), doc.get("tied")
    renames = doc.get("renames")
    if not (isinstance(consumer, str) and isinstance(tensors, list)
            and isinstance(tied, dict) and strings(list(tied)) and strings(list(tied.values()))
            and strings(doc.get("ignore_missing")) and strings(doc.get("ignore_unexpected"))
            and isinstance(renames, list) and all(strings(r) and len(r) == 2 for r in renames)
            and all(isinstance(t, list) and len(t) == 2 and isinstance(t[0], str)
                    and isinstance(t[1], list)
                    and all(type(d) is int and d >= 0 for d in t[1]) for t in tensors)):
        return None
    return Expected(consumer, {n: tuple(s) for n, s in tensors}, dict(tied),
                    tuple(doc["ignore_missing"]), tuple(doc["ignore_unexpected"]),
                    tuple((a, b) for a, b in renames))


def expected(config: Mapping[str, Any], *, loader: str = "transformers") -> Expected:
    """What ``loader`` takes for ``config`` (cached per config).

    Raises:
        Unavailable: the loader is not importable here, or cannot build the config's model.
        InputError: an unknown loader name.
    """
    if loader not in LOADERS:
        raise UsageError(f"unknown loader {loader!r}; choose one of {', '.join(LOADERS)}")
    return _expected_cached(loader, json.dumps(config, sort_keys=True, default=str))


def built_here(config: Mapping[str, Any] | None, *, loader: str = "transformers") -> bool:
    """True where :func:`check` for ``config`` would build the consumer (import its package
    and the model's modules: seconds of CPU), False where it costs no import: no config, a
    loader that keeps nothing, or what it takes for this config and these package versions
    kept on disk (:mod:`~ckpttool.core.contract_cache`). Reads no package."""
    if config is None or loader not in LOADERS or not LOADERS[loader].packages:
        return False
    name = contract_cache.key(loader, json.dumps(config, sort_keys=True, default=str),
                              LOADERS[loader].packages)
    return name is not None and contract_cache.load(name) is None


T = TypeVar("T")


class Beside(Generic[T]):
    """``fn`` run in a thread of its own while the caller streams the output; :meth:`join`
    waits for it and returns what it returned, or raises what it raised (every time it is
    called). A merge joins it before publishing (:mod:`ckpttool.core.merge.guards`), so a
    broken contract still publishes nothing and exits as before; the consumer's imports
    (about 4 s of CPU, single-threaded) then overlap the streaming instead of preceding it."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckpttool-contract",
                                        daemon=True)
        forked.importing(self._thread)  # the merge runs its shares in threads meanwhile
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as e:  # re-raised by join, in the caller's thread
            self._error = e

    def wait(self) -> None:
        """:meth:`join`, for a check before publishing (it raises, or returns nothing)."""
        self.join()

    def join(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def check(planned: Shapes, config: Mapping[str, Any] | None, *,
          loader: str = "transformers") -> Contract:
    """``planned`` (output names and shapes) held against the consumer ``config`` names.
    Reads no tensor data: names and shapes only.

    Returns:
        A :class:`Contract`; ``checked`` False where no config is there or the loader cannot
        be built here (``reason`` and ``hint`` say why and what to do).
    """
    return _checked(config, loader, "pass the model's config.json with --config",
                    lambda exp, cfg: compare(planned, exp, cfg, loader=loader))


def compare(planned: Shapes, exp: Expected, config: Mapping[str, Any], *,
            loader: str = "transformers") -> Contract:
    """Pure: ``planned`` against ``exp``; hub-layout parts stand for the runtime tensor
    they make, tied targets may be absent where their source is there."""
    planned = _renamed(planned, exp.renames)
    planned, quantized, free = _quantized(planned, config)
    out = Contract(loader, True, consumer=exp.consumer, expected=len(exp.tensors))
    taken: set[str] = set(quantized)
    ignore_missing = _regex(exp.ignore_missing)
    for name, shape in exp.tensors.items():
        forms = _forms(name, shape, config)
        found = None
        for form in forms:
            if all(n in planned for n, _ in form):
                found = form
                break
        if found is not None:
            taken.update(n for n, _ in found)
            bad = [(n, s) for n, s in found
                   if n not in free and tuple(planned[n]) != tuple(s)]
            out.misshapen += [Mismatch(n, list(planned[n]), list(s)) for n, s in bad]
            continue
        partial = [n for form in forms for n, _ in form if n in planned]
        taken.update(partial)
        if name in exp.tied and _present(exp.tied[name], exp, planned, config):
            continue
        if ignore_missing is not None and ignore_missing.search(name):
            continue
        # a fused tensor with some experts there: name the first expert missing
        missing = [n for n, _ in forms[-1] if n not in planned] if partial else [name]
        out.missing.append(missing[0] if missing else name)
    ignore_unexpected = _regex(exp.ignore_unexpected)
    for name in planned:
        if name in taken:
            continue
        if ignore_unexpected is not None and ignore_unexpected.search(name):
            out.ignored.append(name)
        else:
            out.extra.append(name)
    return out


def _quantized(planned: Shapes, config: Mapping[str, Any]
               ) -> tuple[Shapes, set[str], set[str]]:
    """A model config.json says is quantized, as transformers' quantizer builds it: each
    group of stored parts (a float8 weight and its scale, MXFP4 blocks and scales, NVFP4
    packed values and scales) stands for its module's weight, and the other quantization
    tensors (activation scales, zero points) are the quantized module's own.

    Returns:
        ``planned`` with each group's weight present; the stored names that are part of
        a quantized module (taken, never extra); the weights whose stored shape the scheme
        decides (packed, blocked: not compared with the unquantized shape).
    """
    if quantization.quantization_config(config) is None:
        return planned, set(), set()
    s = quantization.scheme(config, {})
    if s is None:
        return planned, set(), set()
    found, other = quantization.groups(s, planned)
    out = dict(planned)
    taken, free = set(other), set()
    for g in found:
        parts = {p for _, p in g.parts}
        taken |= parts - {g.out}
        if g.out not in planned or g.part("q") != g.out:
            out.setdefault(g.out, planned[g.part("q")])
            free.add(g.out)
            taken.add(g.part("q"))
    return out, taken, free


def compare_state_dict(planned: Shapes, exp: Expected, *, prefix: str | None = None,
                       loader: str = "transformers") -> Contract:
    """Pure: ``planned`` against the model's own state dict, as ``dcp.load`` of
    ``get_model_state_dict(model)`` (accelerate's ``load_fsdp_model``) asks for it: every
    key, tied copies included, under ``prefix``; no layout conversion, nothing ignored."""
    lead = f"{prefix}." if prefix else ""
    out = Contract(loader, True, consumer=f"dcp.load of {exp.consumer}'s state dict",
                   expected=len(exp.tensors))
    for name, shape in exp.tensors.items():
        key = lead + name
        if key not in planned:
            out.missing.append(key)
        elif tuple(planned[key]) != tuple(shape):
            out.misshapen.append(Mismatch(key, list(planned[key]), list(shape)))
    wanted = {lead + n for n in exp.tensors}
    out.extra = [n for n in planned if n not in wanted]
    return out


def tied_copies(present: Shapes, config: Mapping[str, Any] | None) -> dict[str, str]:
    """The tied copies (target -> source) the model's state dict holds that ``present``
    lacks while it holds their source: what a DCP for resuming must write again. Empty
    where the model cannot be built here."""
    if config is None:
        return {}
    try:
        exp = expected(config)
    except Unavailable:
        return {}
    return {t: s for t, s in exp.tied.items() if t not in present and s in present}


def check_state_dict(planned: Shapes, config: Mapping[str, Any] | None, *,
                     prefix: str | None = None, loader: str = "transformers") -> Contract:
    """:func:`compare_state_dict` for the model ``config`` names; not checked (and why)
    where there is no config or the loader cannot be built."""
    return _checked(config, loader, "put the model's config.json beside SRC",
                    lambda exp, _: compare_state_dict(planned, exp, prefix=prefix,
                                                       loader=loader))


def _checked(config: Mapping[str, Any] | None, loader: str, no_config: str,
             held: Callable[[Expected, Mapping[str, Any]], Contract]) -> Contract:
    """``held`` against what ``loader`` takes for ``config``, timed; not checked (``reason``
    and ``hint``) where there is no config (``no_config``: what to do) or the loader cannot
    be built here."""
    started = time.perf_counter()
    if config is None:
        return Contract(loader, False, reason="no config.json names the model", hint=no_config)
    try:
        exp = expected(config, loader=loader)
    except Unavailable as e:
        return Contract(loader, False, reason=str(e),
                        hint=LOADERS[loader].install if e.missing else None)
    result = held(exp, config)
    result.seconds = round(time.perf_counter() - started, 3)
    return result


def _forms(name: str, shape: tuple[int, ...], config: Mapping[str, Any]
           ) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The ways an output can hold runtime tensor ``name``: as itself, and as the
    save_pretrained layout's parts (last, where there are any)."""
    forms = [[(name, shape)]]
    stand_in = Tensor(name, (name,), BY_NAME["F32"], shape, ())
    try:
        converted = hub_layout.convert([(name, stand_in)], config)
    except InputError:
        return forms
    if converted is not None:
        forms.append([(n, tuple(s.shape)) for n, s in converted.sources])
    return forms


def _present(name: str, exp: Expected, planned: Shapes, config: Mapping[str, Any]) -> bool:
    shape = exp.tensors.get(name)
    if shape is None:
        return name in planned
    return any(all(n in planned for n, _ in form) for form in _forms(name, shape, config))


def _renamed(planned: Shapes, renames: tuple[tuple[str, str], ...]) -> Shapes:
    if not renames:
        return planned
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in planned.items():
        for pattern, target in renames:
            new, n = re.subn(pattern, target, name)
            if n:
                name = new
                break
        out[name] = shape
    return out


def _regex(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def verify_problems(names: Shapes, config: Mapping[str, Any] | None, *, where: str,
                    loader: str = "transformers") -> list[Problem]:
    """``verify PATH --loader``: the checkpoint's tensors held against the model ``config``
    names, each finding a coded problem.

    Raises:
        InputError: no config.json (the consumer is unknown) or an unknown loader.
        UnsupportedError: the loader's package is not installed here.
    """
    if loader not in LOADERS:
        raise UsageError(f"unknown loader {loader!r}; choose one of {', '.join(LOADERS)}")
    if config is None:
        raise InputError(f"{where}: no config.json beside it names the model --loader "
                         f"{loader} would build; pass it with --config")
    result = check(names, config, loader=loader)
    install = LOADERS[loader].install
    if not result.checked and result.hint == install:
        raise UnsupportedError(f"--loader {loader}: {result.reason}; install it: {install}")
    return result.problems(where)


def skipped(reason: str, *, loader: str = "transformers") -> Contract:
    """A contract not checked on purpose (``--weights-only``, an adapter's output)."""
    return Contract(loader, False, reason=reason)
